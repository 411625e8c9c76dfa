"""Shared, fault-tolerant and elastic training, a save's stall; batches follow the step, so resumes match bitwise."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from course_lib import training
from course_lib.checkpoint.atomic import _barrier, _rank_world, latest_complete
from course_lib.checkpoint.dcp import AppState, AsyncCheckpointer, dcp_load, dcp_save
from course_lib.checkpoint.sharded import flat_tensors
from course_lib.compare import local_tensor
from course_lib.data import batch_for_step, regression
from course_lib.launch.runtime import rank_device
from course_lib.launch.spec import NCCL_PROCESS_GROUP
from course_lib.models import MLP, shard_layers_then_root


def sharded_mlp(seed: int = 0, **mlp_kwargs: Any) -> torch.nn.Module:
    """course_lib's MLP with FSDP2: every Linear is a unit, then the root. Parameters become DTensors Shard(0)."""
    return shard_layers_then_root(MLP(seed=seed, **mlp_kwargs).to(rank_device()))


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Adam: two state tensors per parameter, so a checkpoint holds 12 bytes per parameter in all."""
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One optimizer step; returns the mean loss over all ranks (the global batch's loss)."""
    device = next(model.parameters()).device
    mean = training.step(model, optimizer, x.to(device), y.to(device)).clone()
    if dist.is_initialized():
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    return mean.item()


# ---- the fault-tolerant loop


def _append(log: str | os.PathLike, entry: dict[str, Any]) -> None:
    with open(log, "a") as f:
        f.write(json.dumps(entry) + "\n")


def _load_newest(root: str | os.PathLike, app: AppState) -> None:
    """All ranks load rank 0's newest complete checkpoint; separate because it answers notebook 07's exercise 3."""
    found = [latest_complete(root)[0] if _rank_world()[0] == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(found)
    if found[0] is not None:
        dcp_load(found[0], app)


def train_resumable(
    root: str | os.PathLike,
    total_steps: int,
    every: int,
    *,
    kill_at: int | None = None,
    kill_rank: int = -1,
    global_batch: int = 48,
    log: str | os.PathLike | None = None,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """Train `total_steps` steps with a DCP checkpoint every `every` steps, resuming from the newest complete one.

    In the first attempt (TORCHELASTIC_RESTART_COUNT=0), rank `kill_rank` (-1: the last) dies by SIGKILL just
    before step `kill_at`; torchrun restarts the whole group, which resumes here. Rank 0 logs each step's loss
    to `log`. Returns (model, optimizer, first step of this attempt).
    """
    rank, world_size = _rank_world()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    data = regression(n=480)
    model = sharded_mlp()
    optimizer = make_optimizer(model)
    app = AppState(model, optimizer)
    _load_newest(root, app)  # the newest complete checkpoint, the same on every rank (notebook 07's exercise 3)
    start = app.step
    for step in range(start, total_steps):
        if attempt == 0 and step == kill_at and rank == kill_rank % world_size:
            print(f"rank {rank}: SIGKILL to myself before step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch_for_step(data, step, global_batch, rank, world_size)
        loss = train_step(model, optimizer, x, y)
        app.step = step + 1
        if rank == 0 and log is not None:
            _append(log, {"attempt": attempt, "step": step, "loss": loss})
        if app.step % every == 0:
            dcp_save(root, app.step, app)
    return model, optimizer, start


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """This rank's parameters and optimizer state as one flat tensor: what "bitwise equal" compares."""
    tensors = list(model.parameters())
    for state in optimizer.state.values():
        tensors += [v for _, v in sorted(state.items())]
    # .cpu(): an optimizer's step count stays on the CPU while the parameters live on the GPU
    return torch.cat([local_tensor(t).detach().reshape(-1).float().cpu() for t in tensors])


# ---- how long a save stalls training


def time_saves(
    root: str | os.PathLike, mode: str, steps: int = 8, every: int = 2, min_step_s: float = 0.0, **mlp_kwargs: Any
) -> dict[str, list[float]]:
    """Step and stall seconds (an async save's wait for the last counts); min_step_s pads steps so writes overlap."""
    rank, world_size = _rank_world()
    root = Path(root) / mode
    model = sharded_mlp(**mlp_kwargs)
    optimizer = make_optimizer(model)
    app = AppState(model, optimizer)
    d_in, d_out = mlp_kwargs.get("d_in", 32), mlp_kwargs.get("d_out", 8)
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, d_in, generator=generator), torch.randn(64, d_out, generator=generator)
    checkpointer = AsyncCheckpointer(root) if mode == "async" else None
    times: dict[str, list[float]] = {"step": [], "blocked": []}
    for step in range(steps):
        _barrier()
        begin = time.perf_counter()
        train_step(model, optimizer, x, y)
        if min_step_s:
            time.sleep(max(0.0, begin + min_step_s - time.perf_counter()))
        app.step = step + 1
        if mode != "none" and app.step % every == 0:
            save_begin = time.perf_counter()
            if mode == "sync":
                dcp_save(root, app.step, app)
            else:
                assert checkpointer is not None
                checkpointer.save(app.step, app)
            times["blocked"].append(time.perf_counter() - save_begin)
        times["step"].append(time.perf_counter() - begin)
    if checkpointer is not None:
        checkpointer.wait()
    _barrier()
    return times


# ---- comparing two runs


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The whole model and optimizer state as flat {name: tensor} on rank 0 ({} elsewhere): for comparisons."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optimizer_state = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return flat_tensors({"model": model_state, "optimizer": optimizer_state})


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bitwise equal (or present in only one)."""
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or not torch.equal(a[n], b[n])]


EVENTS = "events.jsonl"  # rank 0's log: one JSON object per line (start, step, pause)


def join_group(backend: str, timeout_s: float) -> None:
    """init_process_group via env://; needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so each round gets a fresh store."""
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group(NCCL_PROCESS_GROUP, timeout=timedelta(seconds=timeout_s), device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))


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
    join_group(backend, timeout_s)
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
