"""One training step of notebook 08: from scratch and with torch.distributed.pipelining, and its reference.

The reference is single-process training on the whole batch; gradients are compared stage by stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib.compare import grad_of, max_difference
from course_lib.pipeline.execution import RunRecord, execute
from course_lib.pipeline.schedules import schedule_actions
from course_lib.pipeline.stages import course_model, local_stages, split_into_stages


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error: the loss of every pipeline step here."""
    return nn.functional.mse_loss(output, target)


def stage_gradients(modules: Mapping[int, nn.Module]) -> dict[int, list[torch.Tensor]]:
    """{stage: copies of its module's parameter gradients, in parameter order}."""
    return {s: [grad_of(p).detach().clone() for p in module.parameters()] for s, module in modules.items()}


def reference_stage_gradients(
    model: nn.Sequential, n_stages: int, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, dict[int, list[torch.Tensor]]]:
    """Single-process step on the whole batch: (loss, the gradients grouped by the stage that owns each parameter)."""
    model.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.item(), stage_gradients(dict(enumerate(split_into_stages(model, n_stages))))


def max_gradient_error(modules: Mapping[int, nn.Module], expected: Mapping[int, Sequence[torch.Tensor]]) -> float:
    """Largest |difference| between the stage modules' gradients and `expected` ({stage: gradients})."""
    got = stage_gradients(modules)
    return max_difference([g for s in got for g in got[s]], [g for s in got for g in expected[s]])


def pipeline_step(
    schedule: str,
    n_microbatches: int,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    model: nn.Sequential | None = None,
    stage_ranks: Sequence[int] | None = None,
    n_virtual: int = 2,
    min_seconds: dict[str, float] | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[RunRecord, dict[int, nn.Sequential]]:
    """One from-scratch training step of `schedule` on this rank: (its record, its stage modules).

    Ranks not in `stage_ranks` (default: all) must not call it. `min_seconds` is
    the time of a rank's whole share of the model; a virtual stage takes 1/v of it.
    """
    stage_ranks = list(stage_ranks) if stage_ranks is not None else list(range(dist.get_world_size()))
    p, rank = len(stage_ranks), stage_ranks.index(dist.get_rank())
    v = n_virtual if schedule == "interleaved 1F1B" else 1
    modules = local_stages(model if model is not None else course_model(), rank, p, v)
    actions = schedule_actions(schedule, p, n_microbatches, n_virtual)[rank]
    if x.shape[0] % n_microbatches:
        raise ValueError(f"a batch of {x.shape[0]} does not split into {n_microbatches} equal micro-batches")
    xs, ys = list(x.chunk(n_microbatches)), list(y.chunk(n_microbatches))
    if min_seconds:
        min_seconds = {kind: seconds / v for kind, seconds in min_seconds.items()}
    first_linear = next(m for m in next(iter(modules.values())) if isinstance(m, nn.Linear))
    shape = (xs[0].shape[0], first_linear.in_features)  # every activation between stages
    record = execute(
        actions, modules, p * v, xs, ys, loss_fn, shape, stage_ranks=stage_ranks, min_seconds=min_seconds, group=group
    )
    return record, modules


TORCH_NAMES = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B", "interleaved 1F1B": "ScheduleInterleaved1F1B"}


def build_schedule(
    schedule: str,
    modules: Mapping[int, nn.Module],
    n_stages: int,
    n_microbatches: int,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> Any:
    """torch's schedule class called `schedule` (e.g. "Schedule1F1B") over this rank's {stage: module}."""
    from torch.distributed.pipelining import PipelineStage, schedules

    stages = [PipelineStage(module, s, n_stages, device, group=group) for s, module in sorted(modules.items())]
    kind = getattr(schedules, schedule)
    one_stage_per_rank = issubclass(kind, schedules.PipelineScheduleSingle)
    return kind(stages[0] if one_stage_per_rank else stages, n_microbatches=n_microbatches, loss_fn=loss_fn)


def run_torch_step(
    runner: Any, modules: Mapping[int, nn.Module], n_stages: int, x: torch.Tensor, y: torch.Tensor
) -> list[float]:
    """One step of a torch schedule on this rank: the batch goes in where stage 0 lives, the targets where the last
    stage lives, which also gets the micro-batch losses back (the others get [])."""
    losses: list[torch.Tensor] = []
    holds_last = n_stages - 1 in modules
    args = (x,) if 0 in modules else ()
    runner.step(*args, target=y if holds_last else None, losses=losses if holds_last else None)
    return [float(loss.detach()) for loss in losses]


def torch_pipeline_step(
    schedule: str,
    n_microbatches: int,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    model: nn.Sequential | None = None,
    group: dist.ProcessGroup | None = None,
    n_virtual: int = 2,
) -> tuple[list[float], dict[int, nn.Sequential]]:
    """The same step with torch.distributed.pipelining: (micro-batch losses on the last rank, stage modules)."""
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    v = n_virtual if schedule == "interleaved 1F1B" else 1
    modules = local_stages(model if model is not None else course_model(), rank, p, v)
    device = next(next(iter(modules.values())).parameters()).device
    runner = build_schedule(TORCH_NAMES[schedule], modules, p * v, n_microbatches, device, group)
    return run_torch_step(runner, modules, p * v, x, y), modules
