"""Notebook 10's exercises, checked on the ranks: ring attention's forward, and Ulysses' way back to the tokens."""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib.context_parallel.ring_attention import Ring, RingAttention, ring_attention
from course_lib.context_parallel.ulysses import heads_to_sequence, ulysses_attention
from course_lib.exercises import ExerciseFailed, expect_equal, refusing
from course_lib.exercises.calls import (
    COLLECTIVES,
    COMMUNICATION,
    DEADLOCK_S,
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
    """Checks fn(q, k, v) gives this rank's attention over the whole sequence by point-to-point only, never gathered."""
    rank, n = dist.get_rank(), dist.get_world_size()
    side = side_group()
    for chunk, dim in ((3, 4), (5, 8)):
        q, k, v = (_secret((2, 2, chunk, dim)) for _ in range(3))
        everyone: list = [None] * n
        dist.all_gather_object(everyone, (q, k, v), group=side)
        full_q, full_k, full_v = (torch.cat([mine[i] for mine in everyone], dim=2) for i in range(3))
        expected = F.scaled_dot_product_attention(full_q, full_k, full_v)[:, :, rank * chunk : (rank + 1) * chunk]
        mine = [t.to(rank_device()) for t in (q, k, v)]
        with (
            record_calls(forbidden=COLLECTIVES, advice=_RING_ONLY, bound_s=DEADLOCK_S) as recorder,
            _Watch(mine[0], 2 * k.nbytes) as seen,
            refusing(Ring, RingAttention, ring_attention, why=_WRITE_THE_RING),
        ):
            got, error = run_bounded(fn, *mine)
        report = (None if error is None else f"{type(error).__name__}: {error}", seen.longest, seen.waiting)
        reports = gather_reports(report, side)
        failed = [(r, e) for r, (e, _, _) in enumerate(reports) if e is not None]
        if failed:
            r, e = failed[0]
            raise ExerciseFailed(f"rank {r} raised or waited too long ({e}) with chunks of {chunk} tokens")
        whole = [r for r, (_, longest, _) in enumerate(reports) if n > 1 and longest >= n * chunk]
        if whole:
            raise ExerciseFailed(
                f"ranks {whole} built a tensor spanning all {n * chunk} tokens (chunks of {chunk}): you gathered the "
                "whole K/V (or every score) on one rank. A ring never holds more than a block or two: attend to each "
                "block as it arrives and merge the partial results with the online softmax"
            )
        hoarded = [(r, waiting) for r, (_, _, waiting) in enumerate(reports) if waiting > 1.5]
        if hoarded:
            r, waiting = hoarded[0]
            raise ExerciseFailed(
                f"rank {r} held {waiting:g} received K/V blocks it had not attended to yet ({n} ranks, chunks of "
                f"{chunk}): you gathered the blocks with messages and kept them. A ring holds two blocks, the one it "
                "computes on and the one arriving: attend to each block when it arrives, before the next one"
            )
        if not any(call.op in ("send", "recv") for call in recorder.calls):
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


_SHAPE_ONLY = {"empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros", "new_ones", "new_full"}


class _Watch(TorchDispatchMode):
    """Measures the most tokens one tensor held and the received K/V blocks still unread: a ring has at most one."""

    def __init__(self, queries: torch.Tensor, block_bytes: int) -> None:
        super().__init__()
        self.longest, self.waiting, self.block_bytes = 0, 0.0, block_bytes
        self.queries = queries.untyped_storage().data_ptr()
        self.unread: dict[int, int] = {}  # storage of a received buffer -> its bytes, until an op reads it

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func.namespace == "c10d" and func._opname == "recv_":
            for buffer in args[0]:
                self.unread[buffer.untyped_storage().data_ptr()] = buffer.nbytes
                weakref.finalize(buffer, self.unread.pop, buffer.untyped_storage().data_ptr(), None)
        elif not func.is_view and func.namespace != "c10d" and func._opname not in _SHAPE_ONLY:
            storages = {t.untyped_storage().data_ptr() for t in tensors}
            for storage in storages & set(self.unread):
                del self.unread[storage]
            if self.queries in storages:  # the queries meet a block: how many received blocks wait unread
                self.waiting = max(self.waiting, sum(self.unread.values()) / self.block_bytes)
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                self.longest = max(self.longest, t.shape[-2], t.shape[-1])
        return out


_ALL_TO_ALL = "move the blocks with dist.all_to_all_single (or ep.all_to_all), one all-to-all"
_WRITE_THE_INVERSE = (
    "this uses the course's own Ulysses (section 7 calls it): write the inverse all-to-all yourself, from "
    "dist.all_to_all_single or ep.all_to_all"
)


def check_heads_to_sequence(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Checks fn turns this rank's heads (batch, h/N, S, d) into chunk r of every head (batch, h, S/N, d)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    side = side_group()
    for batch, heads_per_rank, chunk, dim in ((2, 1, 3, 4), (1, 2, 2, 3)):
        x = _secret((batch, heads_per_rank, n * chunk, dim))
        everyone: list = [None] * n
        dist.all_gather_object(everyone, x, group=side)
        whole = torch.cat(everyone, dim=1)  # (b, h, S, d): rank j's heads are heads j·h/N ...
        expected = whole[:, :, rank * chunk : (rank + 1) * chunk]
        allowed = ("all_to_all_single", "all_to_all")
        with (
            record_calls(forbidden=[c for c in COMMUNICATION if c not in allowed], advice=_ALL_TO_ALL) as recorder,
            refusing(heads_to_sequence, ulysses_attention, why=_WRITE_THE_INVERSE),
        ):
            got, error = run_bounded(fn, x.to(rank_device()))
        reports = gather_reports(None if error is None else f"{type(error).__name__}: {error}", side)
        failed = [(r, e) for r, e in enumerate(reports) if e is not None]
        if failed:
            r, e = failed[0]
            raise ExerciseFailed(f"rank {r} raised or waited too long: {e}")
        if n > 1 and not recorder.calls:
            raise ExerciseFailed(f"rank {rank} sent nothing: its tokens of the other ranks' heads are on those ranks")
        budget = x.nbytes * (n - 1) // n
        sent = sum(call.nbytes for call in recorder.calls)
        if sent > budget:
            raise ExerciseFailed(
                f"rank {rank} sent {sent} B where one all-to-all sends {budget} B ((N-1)/N of its {x.nbytes} B): "
                "send each rank only its own tokens of your heads, once"
            )
        expect_equal(
            f"rank {rank}'s tokens of every head ({n} ranks, {heads_per_rank} heads each, chunks of {chunk})",
            got.detach().cpu() if isinstance(got, torch.Tensor) else got,
            expected,
        )
