"""Notebook 09's exercise checkers: a 1F1B list judged by its properties; a pipeline step that must not deadlock."""

from __future__ import annotations

import datetime
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib.compare import grad_of
from course_lib.exercises import ExerciseFailed, calls_into
from course_lib.exercises.calls import DEADLOCK_S, record_calls, run_bounded
from course_lib.pipeline.execution import execute
from course_lib.pipeline.lab import mse_loss, reference_stage_gradients
from course_lib.pipeline.schedules import (
    Action,
    _one_f_one_b_actions,
    ideal_bubble,
    interleaved_actions,
    peak_in_flight,
    schedule_actions,
    zero_bubble_actions,
)
from course_lib.pipeline.stages import course_model, split_into_stages
from course_lib.pipeline.timeline import Deadlock, bubble_fraction, simulate


def _as_actions(got: Any, stage: int) -> list[Action]:
    if not isinstance(got, (list, tuple)):
        raise ExerciseFailed(f"stage {stage}: expected a list of (kind, microbatch) pairs, got {type(got).__name__}")
    out = []
    for item in got:
        if not (
            isinstance(item, (tuple, list)) and len(item) >= 2 and item[0] in ("F", "B") and isinstance(item[1], int)
        ):
            raise ExerciseFailed(f'stage {stage}: {item!r} is not a ("F" or "B", microbatch) pair')
        out.append(Action(item[0], int(item[1]), stage))
    return out


def _short(actions: Sequence[Action]) -> str:
    return " ".join(f"{a.kind}{a.microbatch}" for a in actions)


def _library_schedules() -> dict[str, Callable[..., Any]]:
    """The schedule generators exercise 2 refuses to see called, torch's 1F1B orders included."""
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleInterleaved1F1B, _get_1f1b_rank_ops

    return {
        "schedule_actions": schedule_actions,
        "_one_f_one_b_actions": _one_f_one_b_actions,
        "interleaved_actions": interleaved_actions,
        "zero_bubble_actions": zero_bubble_actions,  # 1F1B once its W's are dropped
        "Schedule1F1B._get_pipeline_order": Schedule1F1B._get_pipeline_order,
        "ScheduleInterleaved1F1B": ScheduleInterleaved1F1B,
        "torch's _get_1f1b_rank_ops": _get_1f1b_rank_ops,
    }


