"""Rank programs of tests/test_checkpoint.py: resharding N -> M, kill-and-resume, the resume exercise's checker."""

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

# Answers to the resume exercise that the checker must reject, each for its own reason.


def resume_alone(root: str) -> int | None:
    """The broken program of the exercise: each rank decides from its own view."""
    found, _ = ck.latest_complete(root)
    return None if found is None else int(found.name.removeprefix("step_"))


def resume_newest_anyone_has(root: str) -> int | None:
    """Communicates, but takes the newest step any rank sees: a step rank 0 cannot load."""
    import torch.distributed as dist

    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, resume_alone(root))
    steps = [v for v in views if v is not None]
    return max(steps) if steps else None


def resume_oldest_everyone_has(root: str) -> int | None:
    """Communicates, but takes the oldest: the ranks agree, on a step older than rank 0's good one."""
    import torch.distributed as dist

    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, resume_alone(root))
    return None if None in views else min(views)


def resume_verdicts(rank: int, world_size: int) -> dict:
    """The resume checker against the solution and the wrong answers: 'passed' or the message, per candidate."""
    candidates = [runpy.run_path(str(SOLUTIONS))["resume_step"], resume_alone]
    candidates += [resume_newest_anyone_has, resume_oldest_everyone_has]
    verdicts = {}
    for candidate in candidates:
        try:
            ck.check_agreed_resume_step(candidate)
            verdicts[candidate.__name__] = "passed"
        except ck.CheckpointError as error:
            verdicts[candidate.__name__] = f"raised {error}"
        except AssertionError as failure:  # ExerciseFailed
            verdicts[candidate.__name__] = str(failure)
    return verdicts
