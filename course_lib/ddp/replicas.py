"""Keeping the replicas one: a check that every rank holds rank 0's gradients, and the rank-0 snapshot."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib.ddp.minimal_ddp import unwrap


def check_gradient_sync(model: nn.Module, atol: float = 0.0, group: dist.ProcessGroup | None = None) -> float:
    """Assert every rank holds the same gradients as rank 0; return the largest difference seen.
    Drifting replicas are found at the first step rather than as a worse loss much later; costs one broadcast."""
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
