"""Notebook 09's lab: a step (ours, torch's) against one process; torch's schedules as actions; Gantt, explorer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib.compare import grad_of, max_difference
from course_lib.launch.runtime import fake_rank
from course_lib.pipeline.execution import RunRecord, execute
from course_lib.pipeline.schedules import Action, Overlapped, Unit, schedule_actions, simultaneous_peak
from course_lib.pipeline.stages import course_model, local_stages, split_into_stages
from course_lib.pipeline.timeline import Event, bubble_fraction, simulate

# One training step of notebook 09: from scratch and with torch.distributed.pipelining, and its reference.
#
# The reference is single-process training on the whole batch; gradients are compared stage by stage.


def mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error: the loss of every pipeline step here."""
    return nn.functional.mse_loss(output, target)


def gradients_by_stage(modules: Mapping[int, nn.Module]) -> dict[int, list[torch.Tensor]]:
    """{stage: copies of its module's parameter gradients, in parameter order}."""
    return {s: [grad_of(p).detach().clone() for p in module.parameters()] for s, module in modules.items()}


def reference_stage_gradients(
    model: nn.Sequential, n_stages: int, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, dict[int, list[torch.Tensor]]]:
    """Single-process step on the whole batch: (loss, the gradients grouped by the stage that owns each parameter)."""
    model.zero_grad()
    loss = mse_loss(model(x), y)
    loss.backward()
    return loss.item(), gradients_by_stage(dict(enumerate(split_into_stages(model, n_stages))))


def max_gradient_error(modules: Mapping[int, nn.Module], expected: Mapping[int, Sequence[torch.Tensor]]) -> float:
    """Largest |difference| between the stage modules' gradients and `expected` ({stage: gradients})."""
    got = gradients_by_stage(modules)
    return max_difference([g for s in got for g in got[s]], [g for s in got for g in expected[s]])


def schedule_step(
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
    """One from-scratch training step of `schedule` on this rank of `stage_ranks` (default all): (record, stages)."""
    stage_ranks = list(stage_ranks) if stage_ranks is not None else list(range(dist.get_world_size()))
    p, rank = len(stage_ranks), stage_ranks.index(dist.get_rank())
    v = n_virtual if schedule == "interleaved 1F1B" else 1
    modules = local_stages(model if model is not None else course_model(), rank, p, v)
    actions = schedule_actions(schedule, p, n_microbatches, n_virtual)[rank]
    if x.shape[0] % n_microbatches:
        raise ValueError(f"a batch of {x.shape[0]} does not split into {n_microbatches} equal micro-batches")
    xs, ys = list(x.chunk(n_microbatches)), list(y.chunk(n_microbatches))
    if min_seconds:  # given for a rank's whole share of the model: a virtual stage takes 1/v of it
        min_seconds = {kind: seconds / v for kind, seconds in min_seconds.items()}
    first_linear = next(m for m in next(iter(modules.values())) if isinstance(m, nn.Linear))
    shape = (xs[0].shape[0], first_linear.in_features)  # every activation between stages
    record = execute(
        actions, modules, p * v, xs, ys, mse_loss, shape, stage_ranks=stage_ranks, min_seconds=min_seconds, group=group
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
    return kind(stages[0] if one_stage_per_rank else stages, n_microbatches=n_microbatches, loss_fn=mse_loss)


def run_torch_step(
    runner: Any, modules: Mapping[int, nn.Module], n_stages: int, x: torch.Tensor, y: torch.Tensor
) -> list[float]:
    """One torch schedule step: inputs where stage 0 lives, targets and losses where the last lives ([] elsewhere)."""
    losses: list[torch.Tensor] = []
    holds_last = n_stages - 1 in modules
    args = (x,) if 0 in modules else ()
    runner.step(*args, target=y if holds_last else None, losses=losses if holds_last else None)
    return [float(loss.detach()) for loss in losses]


# Each torch schedule computes, on every rank, the action list of every rank (``pipeline_order``).
# :func:`course_actions` turns it into the course's actions, so the course's :func:`simulate`,
# :func:`bubble_fraction` and :func:`simultaneous_peak` judge torch's schedules exactly as ours.

TORCH_SCHEDULES = ("ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")


V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")  # the model goes down the ranks and back up


def stages_of_rank(schedule: str, rank: int, n_ranks: int) -> list[int]:
    """Stages a rank holds in torch's `schedule`: r (GPipe, 1F1B), r and r + p (looped) or r and 2p - 1 - r (V)."""
    if schedule in ("ScheduleGPipe", "Schedule1F1B"):
        return [rank]
    return [rank, 2 * n_ranks - 1 - rank] if schedule in V_SHAPED else [rank, rank + n_ranks]


def course_actions(pipeline_order: Mapping[int, Sequence[Any]]) -> dict[int, list[Unit]]:
    """torch's compute actions as the course's (I is B); DualPipeV's F&B stays one unit, torch sends after both."""

    def convert(a: Any) -> Action:  # a B without a W of its own is a full backward (simulate, execute)
        kind = a.computation_type.value
        return Action("B" if kind == "I" else kind, a.microbatch_index, a.stage_index)

    def is_compute(a: Any) -> bool:
        return a is not None and (bool(a.sub_actions) or a.computation_type.value in ("F", "I", "B", "W"))

    def unit(a: Any) -> Unit:
        return Overlapped(*map(convert, a.sub_actions)) if a.sub_actions else convert(a)

    return {rank: [unit(a) for a in order if is_compute(a)] for rank, order in pipeline_order.items()}


def torch_schedule_order(schedule: str, n_ranks: int, n_microbatches: int) -> dict[int, list[Unit]]:
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
) -> tuple[list[float], dict[int, nn.Sequential], dict[int, list[Unit]]]:
    """One step of torch's `schedule`: losses (last stage's rank), this rank's stage modules, every rank's actions."""
    schedule = TORCH_NAMES.get(schedule, schedule)
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    n_stages = p * len(stages_of_rank(schedule, rank, p))
    parts = split_into_stages(model if model is not None else course_model(), n_stages)
    modules = {s: parts[s] for s in stages_of_rank(schedule, rank, p)}
    device = next(parts[0].parameters()).device
    runner = build_schedule(schedule, modules, n_stages, n_microbatches, device, group)
    return run_torch_step(runner, modules, n_stages, x, y), modules, course_actions(runner.pipeline_order)


# Plots of schedules (kernel-only): a Gantt chart of a timeline, simulated or measured; the schedule explorer.


def plot_timeline(ax: Any, events: Sequence[Event], n_ranks: int, title: str = "") -> None:
    """Gantt chart: one row per rank, forwards blue, backwards orange, weight gradients (W) green, by micro-batch."""
    import matplotlib.pyplot as plt

    t0 = min(e.start for e in events)
    scale = max(e.end for e in events) - t0
    for e in events:
        chunk = e.action.stage // n_ranks  # virtual stage index on its rank (0 unless interleaved)
        color = plt.cm.tab20({"F": 0, "B": 2, "W": 4}[e.action.kind] + chunk)
        ax.barh(e.rank, e.end - e.start, left=e.start - t0, height=0.8, color=color, edgecolor="white", linewidth=0.5)
        if (e.end - e.start) / scale > 0.018:
            ax.text((e.start + e.end) / 2 - t0, e.rank, str(e.action.microbatch), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)])
    ax.set_ylim(n_ranks - 0.5, -0.5)
    ax.set_title(title, fontsize=9)


