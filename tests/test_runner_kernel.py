"""The runner's kernel: it starts under a long HOME, and a kernel that cannot start or dies fails its notebook at once.

zmq refuses an ipc:// path over 107 characters; Jupyter's runtime directory is HOME plus 29 characters, so under
a cluster's long HOME a kernel with its sockets there cannot start. The runner keeps them in a short private
directory (tools.probe.private_dir), and names the reason when a kernel is gone.
"""

from __future__ import annotations

import os
import tempfile

import nbformat
from notebook_kit import write_notebook

from tools import probe, runner

LONG_HOME_NAME = "a-home-as-long-as-a-cluster-gives-" + "h" * 30  # with its parent: well over 50 characters


def outputs(path) -> str:
    nb = nbformat.read(path, as_version=4)
    return "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))


def test_the_runner_runs_a_notebook_under_a_long_home(tmp_path, monkeypatch):
    from jupyter_core.paths import jupyter_runtime_dir

    home = tmp_path / LONG_HOME_NAME
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("JUPYTER_RUNTIME_DIR", "JUPYTER_DATA_DIR", "XDG_DATA_HOME", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    # Under this HOME a kernel's sockets in Jupyter's runtime directory would be too long for zmq.
    assert len(str(home)) >= 50
    assert len(os.path.join(jupyter_runtime_dir(), "kernel-" + "0" * 36 + "-ipc-1")) > 107  # zmq's limit
    path = write_notebook(
        tmp_path / "95_long_home.ipynb", "X = 20", "import os\nprint('answer', X + 22, os.environ['HOME'])"
    )
    assert runner.main([str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    assert f"answer 42 {home}" in outputs(tmp_path / "out" / path.name)
    assert not list(tmp_path.glob("out/*.json")), "the connection file belongs beside the sockets, removed after"


def test_a_kernel_that_cannot_start_fails_its_notebook_at_once_saying_why(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "fake"
    fake.mkdir()  # the kernel spec runs `python -m ipykernel_launcher`: this one exits at once
    (fake / "ipykernel_launcher.py").write_text(
        "import sys\nsys.stderr.write('no GPU driver for you\\n')\nsys.exit(7)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(fake))
    path = write_notebook(tmp_path / "94_no_kernel.ipynb", "X = 1", "print(X)")
    assert runner.main([str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 1
    table = capsys.readouterr().out  # the reason is the process's end, not the 60 s start-up timeout nor a cell's
    assert "94_no_kernel  FAILED" in table
    assert "the kernel's process ended with exit status 7" in table
    assert "no GPU driver for you" in table  # its stderr, under the table


def test_a_kernel_that_dies_fails_its_notebook_at_once_saying_why(tmp_path, capsys):
    path = write_notebook(tmp_path / "93_dies.ipynb", "X = 1", "import os\nos._exit(3)", "print('after')")
    assert runner.main([str(path), "--out", str(tmp_path / "out"), "--no-progress", "--timeout", "300"]) == 1
    table = capsys.readouterr().out
    assert "the kernel's process ended with exit status 3" in table
    assert "DeadKernelError" in table


def test_kernel_sockets_go_to_a_short_directory_even_under_a_long_tmpdir(tmp_path, monkeypatch):
    long_tmp = tmp_path / ("t" * 90)
    long_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    assert probe.socket_base() == "/tmp"  # TMPDIR's sockets would pass 107 characters
    directory = probe.private_dir()
    try:
        assert len(str(directory / f"{probe.SOCKET_NAME}-65535")) <= probe.SOCKET_PATH_MAX
        assert oct(directory.stat().st_mode & 0o777) == "0o700"
    finally:
        directory.rmdir()
    monkeypatch.setattr(os.path, "isdir", lambda path: False)  # nowhere short to go: the error says what to do
    try:
        probe.socket_base()
    except ValueError as error:
        assert "107 characters" in str(error) and "export TMPDIR=/tmp" in str(error)
    else:
        raise AssertionError("socket_base found a directory where none was usable")
