"""Rank programs of tests/test_checkpoint.py: resharding N -> M, kill-and-resume; the solutions as ranks find them."""

from __future__ import annotations

import os
import runpy
from pathlib import Path

import torch

from course_lib import checkpoint as ck
from course_lib.data import batch_for_step, regression


def reshard(rank: int, world_size: int, *, root: str, source: int | None) -> dict:
    """Train 2 steps and save (source None), or load what `source` ranks saved; then save in both formats.

    Returns what the test checks: the tensors that differ from the full snapshot (rank 0 compares the
    gathered states), how many were compared, the steps restored, and which files each rank read.
    """
    base = Path(root)
    model = ck.sharded_mlp(seed=7)  # a different start: loading must overwrite all of it
    optimizer = ck.make_optimizer(model)
    app = ck.AppState(model, optimizer)
    result: dict = {"files_read": {}, "differing": {}, "compared": 0, "steps": {}}
    if source is None:  # the first job: train, then save the full snapshot and both sharded formats
        data = regression(n=480)
        for step in range(2):
            ck.train_step(model, optimizer, *batch_for_step(data, step, 48, rank, world_size))
        app.step = 2
        ck.save_full_snapshot(base / "snapshot.pt", model, optimizer, step=2)
    else:  # a later job with another world size: load both formats and the snapshot
        ck.dcp_load(base / f"dcp_{source}" / "step_2", app)
        states = {"dcp": ck.full_state(model, optimizer)}
        mine_model = ck.sharded_mlp(seed=9)
        mine_optimizer = ck.make_optimizer(mine_model)
        mine = ck.AppState(mine_model, mine_optimizer)
        loaded = ck.load_sharded(base / f"mine_{source}" / "step_2", {"app": mine})
        result["files_read"], result["row_bytes"] = loaded.files, loaded.row_bytes
        states["mine"] = ck.full_state(mine_model, mine_optimizer)
        snapshot_model = ck.sharded_mlp(seed=10)
        snapshot_optimizer = ck.make_optimizer(snapshot_model)
        result["steps"] = {
            "dcp": app.step,
            "mine": mine.step,
            "snapshot": ck.load_full_snapshot(base / "snapshot.pt", snapshot_model, snapshot_optimizer),
        }
        states["snapshot"] = ck.full_state(snapshot_model, snapshot_optimizer)
        if rank == 0:  # full_state gathers onto rank 0
            expected = torch.load(base / "snapshot.pt", weights_only=True)
            expected = ck.flat_tensors({"model": expected["model"], "optimizer": expected["optimizer"]})
            result["compared"] = len(expected)
            result["differing"] = {name: ck.differing(state, expected) for name, state in states.items()}
    ck.dcp_save(base / f"dcp_{world_size}", 2, app)
    ck.save_sharded(base / f"mine_{world_size}", 2, {"app": app})
    return result


def kill_and_resume(rank: int, world_size: int, *, root: str) -> dict:
    """Train 12 steps with a checkpoint every 4; rank -1 kills itself before step 6 in the first attempt.

    The restarted job resumes from the newest complete checkpoint; its final state is compared
    bitwise with an uninterrupted run of the same 12 steps.
    """
    model, optimizer, resumed_from = ck.train_resumable(
        root + "/run", total_steps=12, every=4, kill_at=6, log=root + "/log.jsonl"
    )
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    reference_model, reference_optimizer, _ = ck.train_resumable(
        root + f"/reference_{rank}_{attempt}", total_steps=12, every=100
    )
    equal = torch.equal(ck.local_state(model, optimizer), ck.local_state(reference_model, reference_optimizer))
    return {"resumed_from": resumed_from, "bitwise_equal": equal}


SOLUTIONS = Path(__file__).resolve().parents[2] / "notebooks" / "solutions" / "06_checkpointing.py"


def solutions() -> dict:
    """notebooks/solutions/06_checkpointing.py, with the notebook's names its prediction reads."""
    from course_lib.models import MLP

    notebook = {"parameters": sum(p.numel() for p in MLP().parameters()), "LOAD_NPROC": 2}
    return runpy.run_path(str(SOLUTIONS), init_globals=notebook)


def verify_together(directory: str) -> bool:
    """The solution, as the ranks find it (the solutions file needs the notebook's names to run)."""
    return solutions()["verify_together"](directory)


def newest_complete_step(root: str) -> int | None:
    """The solution of exercise 3, as the ranks find it."""
    return solutions()["newest_complete_step"](root)


def two_async_saves(rank: int, world_size: int, *, root: str) -> dict:
    """Two saves through one AsyncCheckpointer: how many FileSystemWriters were built, what was committed, and the
    step loaded back from the second."""
    import torch.distributed.checkpoint as dcp

    built = []
    original = dcp.FileSystemWriter.__init__

    def counting(self, *args, **kwargs) -> None:
        built.append(args)
        original(self, *args, **kwargs)

    dcp.FileSystemWriter.__init__ = counting
    try:
        data = regression(n=480)
        model = ck.sharded_mlp()
        optimizer = ck.make_optimizer(model)
        app = ck.AppState(model, optimizer)
        saver = ck.AsyncCheckpointer(root)
        for step in (1, 2):
            ck.train_step(model, optimizer, *batch_for_step(data, step - 1, 48, rank, world_size))
            app.step = step
            saver.save(step, app)
        saver.wait()
    finally:
        dcp.FileSystemWriter.__init__ = original
    other = ck.sharded_mlp(seed=7)
    loaded = ck.AppState(other, ck.make_optimizer(other))
    ck.dcp_load(Path(root) / "step_2", loaded)
    return {"writers": len(built), "committed": sorted(p.name for p in Path(root).iterdir()), "step": loaded.step}
