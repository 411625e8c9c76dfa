"""Notebook 00: the health check every new world runs first: can each rank reach every other?"""

from __future__ import annotations

import torch
import torch.distributed as dist


def health_check(device: torch.device | str = "cpu") -> float:
    """All-reduce a one from every rank: the sum must equal the world size.

    Proves every rank reached every other through the backend. Raises on failure.
    """
    ones = torch.ones(1, device=device)
    dist.all_reduce(ones, op=dist.ReduceOp.SUM)
    total = ones.item()
    if total != dist.get_world_size():
        raise RuntimeError(
            f"health check failed on rank {dist.get_rank()}: sum {total}, expected world size {dist.get_world_size()}"
        )
    return total
