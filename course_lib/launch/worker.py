"""What torchrun starts on every rank of a `%%torchrun` cell: `--module course_lib.launch.worker RUN_DIR`, or this
file as the function of ranks forked from the kernel's forkserver (`--run-path`, processes.forks_ranks).

launcher.standalone_script writes the same steps as a script for plain torchrun (`--save`): change both together."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import types
from pathlib import Path

import psutil

from course_lib.launch.spec import RunDir, RunSpec


def forked() -> bool:
    """Whether this rank was forked from the forkserver (processes.forks_ranks), not exec'd by torchrun."""
    return multiprocessing.parent_process() is not None


def adopt_agent(run: RunDir) -> None:
    """A forked rank takes on what an exec'd one gets from its agent: environment, folder, session, an end with it."""
    from course_lib.launch.processes import ENV_AT_IMPORT, when_gone  # imported in the forkserver: its environment

    agent = json.loads(run.agent_file.read_text())
    torchrun_set = {name: value for name, value in os.environ.items() if ENV_AT_IMPORT.get(name) != value}
    os.environ.clear()
    os.environ.update({**agent["env"], **torchrun_set})
    os.chdir(agent["cwd"])
    os.setsid()  # as torchrun starts an exec'd rank: the launcher ends its process group
    # With the agent gone, this rank's session (it and what it started) ends, as an exec'd rank's would.
    when_gone(agent["pid"], lambda: os.killpg(0, signal.SIGKILL))
    for name in ("stdout", "stderr"):  # unbuffered, as PYTHONUNBUFFERED makes an exec'd rank's
        stream = io.TextIOWrapper(io.FileIO(getattr(sys, name).fileno(), "w", closefd=False), write_through=True)
        setattr(sys, name, stream)
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # torch read it in the forkserver


def die_with_parent() -> None:
    """End this rank when its torchrun agent dies, even by SIGKILL: torchrun starts workers in their own session."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        # The agent may have died before this line ran: then the parent is already a reaper (pid 1 or a
        # subreaper), which prctl would not watch. Only a torchrun agent is a parent worth waiting for.
        if not is_torchrun_agent(parent):
            os._exit(1)
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the agent died before prctl took effect
            os._exit(1)
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def is_torchrun_agent(pid: int) -> bool:
    """Whether `pid` is a torchrun agent: torchrun's main names its thread pt_elastic (forked agents' included)."""
    try:
        return Path(f"/proc/{pid}/comm").read_bytes().strip() == b"pt_elastic"
    except OSError:
        return False


def trim_to_cell(exc: BaseException, cell_file: str) -> None:
    """Drop the worker's own frames so the traceback starts in the cell body."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != cell_file:
        tb = tb.tb_next
    if tb is not None:
        exc.__traceback__ = tb


class MissingOutError(NameError):
    pass


def start_rank(run: RunDir) -> tuple[int, int, int]:
    """A rank's first steps (a cell's worker, a session's engine): take on its agent if forked, else die with it;
    record its pid and start time."""
    if forked():
        adopt_agent(run)
    else:
        die_with_parent()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    run.attempt(attempt).mkdir(parents=True, exist_ok=True)
    pid_file = run.pid_file(attempt, rank)
    pid_file.with_suffix(".partial").write_text(f"{os.getpid()} {psutil.Process().create_time()!r}")
    os.replace(pid_file.with_suffix(".partial"), pid_file)  # whole or absent: RunDir.recorded_starts
    # Log files are named by local rank; with several nodes the global rank is only known here.
    run.local_file(attempt, local_rank).write_text(str(rank))
    return attempt, rank, local_rank


def main(run: RunDir) -> None:
    attempt, rank, local_rank = start_rank(run)
    spec = RunSpec.read(run)

    import torch  # after the pid is recorded: importing takes seconds

    # The body runs as the __main__ module, so classes it defines pickle by reference.
    main_module = types.ModuleType("__main__")
    sys.modules["__main__"] = main_module
    namespace = main_module.__dict__
    cell_file = str(run.cell)
    # Every cell knows where it runs; --no-init cells create the process group themselves.
    namespace.update(torch=torch, rank=rank, world_size=int(os.environ["WORLD_SIZE"]), local_rank=local_rank)
    try:
        if spec.init:
            import torch.distributed as dist

            from course_lib.launch import runtime

            ctx = runtime.init_distributed(spec.backend, spec.pg_timeout_s)
            namespace.update(dist=dist, device=ctx.device)
        if spec.push:
            namespace.update(torch.load(run.push, weights_only=False))
        source = Path(cell_file).read_text()
        exec(compile(source, cell_file, "exec"), namespace)
        missing = [name for name in spec.out if name not in namespace]
        if missing:
            raise MissingOutError(
                f"--out names {', '.join(missing)}, but this rank never set "
                f"{'it' if len(missing) == 1 else 'them'}: assign it in the cell on every rank"
            )
        if spec.out:
            run.out(rank).parent.mkdir(exist_ok=True)
            torch.save({name: namespace[name] for name in spec.out}, run.out(rank))
        namespace.clear()  # the cell's objects must go while the group exists (see runtime.shutdown)
        if spec.init:
            from course_lib.launch import runtime

            runtime.shutdown()
    except BaseException as exc:
        if not (isinstance(exc, SystemExit) and exc.code in (None, 0)):  # sys.exit() in a cell is a success
            record_and_exit(exc, cell_file)
    run.done_file(attempt, rank).touch()
    sys.stdout.flush()
    sys.stderr.flush()
    if not forked():  # a forked rank returns to torchrun's function wrapper, which reports it done and os._exits
        os._exit(0)  # the run is complete: no interpreter teardown that could still abort it


def record_and_exit(exc: BaseException, cell_file: str) -> None:
    """Write the torchelastic error file (the launcher reads it) and end this rank."""
    trim_to_cell(exc, cell_file)
    write_error_file(exc, os.environ.get("TORCHELASTIC_ERROR_FILE"))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a live process group aborts the process there.
    os._exit(1)


def write_error_file(exc: BaseException, path: str | None) -> None:
    """torchelastic's error file for `exc`, written aside and renamed: a cut-short file makes the agent raise."""
    import json
    import traceback

    if path is None:  # not started by torchrun: the traceback goes to stderr
        traceback.print_exception(exc)
        return
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": "".join(traceback.format_exception(exc)), "timestamp": str(int(time.time()))},
        }
    }
    partial = f"{path}.partial"
    with open(partial, "w") as file:
        json.dump(data, file)
    os.replace(partial, path)


if __name__ == "__main__":
    main(RunDir(Path(sys.argv[1])))
