"""Fixtures of the browser smoke test: a private JupyterLab server and headless Chromium.

`lab` starts JupyterLab on a free 127.0.0.1 port with a token, private Jupyter config, data,
runtime, settings and workspace directories, on a learner's copy of the notebooks made in a temporary
folder as `make lab` makes practice/ (outputs cleared; the stored notebooks are never modified).
Every process it starts (server, kernels, torchrun agents, ranks)
carries a marker in its environment; teardown stops the server and fails the test if any
marked process is still alive afterwards (after killing it).

`browser` is the system Chromium (Debian's `chromium` package) driven by playwright; no
browser is downloaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tools import editions

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "build" / "browser"  # screenshots and the server log, for a human to look at
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
MARKER = "COURSE_BROWSER_TEST_ID"  # environment variable every process of the test inherits

# User settings of the private JupyterLab: every cell in the DOM (no lazy windowing), no news or
# update checks (no network, no pop-up over the notebook).
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "checkForUpdates": False,
        "fetchNews": "false",
    },
}


@dataclass
class Lab:
    url: str  # http://127.0.0.1:PORT
    token: str
    root: Path  # the temporary copy of notebooks/
    marker: str
    proc: subprocess.Popen

    def api(self, method: str, path: str, timeout: float = 10) -> object:
        request = urllib.request.Request(
            f"{self.url}{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        if method in ("POST", "PUT", "PATCH"):
            request.data = b""
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self, wait: float = 30) -> None:
        """Shut down every kernel, then wait until no rank process of the test is left."""
        for kernel in self.api("GET", "/api/kernels"):
            with contextlib.suppress(urllib.error.URLError, TimeoutError):
                self.api("DELETE", f"/api/kernels/{kernel['id']}", timeout=30)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and [p for p in marked_processes(self.marker) if p.pid != self.proc.pid]:
            time.sleep(0.5)


def marked_processes(marker: str) -> list[psutil.Process]:
    """Every live process whose environment carries this test's marker (reparented ones too)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if proc.environ().get(MARKER) == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _lab_env(home: Path, marker: str) -> dict[str, str]:
    env = dict(os.environ)
    # The root conftest sets COURSE_HEADLESS=1 for papermill runs; here the explorers must be live
    # widgets. No pytest variables or forced matplotlib backend either: this is a user's JupyterLab.
    for name in list(env):
        if name in ("COURSE_HEADLESS", "MPLBACKEND") or name.startswith("PYTEST_"):
            del env[name]
    env.update(
        JUPYTER_CONFIG_DIR=str(home / "config"),
        JUPYTER_DATA_DIR=str(home / "data"),
        JUPYTER_RUNTIME_DIR=str(home / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
        IPYTHONDIR=str(home / "ipython"),
        JUPYTER_PLATFORM_DIRS="0",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        PYTHONUNBUFFERED="1",
    )
    env[MARKER] = marker
    return env


def _wait_until_serving(lab: Lab, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if lab.proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {lab.proc.returncode}:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(OSError, ValueError):
            lab.api("GET", "/api/status", timeout=5)
            return
        time.sleep(0.5)
    raise TimeoutError(f"jupyter lab did not answer within {timeout:.0f} s:\n{log.read_text()[-4000:]}")


def _stop(lab: Lab) -> list[str]:
    """Stop the server and everything it started; return the processes that had to be killed."""
    with contextlib.suppress(Exception):
        lab.shutdown_kernels(wait=20)
    with contextlib.suppress(Exception):
        lab.api("POST", "/api/shutdown", timeout=10)
    try:
        lab.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(lab.proc.pid, signal.SIGTERM)
        try:
            lab.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(lab.proc.pid, signal.SIGKILL)
            lab.proc.wait(timeout=15)
    # Kernels, torchrun agents and ranks are given a moment to exit on their own ...
    deadline = time.monotonic() + 20
    left = marked_processes(lab.marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = marked_processes(lab.marker)
    # ... and whatever is still there is a leak: kill it and report it.
    leaked = []
    for proc in left:
        with contextlib.suppress(psutil.Error):
            leaked.append(f"pid {proc.pid}: {' '.join(proc.cmdline())[:200]}")
            proc.kill()
    psutil.wait_procs(left, timeout=10)
    return leaked


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    home = tmp_path_factory.mktemp("jupyter-home")
    root = tmp_path_factory.mktemp("practice")
    editions.make_practice(root)  # the learner's copy, as `make lab` opens it: no output until a cell runs
    for name, values in LAB_SETTINGS.items():
        path = home / "settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))

    port, token, marker = _free_port(), uuid.uuid4().hex, uuid.uuid4().hex
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--LabApp.expose_app_in_browser=True",
    ]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = ARTIFACTS / "jupyterlab.log"
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            cmd,
            cwd=root,
            env=_lab_env(home, marker),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Lab(url=f"http://127.0.0.1:{port}", token=token, root=root, marker=marker, proc=proc)
    try:
        _wait_until_serving(server, log)
        yield server
    finally:
        leaked = _stop(server)
        assert not leaked, "processes left behind after JupyterLab stopped (killed now):\n" + "\n".join(leaked)


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def browser():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: `apt-get install -y chromium` (make test-browser does it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()
