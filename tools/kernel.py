"""The runner's notebook kernel: its sockets in a short private directory, and why it is gone when it dies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools import probe


class KernelFailure(Exception):
    """The notebook's kernel could not start, or died: the message says why (its exit status, its last stderr)."""


def ipc_kernel_manager(directory: Path, launched: list[Any]) -> type:
    """A kernel manager whose kernel talks over Unix sockets in `directory` (short, private) instead of loopback TCP.

    ipykernel warns "Kernel is running over TCP without encryption" for a TCP kernel without CurveZMQ
    keys: anyone on the machine could connect to its ports. IPC sockets in a directory of mode 0700
    (probe.private_dir) reach only this user, and the warning has no cause left. Not Jupyter's runtime
    directory: under a long HOME the sockets there exceed zmq's 107 characters (probe.SOCKET_PATH_MAX).
    The connection file goes beside them; the kernel's own stderr goes to `kernel.log` there, for the
    failure message; each kernel process started is appended to `launched`, for its exit status.
    """
    from jupyter_client import AsyncKernelManager
    from traitlets import default

    class IPCKernelManager(AsyncKernelManager):
        transport = "ipc"

        @default("ip")
        def _absolute_ipc_path(self) -> str:
            # jupyter_client's default can be the relative "kernel-ipc", which the kernel resolves in
            # the notebook's directory and the client in ours: an absolute path is the same for both.
            return str(directory / probe.SOCKET_NAME)

        @default("connection_file")
        def _connection_file_beside_sockets(self) -> str:
            return str(directory / "kernel.json")

        async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
            with open(directory / "kernel.log", "ab") as log:  # the child keeps its own descriptor
                await super()._async_launch_kernel(kernel_cmd, **{**kw, "stderr": log})
            launched.append(getattr(self.provisioner, "process", None))

    return IPCKernelManager


def kernel_failure(error: BaseException, directory: Path, launched: list[Any], lines: int = 15) -> str:
    """Why the kernel is gone: the error, the kernel process's exit status and the end of its stderr."""
    process = next((p for p in reversed(launched) if p is not None), None)
    status = process.poll() if process is not None else None
    if process is None:
        what = "the kernel did not start"
    elif status is None:
        what = "the kernel stopped answering (its process is still running)"
    else:
        what = f"the kernel's process ended with exit status {status}"
    log = directory / "kernel.log"
    tail = log.read_text(errors="replace").rstrip().splitlines()[-lines:] if log.exists() else []
    said = "\n".join(["its last stderr:", *tail]) if tail else "it wrote nothing to stderr"
    return f"{what} ({type(error).__name__}: {error}); {said}"


def is_kernel_failure(error: BaseException) -> bool:
    """A dead or unreachable kernel (nbclient, jupyter_client, zmq), as opposed to a cell's error or a bad notebook."""
    from nbclient.exceptions import DeadKernelError

    if isinstance(error, (DeadKernelError, KernelFailure)) or type(error).__module__.startswith("zmq"):
        return True
    return isinstance(error, (RuntimeError, TimeoutError)) and "kernel" in str(error).lower()
