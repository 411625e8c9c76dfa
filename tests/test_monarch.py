"""course_lib.rpc.monarch_actors: a Monarch process mesh driven from one controller (the test process), with real
processes: endpoint calls, slices, broadcast, a gloo all-reduce inside the actors, failures as the controller sees
them, and no process left behind (after the block, after a raise in it, after the controller is killed)."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from monarch.actor import ActorError
from monarch.spmd import setup_torch_elastic_env_async

from course_lib.launch.processes import running
from course_lib.rpc import monarch_actors
from tests.rank_programs import world_sizes

ROOT = Path(__file__).resolve().parents[1]


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.mark.parametrize("n", world_sizes(2, 3))
def test_calls_slices_broadcast_and_all_reduce_then_no_process_left(n):
    async def session():
        async with monarch_actors.process_mesh(n) as mesh:
            actors = mesh.procs.spawn("workers", monarch_actors.Worker)
            where = await actors.whoami.call()
            await actors.add.call(1.0)
            first = await actors.slice(procs=0).add.call_one(10.0)
            others = await actors.slice(procs=slice(1, None)).add.call(100.0)
            after_first = await actors.add.call(0.0)
            actors.reset.broadcast(5.0)
            after_broadcast = await actors.add.call(0.5)
            await setup_torch_elastic_env_async(mesh.procs)
            reduced = await actors.all_reduce.call()
            await actors.leave_process_group.call()
            round_trip = await monarch_actors.endpoint_round_trip(actors.slice(procs=0), repeats=3, warmup=1)
            assert running(mesh.pids) == mesh.pids  # alive while the block runs
        return mesh, where, first, others, after_first, after_broadcast, reduced, round_trip

    mesh, where, first, others, after_first, after_broadcast, reduced, round_trip = run(session())
    assert [rank for rank, _ in where.values()] == list(range(n))
    assert sorted(pid for _, pid in where.values()) == sorted(mesh.pids)
    assert len(set(mesh.pids)) == n and os.getpid() not in mesh.pids
    assert first == 11.0 and list(others.values()) == [101.0] * (n - 1)
    assert list(after_first.values()) == [11.0] + [101.0] * (n - 1)  # each actor kept its own total
    assert list(after_broadcast.values()) == [5.5] * n  # the broadcast reached every actor before the call
    for rank, result in enumerate(reduced.values()):
        assert (result["rank"], result["world_size"]) == (rank, n)
        assert result["value"] == [n * (n + 1) / 2] * 4
        assert result["calls"] == {"all_reduce": 1}
    assert round_trip > 0
    assert running(mesh.pids) == []
    assert mesh.failures == []


def test_a_raise_and_a_dead_process_as_the_controller_sees_them():
    n = 3

    async def session():
        async with monarch_actors.process_mesh(n) as mesh:
            actors = mesh.procs.spawn("workers", monarch_actors.FailingWorker)
            with pytest.raises(ActorError) as raised:
                await actors.slice(procs=1).fail.call_one("bad input")
            still_there = await actors.add.call(1.0)
            with pytest.raises(RuntimeError) as died:
                await actors.slice(procs=2).exit_process.call_one(7)
            report = await mesh.wait_for_failure("workers")
            survivors = await actors.slice(procs=slice(0, 2)).add.call(1.0)
        return mesh, raised.value, still_there, died.value, report, survivors

    mesh, raised, still_there, died, report, survivors = run(session())
    assert isinstance(raised.exception, ValueError) and str(raised.exception) == "bad input"
    assert list(still_there.values()) == [1.0] * n  # a raise does not stop the actor
    assert type(died).__name__ == "SupervisionError"
    assert "workers{'procs': 2/3}" in str(died) and "exited with non-zero code 7" in str(died)
    assert "workers{'procs': 2/3}" in report and "exited with non-zero code 7" in report
    assert list(survivors.values()) == [2.0, 2.0]
    assert running(mesh.pids) == []


def test_the_processes_end_when_the_block_raises():
    async def session(seen):
        async with monarch_actors.process_mesh(2) as mesh:
            seen.extend(mesh.pids)
            raise KeyError("stop here")

    pids = []
    with pytest.raises(KeyError):
        run(session(pids))
    assert len(pids) == 2 and running(pids) == []


def test_a_killed_controller_leaves_no_process_and_no_log_notice_on_stderr():
    program = textwrap.dedent(
        """
        import asyncio, os, signal
        from course_lib.rpc import monarch_actors

        async def main():
            async with monarch_actors.process_mesh(2) as mesh:
                print(*mesh.pids, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)  # no finally, no atexit: Monarch sets a parent-death signal

        asyncio.run(main())
        """
    )
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running(pids) == []
    assert "Monarch internal logs" not in done.stderr, done.stderr
