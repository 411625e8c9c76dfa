"""A notebook's first cells on their own, in a kernel: which NPROC it accepts, in seconds.

Every notebook checks its parameters in its first code cells (`params.check(NPROC, BACKEND, ...)`),
so running those cells alone answers "does it run with NPROC = n?" without starting a rank.
The runner asks this to pick each notebook's NPROC on a GPU node; the tests ask it for every NPROC.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import nbformat

CHECK_WITHIN = 3  # params.check( must be in one of a notebook's first code cells
# zmq's limit on an ipc:// path (a Unix socket's sun_path, less its closing NUL). Jupyter's runtime directory,
# ~/.local/share/jupyter/runtime, is HOME plus 29 characters, and a kernel's sockets there HOME plus 79: a
# 30-character HOME is already too long. The course's kernels keep their sockets in a short private directory.
SOCKET_PATH_MAX = 107
SOCKET_NAME = "kernel-ipc"  # jupyter_client binds `{ip}-{n}`, n from 1: the longest is `kernel-ipc-65535`
PRIVATE_PREFIX = "course-kernel-"  # mkdtemp adds 8 characters


def socket_base() -> str:
    """Where kernel directories go: TMPDIR when sockets there fit zmq's limit, else /tmp; ValueError if neither."""
    longest = os.path.join(PRIVATE_PREFIX + "x" * 8, f"{SOCKET_NAME}-65535")
    tried = []
    for base in dict.fromkeys([tempfile.gettempdir(), "/tmp"]):
        path = os.path.join(base, longest)
        if len(path) <= SOCKET_PATH_MAX and os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            return base
        tried.append(f"{base} ({len(path)} characters with a socket's name)")
    raise ValueError(
        f"no directory for a kernel's sockets within zmq's {SOCKET_PATH_MAX} characters: tried "
        + ", ".join(tried)
        + "; set TMPDIR to a short writable directory (export TMPDIR=/tmp)"
    )


def private_dir(prefix: str = PRIVATE_PREFIX) -> Path:
    """A new directory (mode 0700: only this user reaches the sockets in it) short enough for a kernel's sockets."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=socket_base()))


def setup_cells(nb: Any) -> tuple[str, list[str]]:
    """(the parameters cell, the code cells after it up to the first `params.check(` call) of an nbformat notebook."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    first = next(i for i, c in enumerate(code) if "parameters" in c.metadata.get("tags", []))
    check = next((i for i, c in enumerate(code[:CHECK_WITHIN]) if "params.check(" in c.source), None)
    if check is None or check <= first:
        raise ValueError(
            f"none of the first {CHECK_WITHIN} code cells calls params.check(NPROC, BACKEND, ...) after the parameters"
        )
    return code[first].source, [c.source for c in code[first + 1 : check + 1]]


class Kernel:
    """One IPython kernel (as papermill starts it, over IPC sockets) that runs code and reports errors."""

    def __init__(self, cwd: Path, env: dict[str, str], ipc_path: Path) -> None:
        from jupyter_client import KernelManager

        self.km = KernelManager(
            kernel_name="python3",
            transport="ipc",
            ip=str(ipc_path),
            connection_file=str(ipc_path.parent / "kernel.json"),  # beside the sockets, not in Jupyter's runtime dir
        )
        self.km.start_kernel(cwd=str(cwd), env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float = 120) -> tuple[str, str, float]:
        """(exception name or "", its message, seconds) for one cell."""
        start = time.monotonic()
        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=lambda msg: None)
        content = reply["content"]
        seconds = time.monotonic() - start
        if content["status"] == "ok":
            return "", "", seconds
        return content.get("ename", "?"), content.get("evalue", ""), seconds

    def close(self) -> None:
        """Shut the kernel down (again: nothing)."""
        if self.km.has_kernel:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=True)


def kernel_env(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "COURSE_HEADLESS": "1", "TMPDIR": str(tmp)}  # temp dirs the cells make go here
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


class Setup:
    """A notebook's parameters and setup cells, run in one kernel with any parameters."""

    def __init__(self, nb: Any, kernel: Kernel) -> None:
        self.parameters, self.cells = setup_cells(nb)
        self.kernel = kernel

    def run(self, **values: Any) -> tuple[str, str, float]:
        """(exception name or "", message, seconds) of the parameters cell, `values` injected, then the setup."""
        injected = "".join(f"\n{k} = {v!r}" for k, v in values.items())
        name, message, seconds = self.kernel.run(self.parameters + injected)
        if name:
            raise RuntimeError(f"the parameters cell raised {name}: {message}")
        for source in self.cells:
            name, message, cell_seconds = self.kernel.run(source)
            seconds += cell_seconds
            if name:
                break
        return name, message, seconds


class ProbeError(Exception):
    """A notebook's setup cells failed otherwise than by refusing NPROC, or it has none to ask."""


def start_kernel(cwd: Path, tmp: Path) -> Kernel:
    """A kernel in the notebook's directory, for its parameters and setup cells alone (sockets in `tmp`: short)."""
    return Kernel(cwd, kernel_env(tmp), tmp / SOCKET_NAME)


def choose_nproc(path: Path, up_to: int, parameters: dict) -> tuple[int | None, str]:
    """(the largest NPROC from `up_to` down to 1 that the notebook accepts with `parameters`, "").

    The notebook's own check decides (`params.check` in its setup cells). (None, the refusal of
    NPROC=1: a ParameterError message naming the values that work) when it accepts none.
    """
    nb = nbformat.read(path, as_version=4)
    try:
        setup_cells(nb)
    except (ValueError, StopIteration) as error:  # StopIteration: no cell tagged parameters
        raise ProbeError(f"cannot choose NPROC: {error or 'no cell tagged parameters'}") from None
    with tempfile.TemporaryDirectory(prefix=PRIVATE_PREFIX, dir=socket_base()) as tmp:
        kernel = start_kernel(path.parent, Path(tmp))
        try:
            setup, refusal = Setup(nb, kernel), ""
            for nproc in range(up_to, 0, -1):
                name, message, _ = setup.run(**{**parameters, "NPROC": nproc})
                if not name:
                    return nproc, ""
                if name != "ParameterError":
                    raise ProbeError(f"setup cells with NPROC={nproc}: {name}: {message}"[:200])
                refusal = message
            return None, refusal
        except RuntimeError as error:  # the parameters cell itself raised
            raise ProbeError(str(error)[:200]) from None
        finally:
            kernel.close()
