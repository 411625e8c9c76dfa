"""The %%torchrun contract, on real gloo ranks: output, values, failures, timeouts, cleanup, bad input."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from course_lib.launch import (
    LaunchError,
    RankFailedError,
    RunSpec,
    RunTimeoutError,
    failures,
    launch,
    processes,
    standalone_script,
)
from course_lib.launch import spec as backend
from course_lib.launch.failures import Attempt, RankFailure, RunResult
from course_lib.launch.spec import RunDir

ROOT = Path(__file__).resolve().parent.parent


class Captured:
    def __init__(self):
        self.stdout, self.stderr = "", ""

    def __call__(self, text, stream):
        setattr(self, stream, getattr(self, stream) + text)


def sleeping_cell(folder: Path) -> str:
    """A cell whose ranks record their pids in `folder` (forked ranks carry no marker of the run) and sleep."""
    return f"import os, time\nopen({str(folder)!r} + f'/{{rank}}', 'w').write(str(os.getpid()))\ntime.sleep(600)\n"


def agent_and_ranks(folder: Path, root: int) -> tuple[list[psutil.Process], list[psutil.Process]]:
    """The run's torchrun agent, below process `root` (torchrun's main thread names it pt_elastic), and its ranks."""
    ranks = []
    for file in folder.iterdir():
        with contextlib.suppress(psutil.Error, ValueError):
            ranks.append(psutil.Process(int(file.read_text())))
    agents = [p for p in psutil.Process(root).children(recursive=True) if p.name() == "pt_elastic"]
    return agents, ranks


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `procs` still running (is_running also checks the start time: a reused pid is not counted)."""
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def wait_until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_output_grouped_in_rank_order_and_values_round_trip():
    out = Captured()
    body = textwrap.dedent("""
        import time
        time.sleep(0.3 * (world_size - 1 - rank))   # the last rank prints first
        print(f"hello from {rank}")
        print(f"line two {rank}")
        doubled = payload * (rank + 1)
        info = {"rank": rank, "names": names}
    """)
    payload = torch.arange(5.0)
    result = launch(
        body, 3, backend="gloo", push={"payload": payload, "names": ["a", "b"]}, out=["doubled", "info"], write=out
    )
    assert out.stdout.splitlines() == [
        f"[rank {r}] {text} {r}" for r in range(3) for text in ("hello from", "line two")
    ]
    assert out.stderr == ""  # nothing of the launcher's own: no warning about how the worker module starts
    assert [d.tolist() for d in result.values["doubled"]] == [(payload * k).tolist() for k in (1, 2, 3)]
    assert result.values["info"] == [{"rank": r, "names": ["a", "b"]} for r in range(3)]


def test_failure_names_rank_exception_and_cell_line():
    out = Captured()
    body = "print('starting', rank)\nx = 1\nif rank == 1:\n    raise ValueError('bad shard')\nprint('done', rank)\n"
    with pytest.raises(RankFailedError) as info:
        launch(body, 2, backend="gloo", write=out)
    message = str(info.value)
    assert message.startswith("rank 1 raised ValueError: bad shard")
    assert "at cell line 4: raise ValueError('bad shard')" in message
    assert info.value.failures[0].rank == 1 and info.value.failures[0].cell_line == 4
    rendered = "\n".join(info.value._render_traceback_())
    assert 'File "<torchrun cell>", line 4' in rendered and "worker.py" not in rendered
    assert "[rank 0] starting 0" in out.stdout and "[rank 1] starting 1" in out.stdout


def test_rank_killed_by_signal_is_named():
    body = "import os, signal, time\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(30)\n"
    with pytest.raises(RankFailedError) as info:
        launch(body, 2, backend="gloo", write=Captured())
    assert str(info.value).startswith("rank 1 was killed by SIGKILL")