def draw_schedule(
    schedule: str, stages: int, microbatches: int, measured: dict[tuple[str, int, int], list[Event]] | None = None
) -> None:
    """Ideal timeline of `schedule` (t_f = 10, t_b = 20, t_w = 10 ms) and its bubble, beside the measured one if any."""
    import matplotlib.pyplot as plt

    v = 2 if schedule == "interleaved 1F1B" else 1
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.8 + 0.45 * stages), sharey=True)
    try:
        actions = schedule_actions(schedule, stages, microbatches)
        ideal = simulate(actions, stages * v, t_forward=10, t_backward=20, t_weight=10)
        held = simultaneous_peak(actions[0]) / v
        title = f"ideal: bubble {bubble_fraction(ideal, stages):.3f}, rank 0 holds {held:g} micro-batches"
        plot_timeline(axes[0], ideal, stages, title)
    except ValueError as error:
        axes[0].set_title(str(error), fontsize=8)
    events = (measured or {}).get((schedule, stages, microbatches))
    if events:
        in_ms = [e._replace(start=e.start * 1e3, end=e.end * 1e3) for e in events]
        plot_timeline(axes[1], in_ms, stages, f"measured: bubble {bubble_fraction(in_ms, stages):.3f}")
    else:
        axes[1].set_title("not measured in section 4", fontsize=8)
    axes[0].set_xlabel("ms")
    axes[1].set_xlabel("ms")
    plt.tight_layout()
    plt.show()


def draw_v_placement(n_ranks: int = 4, n_microbatches: int = 8) -> None:
    """torch's two-stages-per-rank zero-bubble schedules, looped against V placement, micro-batch 0's forward traced."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 1.4 + 0.9 * n_ranks), sharex=True)
    for ax, name in zip(axes, ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")):
        events = simulate(torch_schedule_order(name, n_ranks, n_microbatches), 2 * n_ranks)
        title = f"{name}: bubble {bubble_fraction(events, n_ranks):.3f}; lighter: a rank's second stage"
        plot_timeline(ax, events, n_ranks, title)
        path = sorted((e.action.stage, (e.start + e.end) / 2, e.rank) for e in events if e.action[:2] == ("F", 0))
        ax.plot([t for _, t, _ in path], [r for _, _, r in path], "k.-", lw=1)
        held = [stages_of_rank(name, r, n_ranks) for r in range(n_ranks)]
        ax.set_yticks(range(n_ranks), [f"rank {r}: stages {a}, {b}" for r, (a, b) in enumerate(held)])
    axes[-1].set_xlabel("time (units of t_F)")
    plt.tight_layout()
    plt.show()
