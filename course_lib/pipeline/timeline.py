"""Timelines of a schedule: the ideal one simulated without running anything (or its deadlock), and the bubble."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from course_lib.pipeline.schedules import Action


class Event(NamedTuple):
    """One action of one rank, from its start to its end (simulated units or seconds)."""

    rank: int
    action: Action
    start: float
    end: float


class Deadlock(RuntimeError):
    """No rank can take its next action: each waits for one that will never run."""

    def __init__(self, message: str, waiting: dict[int, tuple[Action, Action | None]]):
        super().__init__(message)
        self.waiting = waiting  # rank -> (its next action, the action it waits for)


def _dependency(action: Action, n_stages: int) -> Action | None:
    """The action whose result `action` needs (its input activation or output gradient)."""
    if action.kind == "W":
        return Action("B", action.microbatch, action.stage)  # the gradients B left at the layers' outputs
    if action.kind == "F":
        return Action("F", action.microbatch, action.stage - 1) if action.stage > 0 else None
    if action.stage == n_stages - 1:
        return Action("F", action.microbatch, action.stage)  # the loss's own forward
    return Action("B", action.microbatch, action.stage + 1)


def simulate(
    actions: dict[int, list[Action]],
    n_stages: int | None = None,
    *,
    t_forward: float = 1.0,
    t_backward: float = 2.0,
    t_weight: float = 1.0,
    latency: float = 0.0,
) -> list[Event]:
    """Ideal timeline: each rank runs its list in order, as soon as the data an action needs exists.

    `t_forward` / `t_backward` are the times of a whole rank's share of the model;
    with v stages per rank each action takes 1/v of it. A backward split in two (a B
    whose W is a separate action) gives `t_weight` to W and the rest to B (the defaults
    give t_F = t_B = t_W = 1, as in the zero-bubble paper's analysis). Raises :class:`Deadlock`
    (naming the waiting ranks) instead of hanging when the lists cannot finish.
    """
    n_ranks = len(actions)
    n_stages = n_stages or n_ranks
    per_rank = n_stages // n_ranks
    deferred = {(a.stage, a.microbatch) for todo in actions.values() for a in todo if a.kind == "W"}

    def duration(a: Action) -> float:  # a B whose W runs separately computes only the input gradient
        split = a.kind == "B" and (a.stage, a.microbatch) in deferred
        return {"F": t_forward, "B": t_backward - t_weight if split else t_backward, "W": t_weight}[a.kind] / per_rank

    done: dict[Action, float] = {}  # action -> end time
    position = {r: 0 for r in actions}
    free_at = {r: 0.0 for r in actions}
    events: list[Event] = []
    progress = True
    while progress:
        progress = False
        for rank, todo in actions.items():
            while position[rank] < len(todo):
                action = todo[position[rank]]
                need = _dependency(action, n_stages)
                if need is not None and need not in done:
                    break
                ready = 0.0 if need is None else done[need] + (latency if need.stage % n_ranks != rank else 0.0)
                start = max(free_at[rank], ready)
                free_at[rank] = done[action] = start + duration(action)
                events.append(Event(rank, action, start, free_at[rank]))
                position[rank] += 1
                progress = True
    stuck = {
        r: (todo[position[r]], _dependency(todo[position[r]], n_stages))
        for r, todo in actions.items()
        if position[r] < len(todo)
    }
    if stuck:
        parts = [f"rank {r} waits at {a!r} for {need!r}" for r, (a, need) in sorted(stuck.items())]
        raise Deadlock("deadlock: " + "; ".join(parts), stuck)
    return sorted(events, key=lambda e: (e.rank, e.start))


def bubble_fraction(events: Sequence[Event], n_ranks: int) -> float:
    """Share of the ranks' time spent idle between the first start and the last end of the step."""
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1.0 - busy / (n_ranks * span)
