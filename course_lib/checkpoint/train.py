"""Shared and fault-tolerant training, a save's stall; batches follow the step, so resumes match bitwise."""

from __future__ import annotations

import json
import os
import signal
import time
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
