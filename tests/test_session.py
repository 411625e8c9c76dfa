"""The persistent session (`%dist` + `%%px`) through real IPython kernels, as a notebook drives it.

One kernel holds one 2-rank gloo session that the tests share (start-up is the slow part): the `session`
fixture hands it over healthy, starting or restarting it after a test that broke or stopped it, so the tests
run in any order; the failure tests use a 3 s process-group timeout. A second kernel checks that two sessions
do not collide and that its shutdown leaves none of its processes. Leftovers are counted as `ps`
shows them, not only by the pids the session recorded: every process whose command line names the
kernel's temporary folder (its TMPDIR holds each session folder and `%%torchrun` run directory), and
every process in the session (setsid) of one that did, such as what a cell starts on a rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from course_lib.launch.processes import running
from tools import probe

pytestmark = pytest.mark.timeout(240)

TIMEOUT_S = 3  # the sessions' process-group timeout here
GRANDCHILD = (  # a process a rank starts (its command line names the kernel's TMPDIR)
    "import subprocess, sys, tempfile\n"
    "_child = subprocess.Popen(\n"
    "    [sys.executable, '-c', 'import time; time.sleep(600)', tempfile.gettempdir() + '/{tag}']\n"
    ")"
)
PIDS = (
    "from course_lib.session import session as _s\n"
    "print('PIDS', [p.pid for p in _s.current().procs] + list(_s.current().folder.rank_pids().values()))\n"
    "print('FOLDER', _s.current().folder.path)"
)


class Kernel(probe.Kernel):
    """The runner's probe kernel (sockets beside `tmp`) with course_lib loaded; run() returns what a cell printed."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp  # the kernel's TMPDIR: its sessions' folders and %%torchrun runs are in it
        env = {**os.environ, "TMPDIR": str(tmp)}
        env.pop("PYTEST_CURRENT_TEST", None)
        sockets = tmp.with_name(tmp.name + "-ipc")  # beside TMPDIR: the kernel's command line must not name it
        sockets.mkdir(mode=0o700)
        super().__init__(Path.cwd(), env, sockets / probe.SOCKET_NAME)
        assert not self.run("%load_ext course_lib")[1]

    def run(self, code: str, timeout: float = 180) -> tuple[str, str]:  # type: ignore[override]
        """(everything printed, the error's name, value and traceback or "") for one cell."""
        printed: list[str] = []

        def hook(msg: dict) -> None:
            if msg["msg_type"] == "stream":
                printed.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                printed.append("\n".join(msg["content"]["traceback"]))

        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook)["content"]
        error = "" if reply["status"] == "ok" else f"{reply['ename']}: {reply['evalue']}\n" + "\n".join(printed)
        return _plain("".join(printed)), _plain(error)

    def session_pids(self) -> tuple[list[int], Path]:
        out, error = self.run(PIDS)
        assert not error, error
        pids = re.search(r"PIDS \[(.*)\]", out)
        folder = re.search(r"FOLDER (\S+)", out)
        assert pids and folder, out
        return [int(p) for p in pids.group(1).split(",")], Path(folder.group(1))

    def close(self) -> None:  # as Jupyter shuts a kernel down: its session ends with it
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def by_rank(*lines: str) -> str:
    """What %%px prints: each rank's output under its header, in rank order."""
    return "".join(f"[rank {rank}] {line}\n" for rank, line in enumerate(lines))


def _plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return running(pids)


def _naming(folder: Path) -> dict[int, str]:
    """{pid: command line} of every live process but this one whose command line names `folder` or a path in it."""
    mark = re.compile(re.escape(str(folder)) + r"(/|\s|$)")
    found = {}
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            line = " ".join(proc.cmdline())
            if proc.pid != os.getpid() and mark.search(line) and proc.status() != psutil.STATUS_ZOMBIE:
                found[proc.pid] = line
    return found


def _sessions(folder: Path) -> set[int]:
    """The session ids of the processes _naming `folder` now (what they start stays in them)."""
    sids = set()
    for pid in _naming(folder):
        with contextlib.suppress(OSError):
            sids.add(os.getsid(pid))
    return sids


def _left(folder: Path, sids: set[int]) -> dict[int, str]:
    """{pid: command line} of the processes _naming `folder` or in one of the sessions `sids`."""
    found = _naming(folder)
    for proc in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error, OSError):
            if proc.pid != os.getpid() and os.getsid(proc.pid) in sids and proc.status() != psutil.STATUS_ZOMBIE:
                found[proc.pid] = " ".join(proc.cmdline())
    return found


