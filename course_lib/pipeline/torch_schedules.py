"""torch.distributed.pipelining's newer schedules (two stages per rank) on the course's model, and their orders.

Each torch schedule computes, on every rank, the action list of every rank (``pipeline_order``).
:func:`course_actions` turns it into the course's actions, so the course's :func:`simulate`,
:func:`bubble_fraction` and :func:`peak_in_flight` judge torch's schedules exactly as ours.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib.launch.runtime import fake_rank
from course_lib.pipeline.schedules import Action
from course_lib.pipeline.stages import course_model, split_into_stages
from course_lib.pipeline.train import build_schedule, run_torch_step

TORCH_SCHEDULES = ("ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")  # the model goes down the ranks and back up


def stages_of_rank(schedule: str, rank: int, n_ranks: int) -> list[int]:
    """The two stages rank `rank` holds: looped (r and r + p) or, for V-shaped schedules, r and 2p - 1 - r."""
    return [rank, 2 * n_ranks - 1 - rank] if schedule in V_SHAPED else [rank, rank + n_ranks]


def course_actions(pipeline_order: Mapping[int, Sequence[Any]]) -> dict[int, list[Action]]:
    """torch's compute actions as the course's: F is F, I (input gradient) is B, W is W, a full backward B.

    DualPipeV's overlapped F+B pair becomes its two actions, one after the other (the
    overlap hides communication, not compute); idle slots (None) are dropped.
    """

    def expand(a: Any) -> Iterator[Action]:
        kind = a.computation_type.value
        if a.sub_actions:
            for sub in a.sub_actions:
                yield from expand(sub)
        elif kind in ("F", "W"):
            yield Action(kind, a.microbatch_index, a.stage_index)
        elif kind in ("I", "B"):  # a B without a W of its own is a full backward (simulate, execute)
            yield Action("B", a.microbatch_index, a.stage_index)

    return {rank: [c for a in order if a is not None for c in expand(a)] for rank, order in pipeline_order.items()}


def torch_schedule_order(schedule: str, n_ranks: int, n_microbatches: int) -> dict[int, list[Action]]:
    """Every rank's actions in torch's `schedule` for p = n_ranks, without ranks: built once in a fake world."""
    parts = split_into_stages(course_model(), 2 * n_ranks)
    modules = {s: parts[s] for s in stages_of_rank(schedule, 0, n_ranks)}
    with fake_rank(0, n_ranks):  # every rank computes every rank's list: rank 0's copy will do
        built = build_schedule(schedule, modules, 2 * n_ranks, n_microbatches, torch.device("cpu"))
    return course_actions(built.pipeline_order)


def torch_schedule_step(
    schedule: str,
    n_microbatches: int,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    model: nn.Sequential | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[list[float], dict[int, nn.Sequential], dict[int, list[Action]]]:
    """One step of torch's `schedule` on this rank: (losses on the rank holding the last stage, its stage modules,
    every rank's actions as the course's)."""
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    parts = split_into_stages(model if model is not None else course_model(), 2 * p)
    modules = {s: parts[s] for s in stages_of_rank(schedule, rank, p)}
    device = next(parts[0].parameters()).device
    runner = build_schedule(schedule, modules, 2 * p, n_microbatches, device, group)
    return run_torch_step(runner, modules, 2 * p, x, y), modules, course_actions(runner.pipeline_order)
