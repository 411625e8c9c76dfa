"""Elastic training under torchrun --nnodes 1:2 (rank side): each membership change restarts the program, which
resumes from the newest DCP checkpoint (resharded to the new world size) with the global batch fixed."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.checkpoint import AppState, dcp_load, dcp_save, latest_complete, make_optimizer, sharded_mlp, train_step
from course_lib.data import batch_for_step, regression
from course_lib.launch.runtime import init_distributed

EVENTS = "events.jsonl"  # rank 0's log: one JSON object per line (start, step, pause)


def _log(root: Path, entry: dict) -> None:
    if dist.get_rank() == 0:
        with open(root / EVENTS, "a") as f:
            f.write(json.dumps(entry) + "\n")


def wait_for_membership_change(limit_s: float, on_ready: Callable[[], None] = lambda: None) -> None:
    """Idle at a checkpoint until the group changes; this process never returns from here."""
    heartbeat_group = dist.new_group(backend="gloo")  # on NCCL too: gloo notices a dead peer at once
    beat = torch.zeros(1)
    dist.all_reduce(beat, group=heartbeat_group)
    on_ready()
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        dist.all_reduce(beat, group=heartbeat_group)
        time.sleep(0.2)
    raise TimeoutError(f"no node joined or left within {limit_s:.0f} s")


def uninterrupted_losses(total_steps: int, global_batch: int) -> list[float]:
    """The same training from step 0, uninterrupted, at this world size: what the elastic run must match."""
    rank, world = dist.get_rank(), dist.get_world_size()
    data = regression(n=480)
    model = sharded_mlp()
    optimizer = make_optimizer(model)
    return [
        train_step(model, optimizer, *batch_for_step(data, step, global_batch, rank, world))
        for step in range(total_steps)
    ]


def _resume(checkpoints: Path, app: AppState) -> int | None:
    """Load the newest complete checkpoint into `app`; the number of ranks that saved it (None: none found)."""
    found = [latest_complete(checkpoints)[0] if dist.get_rank() == 0 else None]  # one rank decides, all follow
    dist.broadcast_object_list(found)
    if found[0] is None:
        return None
    dcp_load(found[0], app)
    return len(list(Path(found[0]).glob("*.distcp")))  # DCP writes one file per saving rank


def _reference_once(root: Path, total_steps: int, global_batch: int) -> None:
    """The uninterrupted run at this world size, once per world size (rank 0 decides: every rank runs it, or none)."""
    reference = root / f"reference_{dist.get_world_size()}.json"
    todo = [not reference.exists() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(todo)
    if todo[0]:
        losses = uninterrupted_losses(total_steps, global_batch)
        if dist.get_rank() == 0:
            reference.write_text(json.dumps(losses))


def train_elastic(
    root: str | os.PathLike,
    total_steps: int = 12,
    pauses: tuple[int, ...] = (4, 8),
    *,
    backend: str = "gloo",
    global_batch: int = 48,
    timeout_s: float = 300.0,
) -> None:
    """Resume from the newest complete checkpoint under ROOT/checkpoints and train to `total_steps`.

    After the checkpoint at each step of `pauses` it waits for a membership change; a start that finds
    the world size it paused with (the agents restarted without the change) waits again. Rank 0 logs to
    ROOT/events.jsonl and, once per world size, the losses of an uninterrupted run to reference_<W>.json.
    """
    root = Path(root)
    init_distributed(backend, timeout_s, seed=None)  # each round on a fresh store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = sharded_mlp()
    optimizer = make_optimizer(model)
    app = AppState(model, optimizer)
    saved_by = _resume(root / "checkpoints", app)  # resharded by DCP to this world size
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    _log(root, {"event": "start", "world": world, "step": app.step, "saved_by": saved_by, "restarts": restarts})
    if app.step in pauses and saved_by == world:
        wait_for_membership_change(timeout_s)  # restarted, but not by the change this pause waits for
    data = regression(n=480)
    for step in range(app.step, total_steps):
        loss = train_step(model, optimizer, *batch_for_step(data, step, global_batch, rank, world))
        app.step = step + 1
        _log(root, {"event": "step", "world": world, "step": step, "loss": loss})
        if app.step in pauses:
            dcp_save(root / "checkpoints", app.step, app)
            _reference_once(root, total_steps, global_batch)
            paused = {"event": "pause", "world": world, "step": app.step}
            wait_for_membership_change(timeout_s, partial(_log, root, paused))  # logged once every rank waits
    dist.destroy_process_group()
