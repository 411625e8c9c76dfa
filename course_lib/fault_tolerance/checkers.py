"""Notebook 07's exercise checkers: DiLoCo's outer step in one all-reduce; every rank resumes from rank 0's choice."""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from course_lib import comms
from course_lib.checkpoint import save_sharded
from course_lib.exercises import ExerciseFailed
from course_lib.models import MLP

# ---- exercise 2: DiLoCo's outer step -------------------------------------------------------------------------


def _outer_case(seed: int, rank: int) -> tuple[torch.nn.Module, list[torch.Tensor], torch.optim.Optimizer]:
    """This replica's drifted model, the shared anchor (last synchronised weights) and DiLoCo's outer optimizer."""
    model = MLP(seed=seed % 1000)
    anchor = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    drift = torch.Generator().manual_seed(seed + 7919 * (rank + 1))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=drift))
    outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)
    return model, anchor, outer


def _mean_drift(seed: int, world_size: int) -> list[torch.Tensor]:
    """The replicas' mean drift from the anchor, computed here from every rank's (seeded) drift."""
    cases = [_outer_case(seed, r) for r in range(world_size)]
    drifts = [[p.detach() - a.detach() for p, a in zip(m.parameters(), anchor)] for m, anchor, _ in cases]
    return [torch.stack([d[i] for d in drifts]).mean(0) for i in range(len(drifts[0]))]


def _expected_outer(seed: int, world_size: int, rounds: int) -> list[torch.Tensor]:
    """Anchor after `rounds` outer steps: Nesterov SGD on the mean pseudo-gradient; the same drifts each round."""
    mean = _mean_drift(seed, world_size)
    _, anchor, outer = _outer_case(seed, 0)
    for _ in range(rounds):
        for a, m in zip(anchor, mean):
            a.grad = -m
        outer.step()
    return [a.detach().clone() for a in anchor]


def check_diloco_outer_step(diloco_outer_step: Callable[..., Any]) -> None:
    """Checker: two outer steps (the second shows momentum) agree on all ranks, all-reducing at most 4P bytes a call."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    secret: list[Any] = [random.Random().randrange(2**31) if rank == 0 else None]
    dist.broadcast_object_list(secret)
    seed = int(secret[0])
    model, anchor, outer = _outer_case(seed, rank)
    drift = [p.detach() - a.detach() for p, a in zip(model.parameters(), anchor)]
    budget = 4 * sum(p.numel() for p in model.parameters())
    for round_ in (1, 2):
        if round_ == 2:  # the replica drifts again from the new anchor, by the same amount
            with torch.no_grad():
                for p, a, d in zip(model.parameters(), anchor, drift):
                    p.copy_(a + d)
        start = [a.detach().clone() for a in anchor]
        with comms.Recorder() as recorder:
            diloco_outer_step(model, anchor, outer)
        calls = comms.outermost(recorder.calls)
        sent = sum(c.nbytes for c in calls)
        if any(c.op != "all_reduce" for c in calls) or sent > budget:
            ops = ", ".join(sorted({c.op for c in calls}))
            raise ExerciseFailed(
                f"round {round_}: your function sent {sent:,} B in {ops} ({len(calls)} calls); DiLoCo sends one "
                f"average of the pseudo-gradient, an all-reduce of 4P = {budget:,} B per replica. Gathering every "
                "replica's weights sends W times that"
            )
        if not calls and world_size > 1:
            raise ExerciseFailed(
                f"round {round_}: your function made no collective call: each replica stepped on its own "
                "pseudo-gradient. DiLoCo averages it over the replicas (an all-reduce) before the outer step"
            )
        local_sgd = [s + m for s, m in zip(start, _mean_drift(seed, world_size))]
        _judge_outer(round_, model, anchor, _expected_outer(seed, world_size, round_), start, local_sgd)


def _judge_outer(
    round_: int,
    model: torch.nn.Module,
    anchor: list[torch.Tensor],
    expected: list[torch.Tensor],
    start: list[torch.Tensor],
    local_sgd: list[torch.Tensor],
) -> None:
    """Name what is wrong with the anchor and the model after one outer step, or return."""

    def equal(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> bool:
        return all(torch.allclose(x.detach(), y, atol=1e-6) for x, y in zip(xs, ys))

    if not equal(anchor, expected):
        if equal(anchor, start):
            raise ExerciseFailed(
                f"round {round_}: the anchor did not move: give each anchor tensor its averaged pseudo-gradient "
                "as .grad and call outer_optimizer.step()"
            )
        if equal(anchor, local_sgd):
            raise ExerciseFailed(
                f"round {round_}: the anchor is the replicas' average weights: that is LocalSGD (DiLoCo with outer "
                "SGD at lr 1). DiLoCo hands the averaged pseudo-gradient (anchor - weights) to the outer optimizer"
            )
        raise ExerciseFailed(
            f"round {round_}: the anchor differs from the outer optimizer's step on the mean pseudo-gradient "
            "(anchor - weights, averaged over the replicas: the sum over the W ranks divided by W)"
        )
    if not equal(list(model.parameters()), expected):
        raise ExerciseFailed(
            f"round {round_}: the anchor is right, but the model's weights are not: the next inner steps start "
            "from the new anchor (copy it into the model)"
        )


# ---- exercise 3: agree on the step to resume from ------------------------------------------------------------


def _resume_views(base: Path, rank: int, world_size: int) -> list[tuple[str, Path, int | None]]:
    """Per case: this rank's view of the checkpoint directory, and the step rank 0's view resumes from."""

    def save(root: Path, step: int) -> Path:
        return save_sharded(root, step, {"weights": torch.arange(4.0) + step, "step": step}, no_dist=True)

    drawn = [random.Random().randrange(6, 60, 2) if rank == 0 else None]
    dist.broadcast_object_list(drawn)  # the checker's own collective, before the learner's function runs
    newest = int(drawn[0])  # type: ignore[arg-type]
    cases: list[tuple[str, Path, int | None]] = []
    root = base / "lagging"
    save(root, 4)
    if rank == 0:
        save(root, newest)
    else:
        save(root, newest).rename(root / f"step_{newest}.tmp")  # not yet committed in this view
    cases.append((f"rank 0 sees step_{newest} committed, the others do not yet", root, newest))
    root = base / "rank0_truncated"
    for step in (2, newest):
        save(root, step)
    if rank == 0:
        shard = root / f"step_{newest}" / "shard_0.bin"
        shard.write_bytes(shard.read_bytes()[:-8])
    cases.append((f"rank 0's step_{newest} is truncated, the others' is fine", root, 2))
    root = base / "only_others"
    if rank != 0:
        save(root, newest)
    cases.append(("rank 0 sees no checkpoint, the others do", root, None))
    return cases


def check_agreed_resume_step(resume_step: Callable[[str], Any]) -> None:
    """Checker: each rank sees its own directory, so only agreeing on rank 0's newest complete step passes."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    with tempfile.TemporaryDirectory() as base:
        for what, root, expected in _resume_views(Path(base), rank, world_size):
            wrong = None
            try:
                got = resume_step(str(root))
                if got != expected:
                    wrong = f"case '{what}': returned step {got!r}, rank 0 resumes from step {expected!r}"
            except Exception as error:
                wrong = f"case '{what}': your function raised {type(error).__name__}: {error}"
            everyone: list[Any] = [None] * world_size
            dist.all_gather_object(everyone, wrong is not None)
            if wrong:
                raise ExerciseFailed(wrong)
            if any(everyone):
                return  # another rank's answer was wrong; that rank reports it
