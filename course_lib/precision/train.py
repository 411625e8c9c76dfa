"""Notebook 04's training loops (GradScaler or DynamicLossScaler); fp32, bf16 and fp16 (+/- scaling) loss curves."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from course_lib.compare import grad_of, local_tensor
from course_lib.data import batch_for_step, regression
from course_lib.precision.loss_scaler import DynamicLossScaler, local_grads

Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]


def poison_one_gradient(optimizer: torch.optim.Optimizer) -> None:
    """Write inf into the first element of this rank's first local gradient: an overflow on this rank only."""
    with torch.no_grad():
        local_grads(optimizer)[0].view(-1)[0] = math.inf


def amp_training_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | DynamicLossScaler,
    batches: Batches,
    *,
    dtype: torch.dtype = torch.float16,
    poison: dict[int, int] | None = None,
    max_norm: float | None = None,
) -> dict:
    """Train with autocast(`dtype`) and `scaler` (torch.amp.GradScaler or DynamicLossScaler).

    `poison` maps step -> rank: on that step that rank alone finds an inf in its gradients.
    Returns the scale before each step, the steps whose update was skipped, and the losses.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    poison = poison or {}
    scales, skipped, losses = [], [], []
    for step, (x, y) in enumerate(batches):
        device_type = x.device.type
        with torch.autocast(device_type, dtype=dtype):
            loss = nn.functional.mse_loss(model(x), y)
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        if poison.get(step) == rank:
            poison_one_gradient(optimizer)
        scaler.unscale_(optimizer)  # unscale first, so clipping sees the true gradients
        if max_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        before = [local_tensor(p.detach()).clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        if all(torch.equal(b, local_tensor(p.detach())) for b, p in zip(before, model.parameters())):
            skipped.append(step)
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"scales": scales, "skipped": skipped, "losses": losses}


def rank_batches(
    n_steps: int, global_batch: int, device: torch.device, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of the shared regression data: its rows of global batches 0 .. n_steps - 1."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    data = regression(n=n_steps * global_batch, seed=seed)
    batches = (batch_for_step(data, s, global_batch, rank, world, shuffle_seed=None) for s in range(n_steps))
    return [(x.to(device), y.to(device)) for x, y in batches]


PRECISION_MODES = ("fp32", "bf16 autocast", "fp16 autocast, no scaling", "fp16 autocast + GradScaler")


def train_precision_mode(
    mode: str, batches: Batches, *, lr: float, loss_factor: float, device: torch.device, n_layers: int = 2
) -> dict:
    """Data-parallel SGD of the course MLP in one precision mode; gradients averaged over ranks."""
    from course_lib.models import MLP

    model = MLP(n_layers=n_layers).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr / loss_factor)
    dtype = {"fp32": None, "bf16 autocast": torch.bfloat16}.get(mode, torch.float16)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**16) if "GradScaler" in mode else None
    world = dist.get_world_size() if dist.is_initialized() else 1
    losses, zeroed, skipped = [], [], 0
    for x, y in batches:
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = nn.functional.mse_loss(model(x), y)
        scaled = loss * loss_factor
        (scaler.scale(scaled) if scaler else scaled).backward()
        weights = [grad_of(p) for p in model.parameters() if p.dim() == 2]
        # the global batch's loss and zeroed fraction: the same number on every rank
        logged = torch.tensor(
            [loss.item(), sum(int((g == 0).sum()) for g in weights) / sum(g.numel() for g in weights)],
            dtype=torch.float64,
            device=device,
        )
        if world > 1:
            # what DDP does during backward: average the gradients (one flat all-reduce, with the log values)
            grads = [grad_of(p) for p in model.parameters()]
            flat = torch.cat([g.flatten().double() for g in grads] + [logged])
            dist.all_reduce(flat)
            flat /= world
            torch._foreach_copy_(
                grads, [v.view_as(g) for v, g in zip(flat[:-2].split([g.numel() for g in grads]), grads)]
            )
            logged = flat[-2:]
        if scaler:
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped += scaler.get_scale() < before
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(logged[0].item())
        zeroed.append(logged[1].item())
    return {"losses": losses, "zeroed": sum(zeroed) / len(zeroed), "skipped": skipped}
