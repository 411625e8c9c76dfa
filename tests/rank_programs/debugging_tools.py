"""Rank programs of tests/test_debugging.py for the tools around the debugger: stragglers, a DETAIL crash."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib.debugging import straggler_steps


def stragglers(rank: int, world_size: int, *, slow_rank: int, delay_s: float) -> dict:
    return straggler_steps(8, slow_rank=slow_rank, delay_s=delay_s)


def ddp_construction(rank: int, world_size: int) -> dict:
    DDP(torch.nn.Linear(4, 2))
    return {}
