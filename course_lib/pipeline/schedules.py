"""Schedules on paper: each rank's ordered Action(kind, microbatch, stage)s; zero-bubble splits backward into B, W."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

SCHEDULES = ("GPipe", "1F1B", "interleaved 1F1B")
ZERO_BUBBLE = "ZB-H1"  # schedule_actions knows it too; kept out of SCHEDULES, the lesson's first three


class Action(NamedTuple):
    kind: str  # "F" forward, "B" backward ("W": weight gradient, when the backward is split)
    microbatch: int
    stage: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}@{self.stage}"


class Overlapped(NamedTuple):
    """DualPipe's F&B pair as one unit: both results leave at its end, as torch's OVERLAP_F_B sends after the pair."""

    forward: Action
    backward: Action

    def __repr__(self) -> str:
        return f"({self.forward!r}&{self.backward!r})"


Unit = Action | Overlapped  # what a rank runs as one: an action, or an overlapped pair


def actions_of(units: Sequence[Unit]) -> list[Action]:
    """The actions in `units`, an overlapped pair's forward before its backward."""
    return [a for unit in units for a in (unit if isinstance(unit, Overlapped) else (unit,))]


def gpipe_actions(stage: int, n_stages: int, n_microbatches: int) -> list[Action]:
    """GPipe: every forward, then every backward (all m activations are held at once)."""
    return [Action("F", mb, stage) for mb in range(n_microbatches)] + [
        Action("B", mb, stage) for mb in range(n_microbatches)
    ]


def _one_f_one_b_actions(stage: int, n_stages: int, n_microbatches: int) -> list[Action]:
    """1F1B: n_stages - 1 - s warm-up forwards bound live activations to n_stages - s (private: exercise 2's answer)."""
    warmup = min(n_stages - 1 - stage, n_microbatches)
    actions = [Action("F", mb, stage) for mb in range(warmup)]
    for mb in range(n_microbatches - warmup):  # steady state: F(next) then B(oldest)
        actions += [Action("F", warmup + mb, stage), Action("B", mb, stage)]
    actions += [Action("B", mb, stage) for mb in range(n_microbatches - warmup, n_microbatches)]
    return actions