def check_one_f_one_b(fn: Callable[[int, int, int], Any]) -> None:
    """Judges fn's 1F1B lists by properties (complete, no deadlock, memory, bubble) for secret m, then runs them."""
    rank, p = dist.get_rank(), dist.get_world_size()
    secret: list[Any] = [None, None]
    if rank == 0:
        draw = random.Random()
        secret = [draw.randrange(2**31), draw.randrange(p + 1, 3 * p + 3)]
    dist.broadcast_object_list(secret)
    seed, m_large = secret

    def fail_on(stage: int, message: str) -> None:
        if rank == stage:
            raise ExerciseFailed(message)

    library = _library_schedules()
    lists: dict[int, list[Action]] = {}
    for m in dict.fromkeys((1, 2, p, m_large)):
        lists = {}
        for s in range(p):
            with calls_into(library) as called:
                got = fn(s, p, m)
            if called:
                return fail_on(
                    s,
                    f"stage {s}: your function calls {called[0]} (recorded): that is a library's schedule, not "
                    "yours. Build the list from section 2's rule: warm-up forwards, then one "
                    "forward and one backward, then the drain",
                )
            try:
                lists[s] = _as_actions(got, s)
                _validate_stage(lists[s], s, m)
            except (ExerciseFailed, ValueError) as error:
                return fail_on(s, f"n_microbatches={m}: {error}")
        try:
            events = simulate(lists, p, t_forward=1, t_backward=2)
        except Deadlock as error:
            return fail_on(min(error.waiting), f"n_microbatches={m}: the stages' lists {error}")
        for s in range(p):
            held, bound = peak_in_flight(lists[s]).get(s, 0), min(p - s, m)
            if held > bound:
                return fail_on(
                    s,
                    f"stage {s} of {p}, n_microbatches={m}: holds {held} micro-batches' activations at once "
                    f"([{_short(lists[s])}]); 1F1B holds at most min(p - s, m) = {bound}: it runs a backward as "
                    "soon as its gradient can be there, before the next forward",
                )
        bubble, ideal = bubble_fraction(events, p), ideal_bubble(p, m)
        if bubble > ideal + 1e-9:
            span = max(e.end for e in events)
            idle = {r: span - sum(e.end - e.start for e in events if e.rank == r) for r in range(p)}
            worst = max(idle, key=lambda r: (idle[r], -r))
            return fail_on(
                worst,
                f"n_microbatches={m}: the lists run and hold little, but the step takes {span:g} time units "
                f"(t_f = 1, t_b = 2): a bubble of {bubble:.3f} where 1F1B's is (p-1)/(m+p-1) = {ideal:.3f}. "
                f"Stage {worst} sits idle {idle[worst]:g} units ([{_short(lists[worst])}]): it waits for a "
                "gradient when it could run a forward",
            )
    # The lists have 1F1B's properties: run them on the ranks and compare with single-process training.
    _run_and_compare(lists[rank], p, len(lists[rank]) // 2, seed)


def _validate_stage(actions: Sequence[Action], stage: int, m: int) -> None:
    seen = set()
    for a in actions:
        if not 0 <= a.microbatch < m:
            raise ValueError(f"stage {stage}: micro-batch {a.microbatch} does not exist (0..{m - 1})")
        if a in seen:
            raise ValueError(f"stage {stage}: {a.kind}{a.microbatch} appears twice")
        if a.kind == "B" and Action("F", a.microbatch, stage) not in seen:
            raise ValueError(f"stage {stage}: B{a.microbatch} comes before F{a.microbatch}")
        seen.add(a)
    missing = [f"{k}{mb}" for mb in range(m) for k in "FB" if Action(k, mb, stage) not in seen]
    if missing:
        raise ValueError(f"stage {stage}: missing {' '.join(missing)}")


def _run_and_compare(actions: Sequence[Action], p: int, m: int, seed: int) -> None:
    rank = dist.get_rank()
    model = course_model(n_units=max(p, 2), seed=seed)
    torch.manual_seed(seed)
    x, y = torch.randn(4 * m, 64), torch.randn(4 * m, 8)
    _, expected = reference_stage_gradients(model, p, x, y)
    mine = split_into_stages(course_model(n_units=max(p, 2), seed=seed), p)[rank]
    execute(actions, {rank: mine}, p, list(x.chunk(m)), list(y.chunk(m)), mse_loss, (4, 64))
    for i, (param, want) in enumerate(zip(mine.parameters(), expected[rank])):
        if not torch.allclose(grad_of(param), want, atol=1e-6, rtol=1e-4):
            raise ExerciseFailed(f"stage {rank}: gradient of parameter {i} differs from single-process training")


def check_pipeline_step(fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], Any]) -> None:
    """Checks naive model parallelism against one process; only messages carry input and target, a stuck recv fails."""
    rank, p = dist.get_rank(), dist.get_world_size()
    in_step = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=DEADLOCK_S))  # the ranks, per batch
    for seed, batch in ((3, 8), (4, 5)):
        model = course_model(n_units=max(p, 2), seed=seed)
        torch.manual_seed(seed)
        x, y = torch.randn(batch, 64), torch.randn(batch, 8)
        reference_loss, expected = reference_stage_gradients(model, p, x, y)
        mine = split_into_stages(course_model(n_units=max(p, 2), seed=seed), p)[rank]
        x_here = x if rank == 0 else torch.full_like(x, float("nan"))
        y_here = y if rank == p - 1 else torch.full_like(y, float("nan"))
        with record_calls(bound_s=DEADLOCK_S) as recorded:  # and isend/irecv waits bounded by the group timeout
            loss, error = run_bounded(fn, mine, x_here, y_here)
        if error is not None:
            signs = ("timed out", "connection closed", "remote worker")
            if not isinstance(error, RuntimeError) or not any(sign in str(error).lower() for sign in signs):
                raise error
            raise ExerciseFailed(
                f"rank {rank} of {p}: stuck in recv (batch {batch}; it, or the rank it waited on, gave up after "
                f"{DEADLOCK_S:g} s): the ranks wait for messages no rank has sent yet: a deadlock"
            ) from None
        if p > 1 and not recorded.calls:
            raise ExerciseFailed(f"rank {rank}: sent and received nothing; stage {rank} needs the other stages' data")
        if rank == p - 1:
            got = float(loss.detach()) if isinstance(loss, torch.Tensor) else loss
            if not isinstance(got, float) or abs(got - reference_loss) > 1e-5:
                raise ExerciseFailed(f"rank {rank} (last stage): loss expected {reference_loss:.6g}, got {got!r}")
        for i, (param, want) in enumerate(zip(mine.parameters(), expected[rank])):
            if param.grad is None or not torch.allclose(param.grad, want, atol=1e-6, rtol=1e-4):
                state = "no gradient" if param.grad is None else "a gradient that differs from single-process"
                raise ExerciseFailed(f"rank {rank}: stage {rank}'s parameter {i} has {state} (batch {batch})")
        dist.barrier(in_step)