def _left_after(folder: Path, sids: set[int], seconds: float = 10) -> dict[int, str]:
    """What is still _left after `seconds`, or {} as soon as nothing is."""
    deadline = time.monotonic() + seconds
    while _left(folder, sids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _left(folder, sids)


def _wait_for(predicate, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def _once_started(kernel: Kernel, action, before: str = "") -> str:
    """A %%px cell's first lines (after `before`), which mark that each rank began it; `action` runs once both have,
    not after a guessed sleep. Cells then sleep past the module's timeout: one that does not end early fails."""
    base = str(kernel.tmp / f"started-{uuid.uuid4().hex}")
    marks = [Path(f"{base}-{rank}") for rank in (0, 1)]

    def wait_then_act() -> None:
        while not all(mark.exists() for mark in marks):
            time.sleep(0.05)
        action()

    threading.Thread(target=wait_then_act, daemon=True).start()
    return f"%%px\n{before}import pathlib, time\npathlib.Path({base!r} + f'-{{rank}}').touch()\n"


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    k = Kernel(tmp_path_factory.mktemp("kernel"))
    yield k
    k.kc.stop_channels()
    k.km.shutdown_kernel(now=True)
    # After a failed test, end what it left (the tests have said so): nothing but this module's processes.
    for pid in _naming(tmp_path_factory.getbasetemp()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


NO_PROCESS = (  # in the kernel: starting any process fails, so a refusal must come before one starts
    "import subprocess\n_popen = subprocess.Popen\n"
    "def _no_process(*args, **kwargs):\n    raise AssertionError('a process was started for refused input')\n"
    "subprocess.Popen = _no_process"
)


def test_bad_input_is_refused_at_once(kernel):
    cases = [
        ("%%px\nprint(rank)", "run %dist start -n N first"),
        ("%px print(rank)", "run %dist start -n N first"),
        ("%dist start -n 0", "-n must be at least 1 rank"),
        ("%dist start -n 2 --backend mpi", "unknown backend"),
        ("%dist start -n 2 --timeout never", "--timeout takes a number"),
        ("%dist status", "run %dist start -n N first"),
    ]
    if not _gpus():
        cases.append(("%dist start -n 2 --backend nccl", "needs CUDA GPUs"))
    kernel.run("%dist stop")  # these need a kernel without a session, whatever an earlier test left
    assert not kernel.run(NO_PROCESS)[1]
    try:
        for code, expected in cases:
            _, error = kernel.run(code)
            assert expected in error and "a process was started" not in error, (code, error)
    finally:
        assert not kernel.run("subprocess.Popen = _popen")[1]


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


START = f"%dist start -n 2 --backend gloo --timeout {TIMEOUT_S}"


@pytest.fixture
def session(kernel):
    """The module's kernel with a 2-rank session whose ranks all answer a collective."""
    _, error = kernel.run("%%px\ndist.all_reduce(torch.ones(1))")
    if "run %dist start -n N first" in error:
        assert not kernel.run(START)[1]
    elif error:  # a dead rank or a broken process group, left by a failure test
        assert not kernel.run("%dist restart")[1]
    return kernel


def test_start_state_persists_output_in_rank_order(kernel):
    kernel.run("%dist stop")  # whatever an earlier test left: this one starts a session itself
    out, error = kernel.run(START)
    assert not error, error
    assert re.fullmatch(r"session: 2 ranks, backend gloo, started in [0-9.]+ s\n", out), out
    _, error = kernel.run("%%px\nx = torch.full((2,), float(rank + 1))\ndist.all_reduce(x)")
    assert not error, error
    out, error = kernel.run("%%px\nprint(rank, world_size, local_rank, device, x.tolist())")
    assert not error, error
    assert out == by_rank("0 2 0 cpu [3.0, 3.0]", "1 2 1 cpu [3.0, 3.0]"), out
    out, error = kernel.run("import course_lib.session\nprint(course_lib.session.view().targets)")
    assert out == "[0, 1]\n", (out, error)
    out, error = kernel.run("%px print(rank * 10)")
    assert out == by_rank("0", "10"), (out, error)
    for code in ("%autopx", "w = rank * 2", "%autopx"):  # every cell on the ranks, until %autopx again
        assert not kernel.run(code)[1], code
    out, error = kernel.run("%px print(w)")
    assert out == by_rank("0", "2"), (out, error)
    _, error = kernel.run("%dist start -n 2")
    assert "already running" in error and "%dist restart" in error, error


def test_a_rank_raises_names_rank_exception_and_line(session):
    assert not session.run("%px x = rank + 1")[1]
    _, error = session.run("%%px\ny = 1\nif rank == 1:\n    raise ValueError('boom on one rank')")
    said = "rank 1 raised ValueError: boom on one rank\n  at cell line 3: raise ValueError('boom on one rank')"
    assert said in error, error  # as a %%torchrun cell would say it (launch.failures.describe_failures)
    assert "rank 0 raised" not in error
    out, error = session.run("%%px\nprint(y, x)")  # what the ranks held before, and what the cell set first
    assert out == by_rank("1 1", "1 2"), (out, error)


def test_status(session):
    out, error = session.run("%dist status")
    assert not error, error
    assert "2 ranks, backend gloo, collective timeout 3 s: all alive" in out, out
    assert re.search(r"rank 1: pid \d+, \d+ MiB resident", out), out


def test_two_kernels_do_not_collide_and_shutdown_leaves_nothing(session, tmp_path):
    kernel = session
    other = Kernel(tmp_path)
    try:
        _, error = other.run(START)
        assert not error, error
        (pids_a, folder_a), (pids_b, folder_b) = kernel.session_pids(), other.session_pids()
        assert folder_a != folder_b and not set(pids_a) & set(pids_b)
        assert not other.run("%%px\n" + GRANDCHILD.format(tag="child-of-a-rank"))[1]
        _wait_for(lambda: sum("child-of-a-rank" in line for line in _naming(tmp_path).values()) == 2)
        sids_b = _sessions(tmp_path) | {os.getsid(pid) for pid in pids_b}  # forked engines' command lines name none
        assert len(_left(tmp_path, sids_b)) >= 4 + 2, _left(tmp_path, sids_b)  # controller, agent, 2 engines, children
        for k, value in ((kernel, "a"), (other, "b")):
            k.run(f"%px v = {value!r} + str(rank)")
        assert kernel.run("%px print(v)")[0] == by_rank("a0", "a1")
        assert other.run("%px print(v)")[0] == by_rank("b0", "b1")
    finally:
        other.close()  # a kernel shut down as Jupyter does it: its session ends with it
    assert _gone_within(pids_b, 10) == []
    assert _left_after(tmp_path, sids_b) == {}
    assert not folder_b.exists()
    assert kernel.run("%px print(v)")[0] == by_rank("a0", "a1")


def test_collective_not_every_rank_enters_ends_at_the_timeout(session):
    _, error = session.run("%%px --targets 0\ndist.all_reduce(torch.ones(1))")  # else it hangs: the module's timeout
    assert "rank 0 waited in a collective that not every rank entered" in error, error
    assert "process group is now broken: run %dist restart" in error, error


def test_interrupt_stops_the_ranks_cell(session):
    kernel = session
    out, error = kernel.run(_once_started(kernel, kernel.km.interrupt_kernel) + "z = 5\ntime.sleep(600)")
    assert "KeyboardInterrupt" in error, error
    assert "sent SIGINT to every rank, which stopped the cell" in out + error, (out, error)
    out, error = kernel.run("%px print(z)")
    assert out == by_rank("5", "5"), (out, error)
    # Ranks that do not stop on SIGINT: the session is restarted, and the cell says so.
    old, sids = _with_children(kernel)
    ignore = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"  # before the mark: then SIGINT comes
    out, error = kernel.run(_once_started(kernel, kernel.km.interrupt_kernel, before=ignore) + "time.sleep(600)")
    assert "the session was restarted (fresh ranks: earlier variables are gone)" in out + error, (out, error)
    assert _left(old, sids) == {} and not old.exists()  # nothing of the old session, its ranks' children included
    _, error = kernel.run("%px z")
    assert "NameError" in error, error
    out, error = kernel.run("%px print(rank)")
    assert out == by_rank("0", "1"), (out, error)


def _with_children(kernel: Kernel) -> tuple[Path, set[int]]:
    """Each rank starts a child; (the session's folder, the sessions of its processes and of those naming it)."""
    pids, folder = kernel.session_pids()
    before = sum("child-of-a-rank" in line for line in _naming(kernel.tmp).values())
    assert not kernel.run("%%px\n" + GRANDCHILD.format(tag="child-of-a-rank"))[1]
    _wait_for(lambda: sum("child-of-a-rank" in line for line in _naming(kernel.tmp).values()) == before + 2, 30)
    sids = _sessions(folder) | {os.getsid(pid) for pid in pids}  # forked ranks' command lines name no folder
    assert len(sids) >= 4, _naming(folder)  # the controller's, the agent's, each engine's
    return folder, sids


def test_restart_ends_every_process_of_the_old_session(session):
    kernel = session
    old, sids = _with_children(kernel)
    out, error = kernel.run("%dist restart")
    assert out.startswith("session: 2 ranks") and not error, (out, error)
    assert _left(old, sids) == {} and not old.exists()
    _, folder = kernel.session_pids()
    assert folder != old
    out, error = kernel.run("%px print(rank)")
    assert out == by_rank("0", "1"), (out, error)


def test_a_dead_rank_is_named_while_the_cell_runs(session):
    kernel = session
    pids, _ = kernel.session_pids()
    _, error = kernel.run(_once_started(kernel, lambda: os.kill(pids[-1], signal.SIGKILL)) + "time.sleep(600)")
    assert "rank 1 died" in error and "run %dist restart" in error, error  # rank 1's engine, killed mid-cell
    _, error = kernel.run("%px 1")
    assert re.search(r"rank 1( \(SIGKILL\))? died", error), error  # the signal once torchrun has reported it


def test_stop_leaves_no_process_and_no_folder(session):
    kernel = session
    pids, folder = kernel.session_pids()  # controller, agent, both engines
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    _, sids = _with_children(kernel)
    kill_rank_1 = _once_started(kernel, lambda: os.kill(pids[-1], signal.SIGKILL))  # its child is left an orphan
    kernel.run(kill_rank_1 + "time.sleep(600)")
    out, error = kernel.run("%dist stop")
    assert out == "session stopped\n", (out, error)
    assert running(pids) == [] and not folder.exists()
    assert _left(kernel.tmp, sids) == {}
    _, error = kernel.run("%%px\n1")
    assert "run %dist start -n N first" in error


def test_a_killed_kernel_leaves_nothing(tmp_path):
    """Nothing of the kernel's session or of its running %%torchrun cell, nor what their ranks started."""
    kernel = Kernel(tmp_path)
    _, error = kernel.run(START)
    assert not error, error
    pids, folder = kernel.session_pids()
    assert len(running(pids)) == 4
    _, sids = _with_children(kernel)
    cell = GRANDCHILD.format(tag="child-of-a-torchrun-rank") + "\nimport time\ntime.sleep(600)"
    kernel.kc.execute(f"%%torchrun -n 2 --backend gloo --timeout 300\n{cell}")  # still running when the kernel dies
    _wait_for(lambda: sum("child-of-a-torchrun-rank" in line for line in _naming(kernel.tmp).values()) == 2)
    sids |= _sessions(kernel.tmp)  # the cell's ranks' too: their children are in them
    agent = json.loads(next(kernel.tmp.glob("torchrun-cell-*/agent.json")).read_text())["pid"]
    sids.add(os.getsid(agent))  # the cell's agent, which records its pid in the run's folder
    assert len(_left(kernel.tmp, sids)) >= 4 + 2 + 2 + 1, _left(kernel.tmp, sids)  # session, children, cell, agent
    assert len(sids) >= 4 + 2 + 1, sids  # the session's, the cell's ranks', the cell's agent
    os.kill(kernel.km.provisioner.process.pid, signal.SIGKILL)  # type: ignore[union-attr]
    assert _gone_within(pids, 10) == []
    assert _left_after(kernel.tmp, sids) == {}
    assert not folder.exists()
    _wait_for(lambda: not list(kernel.tmp.glob("torchrun-cell-*")), 15)  # the cell's folder went with its agent
    kernel.kc.stop_channels()


def test_an_nccl_rank_aborted_by_the_watchdog_is_explained():
    """Under NCCL a collective not every rank entered returns at once; the watchdog's SIGABRT comes later."""
    from course_lib.session.session import Settings, watchdog_hint

    nccl, gloo = Settings(2, "nccl", 60.0), Settings(2, "gloo", 60.0)
    hint = watchdog_hint("rank 1 (SIGABRT)", nccl)
    assert "watchdog" in hint and "60 s" in hint and "not every rank entered" in hint
    assert watchdog_hint("rank 1 (SIGKILL)", nccl) == watchdog_hint("rank 1 (SIGABRT)", gloo) == ""
    assert watchdog_hint(None, nccl) == ""