def interleaved_actions(rank: int, n_ranks: int, n_virtual: int, n_microbatches: int) -> list[Action]:
    """Interleaved 1F1B (Megatron-LM): rank r holds r, r + p, ...; a longer warm-up, v times shorter fill and drain."""
    p, v, m = n_ranks, n_virtual, n_microbatches
    if m % p:
        raise ValueError(f"interleaved 1F1B here needs the micro-batches ({m}) to be a multiple of the ranks ({p})")

    def nth(k: int, kind: str) -> Action:
        chunk = (k // p) % v
        if kind == "B":
            chunk = v - 1 - chunk  # backwards visit the rank's stages last-first
        return Action(kind, (k // (p * v)) * p + k % p, rank + chunk * p)

    total = m * v
    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    actions = [nth(k, "F") for k in range(warmup)]
    for k in range(total - warmup):
        actions += [nth(warmup + k, "F"), nth(k, "B")]
    actions += [nth(k, "B") for k in range(total - warmup, total)]
    return actions


def zero_bubble_actions(stage: int, n_stages: int, n_microbatches: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2023): 1F1B with each backward split into B (input gradient) and W (weight gradient).

    Every B keeps its place in 1F1B's order: the previous stage waits for its result.
    W waits for nobody, so stage s postpones each one by s micro-batches and runs the
    last s at the end, in the drain where 1F1B's stage s sat idle. Activations are kept
    until W: every stage holds at most min(p, m), 1F1B's peak (on stage 0).
    """
    delay = min(stage, n_microbatches)
    actions = []
    for action in schedule_actions("1F1B", n_stages, n_microbatches)[stage]:
        actions.append(action)
        if action.kind == "B" and action.microbatch >= delay:
            actions.append(Action("W", action.microbatch - delay, stage))
    return actions + [Action("W", mb, stage) for mb in range(n_microbatches - delay, n_microbatches)]


def schedule_actions(name: str, n_ranks: int, n_microbatches: int, n_virtual: int = 2) -> dict[int, list[Action]]:
    """Every rank's action list for the schedule called `name` (one of SCHEDULES, or ZERO_BUBBLE)."""
    if name == "GPipe":
        return {r: gpipe_actions(r, n_ranks, n_microbatches) for r in range(n_ranks)}
    if name == "1F1B":
        return {r: _one_f_one_b_actions(r, n_ranks, n_microbatches) for r in range(n_ranks)}
    if name == "interleaved 1F1B":
        return {r: interleaved_actions(r, n_ranks, n_virtual, n_microbatches) for r in range(n_ranks)}
    if name == ZERO_BUBBLE:
        return {r: zero_bubble_actions(r, n_ranks, n_microbatches) for r in range(n_ranks)}
    raise ValueError(f"unknown schedule {name!r}; choose from {(*SCHEDULES, ZERO_BUBBLE)}")


def ideal_bubble(n_ranks: int, n_microbatches: int, n_virtual: int = 1) -> float:
    """Idle fraction of a pipeline step: (p - 1) / (v m + p - 1), with v = 1 for GPipe and 1F1B."""
    return (n_ranks - 1) / (n_virtual * n_microbatches + n_ranks - 1)


def zero_bubble_ideal(n_ranks: int, n_microbatches: int, n_virtual: int = 1) -> float:
    """ZB-H1's idle fraction with t_F = t_B = t_W (Qi et al.): (p - 1) / (3vm + p - 1), for m >= p."""
    p, m = n_ranks, n_microbatches
    if m < p:
        raise ValueError(f"ZB-H1's formula needs m >= p (here m={m}, p={p}): with fewer there is no steady state")
    return (p - 1) / (3 * n_virtual * m + p - 1)


def dualpipev_bubble(
    n_ranks: int, n_microbatches: int, t_forward: float = 1.0, t_backward: float = 2.0, t_weight: float = 1.0
) -> float:
    """DualPipeV's idle fraction by DeepSeek's formula (DualPipe README), from a rank's share of F, B and W times."""
    p, m = n_ranks, n_microbatches
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs m >= 2p, its number of stages (here m={m}, p={p})")
    forward, backward, weight = t_forward / 2, t_backward / 2, t_weight / 2  # one stage is half a rank's share
    idle = (p - 1) * ((forward + backward) + backward - 3 * weight)
    return idle / (m * (t_forward + t_backward) + idle)


def stages_per_rank(schedule: str) -> int:
    """v: one stage per rank for GPipe, 1F1B and ZB-H1; two for the interleaved and torch's two-stage schedules."""
    return 1 if schedule in ("GPipe", "1F1B", ZERO_BUBBLE) else 2


def published_bubble(schedule: str, n_ranks: int, n_microbatches: int) -> float:
    """The papers' bubble at t_F = t_B = t_W: Narayanan's, DeepSeek's (DualPipeV) or Qi et al.'s (zero bubble)."""
    p, m, v = n_ranks, n_microbatches, stages_per_rank(schedule)
    if schedule in (*SCHEDULES, "ScheduleLoopedBFS"):
        return ideal_bubble(p, m, v)
    if schedule == "ScheduleDualPipeV":
        return dualpipev_bubble(p, m)
    return zero_bubble_ideal(p, m, v)


def validate(actions: dict[int, list[Action]], n_stages: int, n_microbatches: int) -> None:
    """Every forward and backward (and W, if any) of every (stage, micro-batch) exactly once, on its stage's rank."""
    n_ranks = len(actions)
    kinds = "FBW" if any(a.kind == "W" for todo in actions.values() for a in todo) else "FB"
    seen: dict[Action, int] = {}
    for rank, todo in actions.items():
        for a in todo:
            if a.kind not in kinds or not 0 <= a.microbatch < n_microbatches or not 0 <= a.stage < n_stages:
                raise ValueError(f"rank {rank}: {a!r} is not an action of this pipeline")
            if a.stage % n_ranks != rank:
                raise ValueError(f"rank {rank}: {a!r} belongs to stage {a.stage}, held by rank {a.stage % n_ranks}")
            if a in seen:
                raise ValueError(f"rank {rank}: {a!r} appears twice")
            seen[a] = rank
    for stage in range(n_stages):
        for mb in range(n_microbatches):
            for kind in kinds:
                if Action(kind, mb, stage) not in seen:
                    raise ValueError(f"rank {stage % n_ranks}: {Action(kind, mb, stage)!r} is missing")


def _held_changes(units: Sequence[Unit]) -> list[tuple[int, int]]:
    """(stage, +1/-1/0) per action: activations live from F to B, or to W when split; an F&B's forward holds first."""
    actions = actions_of(units)
    deferred = {(a.stage, a.microbatch) for a in actions if a.kind == "W"}
    release = {a: "W" if (a.stage, a.microbatch) in deferred else "B" for a in actions}
    return [(a.stage, 1 if a.kind == "F" else -1 if a.kind == release[a] else 0) for a in actions]


def peak_in_flight(units: Sequence[Unit]) -> dict[int, int]:
    """Each stage's own peak of live micro-batches; summing them over-counts a rank (see :func:`simultaneous_peak`)."""
    held: dict[int, int] = {}
    peak: dict[int, int] = {}
    for stage, change in _held_changes(units):
        held[stage] = held.get(stage, 0) + change
        peak[stage] = max(peak.get(stage, 0), held[stage])
    return peak


def simultaneous_peak(units: Sequence[Unit]) -> int:
    """A rank's peak of live (stage, micro-batch) activations, as papers count memory; divide by v for stage units."""
    held, peak = 0, 0
    for _, change in _held_changes(units):
        held += change
        peak = max(peak, held)
    return peak
