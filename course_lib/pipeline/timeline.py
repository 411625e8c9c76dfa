"""Timelines of a schedule: the ideal one simulated without running anything (or its deadlock), and the bubble."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from course_lib.pipeline.schedules import Action, Overlapped, Unit, actions_of


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
    actions: Mapping[int, Sequence[Unit]],
    n_stages: int | None = None,
    *,
    t_forward: float = 1.0,
    t_backward: float = 2.0,
    t_weight: float = 1.0,
    latency: float = 0.0,
) -> list[Event]:
    """Ideal timeline; times are a rank's share (1/v per stage action); raises :class:`Deadlock` instead of hanging."""
    n_ranks = len(actions)
    n_stages = n_stages or n_ranks
    per_rank = n_stages // n_ranks
    deferred = {(a.stage, a.microbatch) for todo in actions.values() for a in actions_of(todo) if a.kind == "W"}

    def duration(a: Action) -> float:  # a B whose W runs separately computes only the input gradient
        split = a.kind == "B" and (a.stage, a.microbatch) in deferred
        return {"F": t_forward, "B": t_backward - t_weight if split else t_backward, "W": t_weight}[a.kind] / per_rank

    def parts(unit: Unit) -> tuple[Action, ...]:
        return tuple(unit) if isinstance(unit, Overlapped) else (unit,)

    def missing(unit: Unit) -> Action | None:  # the first input of `unit` not computed yet
        needs = (_dependency(a, n_stages) for a in parts(unit))
        return next((need for need in needs if need is not None and need not in done), None)

    done: dict[Action, tuple[float, int]] = {}  # action -> (end time, rank that ran it)
    position = {r: 0 for r in actions}
    free_at = {r: 0.0 for r in actions}
    events: list[Event] = []
    progress = True
    while progress:
        progress = False
        for rank, todo in actions.items():
            while position[rank] < len(todo) and missing(todo[position[rank]]) is None:
                unit = todo[position[rank]]
                needs = [need for a in parts(unit) if (need := _dependency(a, n_stages)) is not None]
                ready = [done[n][0] + (latency if done[n][1] != rank else 0.0) for n in needs]
                end = max([free_at[rank], *ready])
                for a in parts(unit):
                    events.append(Event(rank, a, end, end + duration(a)))
                    end += duration(a)
                for a in parts(unit):  # an overlapped pair's results leave together, at its end
                    done[a] = (end, rank)
                free_at[rank] = end
                position[rank] += 1
                progress = True
    stuck = {r: todo[position[r]] for r, todo in actions.items() if position[r] < len(todo)}
    if stuck:
        waiting = {r: (parts(unit)[0], missing(unit)) for r, unit in sorted(stuck.items())}
        text = [f"rank {r} waits at {unit!r} for {missing(unit)!r}" for r, unit in sorted(stuck.items())]
        raise Deadlock("deadlock: " + "; ".join(text), waiting)
    return sorted(events, key=lambda e: (e.rank, e.start))


def bubble_fraction(events: Sequence[Event], n_ranks: int) -> float:
    """Share of the ranks' time spent idle between the first start and the last end of the step."""
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1.0 - busy / (n_ranks * span)
