"""Notebook 14's checkers: gradients_in_sync (implement), mean_finite_loss (diagnose a rank skipping a collective)."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comms
from course_lib.debugging.debugger import checksum_range, gradient_checksums
from course_lib.exercises import ExerciseFailed, refusing
from course_lib.exercises.calls import DEADLOCK_S, record_calls, run_bounded
from course_lib.launch.runtime import rank_device

WRITE_THE_CHECKSUMS = (
    "this calls the course's own checksums (section 7 shows them): write one number per gradient tensor yourself, "
    "with position weights, and compare its MAX and MIN over the ranks"
)


def _model_with_gradients(seed_offset: int) -> nn.Module:
    """An MLP with identical gradients on all ranks: 4,996 values in 6 tensors, far dearer to compare than checksums."""
    from course_lib.models import MLP

    device = rank_device()
    model = MLP(d_in=8, d_hidden=64, d_out=4, n_layers=2).to(device)
    g = torch.Generator().manual_seed(100 + seed_offset)
    x, y = torch.randn(16, 8, generator=g).to(device), torch.randn(16, 4, generator=g).to(device)
    nn.functional.mse_loss(model(x), y).backward()
    return model


def check_gradients_in_sync(fn: Callable[[nn.Module], object]) -> None:
    """fn(model) must return True on every rank when gradients agree, False on every rank when not."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def nudge(model, on_rank):
        if rank == on_rank:
            model[0].weight.grad[1, 2] += 1e-3

    def swap(model, on_rank):
        if rank == on_rank:
            g = model[2].weight.grad
            g[0, 0], g[0, 1] = g[0, 1].clone(), g[0, 0].clone()

    def drop(model, on_rank):
        model[-1].bias.grad = None

    cases = [
        ("gradients identical on every rank", None, None, True),
        (f"one gradient entry changed on rank {world - 1}", nudge, world - 1, False),
        ("one gradient entry changed on rank 0", nudge, 0, False),
        ("two entries of one gradient swapped on rank 1", swap, 1, False),
        ("a parameter without a gradient on every rank", drop, None, True),
    ]
    for i, (what, fault, on_rank, expected) in enumerate(cases):
        model = _model_with_gradients(i)
        if fault is not None:
            fault(model, on_rank)
        with comms.Recorder() as recorder, refusing(checksum_range, gradient_checksums, why=WRITE_THE_CHECKSUMS):
            got = fn(model)
        carried = sum(call.nbytes for call in comms.outermost(recorder.calls))
        tensors = sum(1 for _ in model.parameters())
        if carried > 64 * tensors * world:
            gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            raise ExerciseFailed(
                f"{what}: this rank's collectives carried {carried:,} bytes for {gradient_bytes:,} bytes of gradients. "
                f"Comparing whole gradients costs as much as the all-reduce being audited; {tensors} checksums, one "
                "per gradient tensor, tell the ranks apart just as well"
            )
        if not isinstance(got, (bool, torch.Tensor)) or (isinstance(got, torch.Tensor) and got.numel() != 1):
            raise ExerciseFailed(f"gradients_in_sync must return True or False, got {got!r}")
        got = bool(got)
        if got != expected:
            raise ExerciseFailed(f"{what}: expected {expected} on every rank, got {got} on rank {rank}")
    # A check every rank must agree on: a verdict differing between ranks would leave ranks in
    # different branches of the training loop.
    dist.barrier()


# ---- diagnose: a rank that skips a collective ----------------------------------------------------------------


def check_mean_finite_loss(fn: Callable[[torch.Tensor], object]) -> None:
    """Checker: mean of finite losses and count of non-finite ones, equal on all ranks, via the same collectives."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    checker_group = dist.new_group(timeout=timedelta(seconds=DEADLOCK_S))  # apart from the learner's calls
    salt = torch.randint(0, 2**30, (1,), device=device)
    dist.broadcast(salt, src=0, group=checker_group)
    cases = [
        ("every loss finite", {}),
        (f"NaN loss on rank {world - 1}", {world - 1: math.nan}),
        ("Inf loss on rank 0", {0: math.inf}),
    ]
    for i, (what, bad) in enumerate(cases):
        g = torch.Generator().manual_seed(int(salt) + 7919 * i + rank)
        value = bad.get(rank, 0.5 + float(torch.rand((), generator=g)))
        everyone = [torch.zeros((), device=device) for _ in range(world)]
        dist.all_gather(everyone, torch.tensor(value, device=device), group=checker_group)
        finite = [float(v) for v in everyone if math.isfinite(float(v))]
        with record_calls() as recorded:  # on the default group, with a DEADLOCK_S timeout while fn runs
            got, error = run_bounded(fn, torch.tensor(value, device=device))
        if isinstance(error, RuntimeError):
            raise ExerciseFailed(
                f"{what}: rank {rank} waited {DEADLOCK_S:g} s in a collective that some rank never "
                f"called ({str(error).splitlines()[0][:80]})"
            )
        if error is not None:
            raise error
        counts = [torch.zeros((), dtype=torch.long, device=device) for _ in range(world)]
        try:
            dist.all_gather(counts, torch.tensor(len(recorded.calls), device=device), group=checker_group)
        except RuntimeError:
            raise ExerciseFailed(
                f"{what}: rank {rank} made {len(recorded.calls)} collective call(s) and returned, "
                "but another rank never returned: it waits in a collective that a rank skipped"
            ) from None
        counts_by_rank = [int(c) for c in counts]
        if len(set(counts_by_rank)) > 1:
            raise ExerciseFailed(f"{what}: the ranks made different numbers of collective calls: {counts_by_rank}")
        if counts_by_rank[0] == 0:
            raise ExerciseFailed(f"{what}: no collective call: a rank has only its own loss, the mean needs all")
        _expect_mean_and_count(what, rank, got, sum(finite) / len(finite), world - len(finite))
    dist.barrier(group=checker_group)


def _expect_mean_and_count(what: str, rank: int, got: object, mean: float, n_bad: int) -> None:
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise ExerciseFailed(f"{what}: return (mean, number of non-finite losses), got {got!r} on rank {rank}")
    got_mean, got_bad = float(got[0]), int(got[1])
    if not math.isclose(got_mean, mean, rel_tol=1e-5):
        raise ExerciseFailed(
            f"{what}: rank {rank} returned the mean {got_mean:.6g}, expected {mean:.6g} (over the ranks whose "
            f"loss is finite)"
        )
    if got_bad != n_bad:
        raise ExerciseFailed(f"{what}: rank {rank} counted {got_bad} non-finite loss(es), expected {n_bad}")