def test_timeout_ends_every_process_and_names_running_ranks(tmp_path):
    # Both ranks sleep: a collective would end at the process-group timeout (12 s here), racing the wall clock.
    raised: list[BaseException] = []

    def run():
        try:
            launch(sleeping_cell(tmp_path), 2, backend="gloo", timeout=15, write=Captured())
        except BaseException as exc:  # checked below, in the test's thread
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    assert wait_until(lambda: len(list(tmp_path.iterdir())) == 2, timeout=120), "the ranks did not start"
    agent, ranks = agent_and_ranks(tmp_path, os.getpid())
    assert len(agent) == 1 and len(ranks) == 2
    thread.join(120)  # a guard against a hang, not a speed bound: the ranks sleep 600 s
    assert not thread.is_alive(), "launch did not return after its timeout"
    assert len(raised) == 1 and isinstance(raised[0], RunTimeoutError), raised
    assert "ranks still running: 0, 1" in str(raised[0])
    assert alive(agent + ranks) == []


def _script_running_a_long_cell(folder: Path) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a kernel does, even if SIGINT came ignored
        from course_lib.launch import launch
        if __name__ == "__main__":  # the forkserver's children run this file as a module: start nothing there
            launch({sleeping_cell(folder)!r}, 2, backend="gloo", timeout=600)
    """)
    script = folder.parent / "kernel.py"
    script.write_text(code)
    return subprocess.Popen([sys.executable, str(script)], cwd=ROOT)


@pytest.mark.parametrize("how", ["interrupt", "kill_agent", "kill_kernel"])
def test_no_process_survives(how, tmp_path):
    """SIGINT to the 'kernel', SIGKILL to the torchrun agent, SIGKILL to the kernel: nothing of the run survives,
    nor its folder (the cell, the logs and the environment the agent recorded)."""
    folder = tmp_path / "pids"
    folder.mkdir()
    kernel = _script_running_a_long_cell(folder)
    try:
        # start-up only (import torch in 3 processes): generous, since a loaded 2-core machine took over 30 s
        assert wait_until(lambda: len(list(folder.iterdir())) == 2, timeout=120), "ranks did not start"
        agent, ranks = agent_and_ranks(folder, kernel.pid)
        assert len(agent) == 1 and len(ranks) == 2
        (run,) = [d for d in Path(tempfile.gettempdir()).glob(f"{RunDir.PREFIX}*") if str(folder) in _cell_of(d)]
        if how == "interrupt":
            kernel.send_signal(signal.SIGINT)
            kernel.wait(30)
        elif how == "kill_agent":
            agent[0].kill()
        else:
            kernel.kill()
            kernel.wait(10)
        assert wait_until(lambda: alive(agent + ranks) == [], timeout=15), f"left behind: {alive(agent + ranks)}"
        assert wait_until(lambda: not run.exists(), timeout=15), f"left behind: {sorted(run.rglob('*'))}"
    finally:
        kernel.kill()
        kernel.wait(10)


def _cell_of(run: Path) -> str:
    with contextlib.suppress(OSError):
        return (run / "cell.py").read_text()
    return ""


def test_forked_ranks_see_what_exec_gives_and_import_time_variables_start_ranks_afresh(tmp_path, monkeypatch):
    """A forked rank has the run's environment, the kernel's folder, its threads and a session of its own, as an
    exec'd one has; a run that sets a variable torch reads at import gets exec'd ranks (the lesson's C++ log)."""
    body = (
        "import multiprocessing, os\n"
        "print(os.environ['COURSE_RUN_VARIABLE'], os.getcwd(), torch.get_num_threads(), os.getsid(0) == os.getpid(),"
        " multiprocessing.parent_process() is not None)\n"
    )
    monkeypatch.chdir(tmp_path)
    expected = f"{tmp_path} 1 True"
    for env, forked in (({}, True), ({"TORCH_CPP_LOG_LEVEL": "ERROR"}, False)):
        out = Captured()
        launch(body, 2, backend="gloo", env={"COURSE_RUN_VARIABLE": "set", "OMP_NUM_THREADS": "1", **env}, write=out)
        assert out.stdout.splitlines() == [f"[rank {r}] set {expected} {forked}" for r in (0, 1)], out.stdout


def test_two_runs_at_once_do_not_collide():
    results, errors = [], []

    def run(tag):
        try:
            results.append(
                launch(
                    f"t = torch.ones(3) * {tag}\ndist.all_reduce(t)\n", 2, backend="gloo", out=["t"], write=Captured()
                )
            )
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in (1, 10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(r.values["t"][0][0].item() for r in results) == [2.0, 20.0]


def test_stream_prefixes_lines_live():
    out = Captured()
    launch("for i in range(3):\n    print(f'step {i}')\n", 2, backend="gloo", stream=True, write=out)
    lines = out.stdout.splitlines()
    assert sorted(lines) == sorted(f"[rank {r}] step {i}" for r in range(2) for i in range(3))
    for r in range(2):  # each rank's own lines stay in order
        assert [line for line in lines if line.startswith(f"[rank {r}]")] == [f"[rank {r}] step {i}" for i in range(3)]


def test_max_restarts_restarts_the_group_after_a_real_process_death():
    out = Captured()
    body = textwrap.dedent("""
        import os, signal
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        print(f"attempt {attempt}")
        if attempt == 0 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()
    """)
    result = launch(body, 2, backend="gloo", max_restarts=1, out=["attempt"], write=out)
    assert [a.index for a in result.attempts] == [0, 1]
    assert result.values["attempt"] == [1, 1]
    assert "--- attempt 1 ---" in out.stdout
    assert "attempt 0 failed: rank 1 " in out.stdout  # the rank that died, not the peer that lost it


def test_a_rank_stopped_while_it_records_its_error_does_not_stop_the_restart(tmp_path):
    """When rank 1 dies, the agent stops rank 0 and reads its error file: here rank 0 is caught mid-write (its
    json.dump never returns). An error file cut short would make the agent raise instead of restarting (the
    kill-and-resume lesson once ended so); written beside its name and renamed, it is whole or absent."""
    writing = tmp_path / "rank-0-is-writing"  # rank 1 dies once rank 0 has begun its error file
    body = textwrap.dedent(f"""
        import json, os, pathlib, signal, time
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if attempt == 0 and rank == 0:
            def dump_and_hang(data, file):  # the first bytes, then the agent's SIGTERM arrives
                file.write('{{"message": ')
                file.flush()
                pathlib.Path({str(writing)!r}).touch()
                time.sleep(60)
            json.dump = dump_and_hang
            raise RuntimeError("rank 0 lost its peer")
        if attempt == 0 and rank == 1:
            while not pathlib.Path({str(writing)!r}).exists():
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()
    """)
    result = launch(body, 2, backend="gloo", max_restarts=1, timeout=120, out=["attempt"], write=lambda t, s: None)
    assert [a.index for a in result.attempts] == [0, 1], result.agent_log[-2000:]
    assert result.values["attempt"] == [1, 1]
    assert "Failed to parse reply file" not in result.agent_log


def test_an_agent_that_fails_itself_is_named_with_its_log():
    """torchrun's agent ended by a signal does not restart the group, and no rank raised: the error says so and
    quotes the agent's log, the only place that says why. With a rank that died first and a restart left
    (the kill-and-resume lesson's case), the error names the rank and the agent's log too."""
    agent_stopped = (  # argv[1]: the run's folder, where the agent records its pid (a forked rank's parent is not it)
        "import json, os, signal, sys, time\nif rank == 0:\n"
        "    os.kill(json.load(open(sys.argv[1] + '/agent.json'))['pid'], signal.SIGTERM)\ntime.sleep(30)\n"
    )
    with pytest.raises(RankFailedError) as failed:
        launch(agent_stopped, 2, backend="gloo", max_restarts=1, timeout=60, write=lambda text, stream: None)
    message = str(failed.value)
    assert message.startswith("torchrun's agent exited (code 1) while no rank had failed; its log ends:"), message
    assert "got signal: 15" in message, message

    # the kill-and-resume lesson's case: a rank died first, then the agent failed instead of restarting
    died = RankFailure(1, "signal", "died without raising an exception (killed by a signal, or os._exit)")
    result = RunResult(
        2, "gloo", [Attempt(0, failures=[died])], {}, 1.0, "agent line\nSignalException: got signal: 15\n"
    )
    message = str(failures.failed_error(1, result, [], max_restarts=1))
    assert message.startswith("rank 1 died without raising"), message
    assert message.endswith(
        "torchrun's agent exited (code 1) after 0 of its 1 restarts, without restarting the group; its log ends:\n"
        "agent line\nSignalException: got signal: 15"
    ), message
    assert "agent's" not in str(failures.failed_error(1, result, [], max_restarts=0))  # it gave up: ranks say why


def test_no_init_leaves_the_group_to_the_cell_but_says_where_it_runs():
    body = textwrap.dedent("""
        import torch.distributed as dist
        initialised_before = dist.is_initialized()
        names = sorted(k for k in ("rank", "world_size", "local_rank", "device") if k in globals())
        where = (rank, world_size, local_rank)
    """)
    result = launch(body, 2, backend="gloo", init=False, out=["initialised_before", "names", "where"], write=Captured())
    assert result.values == {
        "initialised_before": [False, False],
        "names": [["local_rank", "rank", "world_size"]] * 2,
        "where": [(0, 2, 0), (1, 2, 1)],
    }


def run_under_plain_torchrun(script: Path, nproc: int) -> list[str]:
    """The lines the ranks print, each prefixed [rank]; the run must succeed."""
    # --tee copies each rank's output line by line (plain pipes would interleave the ranks' writes)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    done = subprocess.run(
        [*torchrun, "--tee", "3", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${rank}] "},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_saved_script_runs_under_plain_torchrun(tmp_path):
    body = "t = torch.tensor([float(rank)])\ndist.all_reduce(t)\nprint(f'sum {t.item():g} on rank {rank}')\n"
    script = tmp_path / "job.py"
    script.write_text(standalone_script(body, backend="gloo", nproc=3))
    assert sorted(line for line in run_under_plain_torchrun(script, 3) if "sum" in line) == [
        f"[{r}] sum 3 on rank {r}" for r in range(3)
    ]


def test_saved_no_init_script_sees_what_the_cell_sees(tmp_path):
    """A --no-init cell gets rank, world_size, local_rank and torch in the magic and in its saved script."""
    body = textwrap.dedent("""
        import torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        print(f"sum {t.item():g} on rank {rank} of {world_size}, local rank {local_rank}")
        dist.destroy_process_group()
    """)
    expected = [f"sum 3 on rank {r} of 3, local rank {r}" for r in range(3)]
    out = Captured()
    launch(body, 3, backend="gloo", init=False, write=out)
    assert out.stdout.splitlines() == [f"[rank {r}] {line}" for r, line in enumerate(expected)]
    script = tmp_path / "job.py"
    script.write_text(standalone_script(body, backend="gloo", init=False, nproc=3))
    assert sorted(line for line in run_under_plain_torchrun(script, 3) if "sum" in line) == [
        f"[{r}] {line}" for r, line in enumerate(expected)
    ]


@pytest.mark.parametrize("fresh_store", [True, False])
def test_a_restarted_saved_script_needs_a_fresh_store_and_says_so(tmp_path, fresh_store):
    """Under plain torchrun a restarted group meets only on a fresh store; on the agent's shared one, which still
    holds the dead group's addresses, init_distributed refuses at once, naming the variable that fixes it."""
    body = textwrap.dedent("""
        import os, signal
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        t = torch.ones(1)
        dist.all_reduce(t)
        print(f"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}: sum {t.item():g}")
    """)
    script = tmp_path / "job.py"
    script.write_text(standalone_script(body, backend="gloo", nproc=2))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1" if fresh_store else "0"}
    done = subprocess.run(
        [*torchrun, "--max-restarts", "1", "--monitor-interval", "0.1", "--tee", "3", str(script)],
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
    )
    if fresh_store:
        assert done.returncode == 0, done.stderr
        assert done.stdout.count("attempt 1: sum 2") == 2, done.stdout
    else:
        assert done.returncode != 0
        assert "start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in done.stderr, done.stderr[-3000:]
        assert "connectFullMesh" not in done.stderr  # refused before gloo tried the dead peer's address


def test_only_agents_that_may_restart_get_a_fresh_store_per_round():
    """A restart needs a fresh store (above); every other run keeps torch's shared store, which outlives rank 0."""
    from course_lib.launch.processes import agent_env

    assert agent_env(RunSpec(nproc=2, max_restarts=1))["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    key = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    assert agent_env(RunSpec(nproc=2)).get(key) == os.environ.get(key)  # left as the kernel has it


def test_spec_is_checked_once_and_read_back_by_the_ranks_unchanged(tmp_path):
    spec = RunSpec.create(
        nproc="3", backend="gloo", timeout="30", out="a,b", push=["w"], max_restarts="1", node_rank="1", env={"X": 1}
    )
    assert spec == RunSpec(
        nproc=3, backend="gloo", timeout=30.0, out=("a", "b"), push=("w",), max_restarts=1, node_rank=1, env={"X": "1"}
    )
    assert spec.first_rank == 3 and not spec.multi_node and spec.pg_timeout_s == 20.0
    run = RunDir(tmp_path)
    spec.write(run)
    assert RunSpec.read(run) == spec
    with pytest.raises(TypeError, match="no run option nprocs"):
        RunSpec.create(nprocs=2)


def test_run_dir_names_attempts_in_one_place(tmp_path):
    run = RunDir(tmp_path)
    for attempt, rank in ((0, 0), (0, 1), (10, 1), (2, 0)):  # attempt 10 sorts after 2 as a number
        run.attempt(attempt).mkdir(parents=True, exist_ok=True)
        run.pid_file(attempt, rank).write_text(f"{1000 + 10 * attempt + rank} 1.5")
    run.done_file(10, 1).touch()
    assert run.attempts() == [0, 2, 10]
    assert sorted(run.pids()) == [1000, 1001, 1020, 1101]
    for attempt in (0, 3, 11):
        (run.logs / "job_x" / f"attempt_{attempt}").mkdir(parents=True)
    assert [index for index, _ in run.log_attempts()] == [0, 3, 11]
    # a timeout names every rank of the last attempt that had not finished: rank 0 of attempt 10 had not even
    # started (a slow start on a busy machine: notebook 01's deadlock cell once named rank 1 alone)
    assert failures.running_ranks(run, RunSpec(nproc=2)) == [0]
    assert failures.running_ranks(RunDir(tmp_path / "none started"), RunSpec(nproc=2)) == [0, 1]


# ---- bad input fails at once, before anything starts ------------------------


@pytest.fixture(scope="module")
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "course_lib")
    return ip


@pytest.mark.parametrize(
    "line, message",
    [
        ("-n 0", "-n must be at least 1 rank"),
        ("-n two", "-n must be a whole number"),
        ("-n 2 --bogus", "unrecognized arguments: --bogus"),
        ("-n 2 --backend mpi", "unknown backend 'mpi'"),
        ("-n 2 --backend nccl", "this machine has none: use --backend gloo"),
        ("-n 2 --push not_defined_anywhere", "--push names not_defined_anywhere, not defined in the notebook"),
        ("-n 2 --out 1x", "'1x' is not one"),
        ("-n 2 --timeout soon", "--timeout takes a number of seconds"),
    ],
)
def test_bad_input_is_refused_at_once(shell, line, message, monkeypatch):
    if "nccl" in line and torch.cuda.is_available():
        pytest.skip("this machine has GPUs, so nccl is a valid request here")

    def no_process(*args, **kwargs):
        raise AssertionError("a process was started for input that should be refused first")

    monkeypatch.setattr(processes, "start_agent", no_process)
    with pytest.raises(LaunchError) as info:
        shell.run_cell_magic("torchrun", line, "print('never runs')\n")
    assert message in str(info.value)


def test_more_ranks_than_gpus_is_refused_for_nccl_and_gloo_for_auto(monkeypatch):
    monkeypatch.setattr(backend, "available_gpus", lambda: 2)
    with pytest.raises(LaunchError, match="4 ranks with nccl need 4 GPUs, this node has 2"):
        backend.resolve_backend("nccl", 4)
    assert [backend.resolve_backend("auto", n) for n in (1, 2, 3, 4)] == ["nccl", "nccl", "gloo", "gloo"]
    assert [backend.backend_for(n, "nccl") for n in (2, 3)] == ["nccl", "gloo"]  # a notebook's derived sizes
    assert backend.backend_for(2, "gloo") == "gloo"
    assert "gloo: 3 ranks as CPU processes" in backend.describe_backend("gloo", 3)
    monkeypatch.setattr(backend, "available_gpus", lambda: 0)
    assert backend.resolve_backend("auto", 1) == "gloo" and backend.describe_backend("gloo", 2) == ""


def test_out_naming_a_variable_a_rank_never_set(shell):
    with pytest.raises(
        RankFailedError, match="rank 1 raised MissingOutError: --out names late, but this rank never set it"
    ):
        shell.run_cell_magic("torchrun", "-n 2 --backend gloo --out late", "if rank == 0:\n    late = 1\n")


def test_magic_puts_values_in_the_notebook_and_expands_variables(shell):
    shell.user_ns["N"] = 3
    shell.user_ns["scale"] = torch.tensor(2.0)
    shell.run_cell("%%torchrun -n $N --backend gloo --push scale --out y\ny = scale * rank\n")
    assert [v.item() for v in shell.user_ns["y"]] == [0.0, 2.0, 4.0]


def test_an_error_file_is_whole_or_absent(tmp_path, monkeypatch):
    """A rank ended while it writes its error file leaves no file at the name the agent reads; a whole one reads
    back as the exception and the cell's line."""
    import json

    from course_lib.launch.failures import failure_from_error_file
    from course_lib.launch.worker import write_error_file

    cell = tmp_path / "cell.py"
    cell.write_text("x = 1\nraise ValueError('boom')\n")
    try:
        exec(compile(cell.read_text(), str(cell), "exec"), {})
    except ValueError as error:
        raised = error
    path = tmp_path / "error.json"

    def cut_short(data, file):
        file.write('{"message": ')
        raise KeyboardInterrupt  # stands in for the signal that ends the rank mid-write

    monkeypatch.setattr(json, "dump", cut_short)
    with pytest.raises(KeyboardInterrupt):
        write_error_file(raised, str(path))
    assert not path.exists()
    monkeypatch.undo()
    write_error_file(raised, str(path))
    failure = failure_from_error_file(2, path, str(cell))
    assert (failure.rank, failure.kind, failure.summary, failure.cell_line) == (2, "raised", "ValueError: boom", 2)


def torchrun_failure(index: int, rank: int, signal_number: int, pid: int) -> str:
    """One entry of torchrun's failure summary, as its ChildFailedError prints it."""
    name = signal.Signals(signal_number).name
    return (
        f"[{index}]:\n  time      : 2026-12-04_02:10:00\n  host      : localhost\n"
        f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : -{signal_number} (pid: {pid})\n"
        f"  error_file: <N/A>\n  traceback : Signal {signal_number} ({name}) received by PID {pid}\n"
    )


TORCHRUN_SUMMARY = (
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n" + "=" * 60 + "\n<torchrun cell> FAILED\n"
    + "-" * 60 + "\nFailures:\n" + torchrun_failure(1, rank=0, signal_number=15, pid=123)
    + "-" * 60 + "\nRoot Cause (first observed failure):\n" + torchrun_failure(0, rank=2, signal_number=9, pid=125)
    + "=" * 60 + "\n"
)  # fmt: skip


def test_one_reader_of_torchruns_summary_serves_both_magics(tmp_path):
    from types import SimpleNamespace

    from course_lib.launch.failures import exit_codes, how_it_ended
    from course_lib.session.processes import first_failure

    codes = exit_codes(TORCHRUN_SUMMARY)
    assert list(codes.items()) == [(2, -9), (0, -15)]  # the root cause first, though printed last
    assert (how_it_ended(-9), how_it_ended(3)) == ("SIGKILL", "exit code 3")
    log = tmp_path / "agent.log"
    log.write_text(TORCHRUN_SUMMARY)
    assert first_failure(SimpleNamespace(agent_log=log)) == "rank 2 (SIGKILL)"  # what %dist reports
    log.write_text("no summary: the agent is still running\n")
    assert exit_codes(log.read_text()) == {} and first_failure(SimpleNamespace(agent_log=log)) is None
