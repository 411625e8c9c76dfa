"""Notebook 02's harness: one run single-process or data-parallel, the gradients-equal-rank-0 check, the snapshot."""

from __future__ import annotations

import contextlib
from collections.abc import Sized
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from course_lib.ddp.minimal_ddp import unwrap


def check_gradient_sync(model: nn.Module, atol: float = 0.0, group: dist.ProcessGroup | None = None) -> float:
    """Assert all ranks hold rank 0's gradients (one broadcast), so drift shows at once; return the largest gap."""
    named = [(n, p) for n, p in unwrap(model).named_parameters() if p.requires_grad]
    mine = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for _, p in named])
    reference = mine.clone()
    dist.broadcast(reference, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    local = (mine - reference).abs().max().reshape(1)
    per_rank = [torch.zeros_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(per_rank, local, group=group)
    worst = max(float(d) for d in per_rank)
    bad = [r for r, d in enumerate(per_rank) if float(d) > atol]
    if bad:
        where = ""
        if float(local) > atol:
            offset = 0
            for name, p in named:
                if (mine[offset : offset + p.numel()] - reference[offset : offset + p.numel()]).abs().max() > atol:
                    where = f"; here on rank {dist.get_rank(group)} first in {name}"
                    break
                offset += p.numel()
        raise AssertionError(f"gradients out of sync: rank(s) {bad} differ from rank 0 by up to {worst:.3g}{where}")
    return worst


def save_snapshot(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Rank 0 writes model + optimizer + step; the others wait until the file is complete.

    The replicas are identical, so one copy is the whole state. Saved without the DDP wrapper
    (no "module." prefix), so the file loads into a plain model too.
    """
    if dist.get_rank() == 0:
        torch.save({"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path)
    dist.barrier()  # nobody may read (or exit and delete) the file before rank 0 has written it


def load_snapshot(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Every rank loads the same snapshot onto its own device; returns the step to resume from."""
    device = next(unwrap(model).parameters()).device
    snapshot = torch.load(path, map_location=device, weights_only=True)
    unwrap(model).load_state_dict(snapshot["model"])
    optimizer.load_state_dict(snapshot["optimizer"])
    return snapshot["step"]


if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

    from course_lib.ddp.minimal_ddp import MinimalDDP


def shuffled_order(dataset: Dataset, epoch: int, seed: int = 0) -> list[int]:
    """The permutation DistributedSampler(shuffle=True, seed=seed) uses in `epoch`, on every rank."""
    g = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(len(cast(Sized, dataset)), generator=g).tolist()


def rank_loader(dataset: Dataset, micro_batch: int, epoch: int, seed: int = 0) -> DataLoader:
    """This rank's shard: DistributedSampler hands rank r the indices order[r::N]."""
    sampler: DistributedSampler = DistributedSampler(dataset, shuffle=True, seed=seed, drop_last=True)
    sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
    return DataLoader(dataset, batch_size=micro_batch, sampler=sampler)


def global_loader(dataset: Dataset, batch: int, epoch: int, seed: int = 0) -> DataLoader:
    """Single-process reference: the same shuffled order, whole global batches."""
    return DataLoader(dataset, batch_size=batch, sampler=shuffled_order(dataset, epoch, seed))


@dataclass
class TrainLog:
    losses: list[float] = field(default_factory=list)  # mean loss over each global batch
    bytes_sent: list[int | None] = field(default_factory=list)  # per step, by this process (None under NCCL)


def bytes_written() -> int | None:
    """Bytes this process wrote (/proc/self/io wchar): on gloo, what it sent plus a little output; None under NCCL."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return None
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar"):
                return int(line.split()[1])
    return 0


def train(
    model: nn.Module,
    dataset: Dataset,
    *,
    global_batch: int,
    epochs: int,
    lr: float = 1e-2,
    accumulation: int = 1,
    max_grad_norm: float | None = 1.0,
    distributed: bool = True,
    check_sync: bool = False,
    seed: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
    first_epoch: int = 0,
) -> TrainLog:
    """Adam on `dataset` in global batches of `global_batch`, single-process or data-parallel."""
    n = dist.get_world_size() if distributed else 1
    if global_batch % (n * accumulation):
        raise ValueError(f"global batch {global_batch} must split into {n} ranks x {accumulation} micro-batches")
    device = next(model.parameters()).device
    optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=lr)
    log = TrainLog()
    for epoch in range(first_epoch, epochs):
        loader = (
            rank_loader(dataset, global_batch // (n * accumulation), epoch, seed)
            if distributed
            else global_loader(dataset, global_batch // accumulation, epoch, seed)
        )
        batches = iter(loader)
        for _ in range(len(loader) // accumulation):
            step_loss = torch.zeros((), device=device)
            sent = bytes_written()
            for micro in range(accumulation):
                x, y = (t.to(device) for t in next(batches))
                last = micro == accumulation - 1
                wrapper = cast("DistributedDataParallel | MinimalDDP", model)
                sync = contextlib.nullcontext() if (last or not distributed) else wrapper.no_sync()
                with sync:  # forward too: torch DDP prepares its reducer in forward
                    loss = nn.functional.mse_loss(model(x), y) / accumulation
                    loss.backward()
                step_loss += loss.detach()
            after = bytes_written()
            log.bytes_sent.append(None if sent is None or after is None else after - sent)
            if check_sync:
                check_gradient_sync(model)
            if max_grad_norm is not None:
                # Gradients are identical on every rank after the sync, so every rank clips by the same factor.
                nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if distributed:
                dist.all_reduce(step_loss)
                step_loss /= n
            log.losses.append(step_loss.item())
    return log
