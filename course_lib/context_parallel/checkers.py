"""Notebook 10's context-parallel exercise, checked on the ranks: the forward of ring attention.

The solution is in notebooks/solutions/10_context_parallel.py, not here.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib.context_parallel.ring_attention import Ring, RingAttention, ring_attention
from course_lib.exercises import ExerciseFailed, expect_equal, refusing
from course_lib.exercises.calls import (
    BLOCKING_P2P,
    COLLECTIVES,
    DEADLOCK_S,
    NONBLOCKING_P2P,
    gather_reports,
    record_calls,
    run_bounded,
    side_group,
)
from course_lib.launch.runtime import rank_device

_RING_ONLY = "pass the K/V blocks around the ring with dist.send/recv, isend/irecv or batch_isend_irecv"


def _secret(shape: tuple[int, ...]) -> torch.Tensor:
    """Numbers only this rank knows (seeded by the OS): the answer needs the other ranks' blocks."""
    gen = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    return torch.randn(shape, generator=gen)


_WRITE_THE_RING = (
    "this uses the course's own ring (section 3 shows it): write the ring yourself, from point-to-point sends, "
    "block_attention and merge_partials"
)


def check_ring_forward(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """fn(q, k, v) -> this rank's rows of softmax(Q Kᵀ/√d) V over the whole sequence (no mask).

    q, k, v (batch, heads, c, d) are chunk r of a sequence cut into N equal chunks, one per rank; the
    blocks must travel with point-to-point messages (collectives are switched off while fn runs), and no tensor
    fn makes may span the whole sequence (the shortcut of gathering every block and calling attention once).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    side = side_group()
    for chunk, dim in ((3, 4), (5, 8)):
        q, k, v = (_secret((2, 2, chunk, dim)) for _ in range(3))
        everyone: list = [None] * n
        dist.all_gather_object(everyone, (q, k, v), group=side)
        full_q, full_k, full_v = (torch.cat([mine[i] for mine in everyone], dim=2) for i in range(3))
        expected = F.scaled_dot_product_attention(full_q, full_k, full_v)[:, :, rank * chunk : (rank + 1) * chunk]
        device = rank_device()
        with (
            record_calls(forbidden=COLLECTIVES, advice=_RING_ONLY, bound_s=DEADLOCK_S) as calls,
            _Longest() as seen,
            refusing(Ring, RingAttention, ring_attention, why=_WRITE_THE_RING),
        ):
            got, error = run_bounded(fn, q.to(device), k.to(device), v.to(device))
        reports = gather_reports((None if error is None else f"{type(error).__name__}: {error}", seen.longest), side)
        failed = [(r, e) for r, (e, _) in enumerate(reports) if e is not None]
        if failed:
            r, e = failed[0]
            raise ExerciseFailed(f"rank {r} raised or waited too long ({e}) with chunks of {chunk} tokens")
        whole = [r for r, (_, longest) in enumerate(reports) if n > 1 and longest >= n * chunk]
        if whole:
            raise ExerciseFailed(
                f"ranks {whole} built a tensor spanning all {n * chunk} tokens (chunks of {chunk}): you gathered the "
                "whole K/V (or every score) on one rank. A ring never holds more than a block or two: attend to each "
                "block as it arrives and merge the partial results with the online softmax"
            )
        if not any(call.name in BLOCKING_P2P + NONBLOCKING_P2P for call in calls):
            raise ExerciseFailed(f"rank {rank} sent no message: its queries need every rank's keys and values")
        if not isinstance(got, torch.Tensor):
            raise ExerciseFailed(f"ring_forward must return a tensor, got {type(got).__name__}")
        expect_equal(
            f"rank {rank}'s attention output ({n} chunks of {chunk} tokens, head dim {dim})",
            got.detach().cpu(),
            expected,
            atol=1e-5,
            rtol=1e-4,
        )


class _Longest(TorchDispatchMode):
    """The longest last or second-to-last dimension of any tensor an op makes while active: the most tokens
    (keys, or scores per query) one tensor held."""

    def __init__(self) -> None:
        super().__init__()
        self.longest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                self.longest = max(self.longest, t.shape[-2], t.shape[-1])
        return out
