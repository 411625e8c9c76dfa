"""Notebook 07: pipeline parallelism from scratch.

A model is cut into *stages*, one per rank (or several per rank, "virtual stages",
for the interleaved schedule). A batch is cut into *micro-batches*. A *schedule*
is, for every rank, an explicit list of actions ``Action("F" or "B", microbatch,
stage)``; :func:`execute` runs such a list with point-to-point send/recv, and
:func:`simulate` computes its ideal timeline (or finds its deadlock) without
running anything.

Everything here is plain torch.distributed: activations travel forward with
``isend`` and their gradients travel back the same way; a rank only ever blocks
in ``recv``, waiting for data that some earlier action of another rank produces.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from course_lib.compare import grad_of
from course_lib.exercises import ExerciseFailed
from course_lib.models import MLP

SCHEDULES = ("GPipe", "1F1B", "interleaved 1F1B")


# ---- the model, cut into stages ----------------------------------------------


def course_model(n_units: int = 16, width: int = 64, seed: int = 0) -> MLP:
    """The shared MLP with `n_units` pieces to distribute: n_units - 1 Linear+GELU blocks and the head.

    16 pieces: enough for two virtual stages on each of up to 8 ranks (interleaved 1F1B).
    """
    return MLP(d_in=width, d_hidden=width, d_out=8, n_layers=n_units - 1, seed=seed)


def split_into_stages(model: nn.Sequential, n_stages: int) -> list[nn.Sequential]:
    """Cut an MLP into `n_stages` consecutive pieces with as equal a number of Linear layers as possible.

    A piece starts at a Linear and keeps the activation that follows it, so
    stage k's output is exactly what stage k+1's first Linear consumes.
    """
    units: list[list[nn.Module]] = []
    for module in model:
        if isinstance(module, nn.Linear) or not units:
            units.append([])
        units[-1].append(module)
    if n_stages > len(units):
        raise ValueError(f"cannot cut {len(units)} Linear layers into {n_stages} stages")
    per_stage, extra = divmod(len(units), n_stages)
    stages, start = [], 0
    for k in range(n_stages):
        stop = start + per_stage + (1 if k < extra else 0)
        stages.append(nn.Sequential(*[m for unit in units[start:stop] for m in unit]))
        start = stop
    return stages


def stage_boundaries(model: nn.Sequential, n_stages: int) -> list[int]:
    """Index in `model` of the first module of each stage of :func:`split_into_stages` (for torch's split_spec)."""
    starts, i = [], 0
    for stage in split_into_stages(model, n_stages):
        starts.append(i)
        i += len(stage)
    return starts


# ---- schedules: who does what, in which order --------------------------------


class Action(NamedTuple):
    kind: str  # "F" forward or "B" backward
    microbatch: int
    stage: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}@{self.stage}"


def gpipe_actions(stage: int, n_stages: int, n_microbatches: int) -> list[Action]:
    """GPipe: every forward, then every backward (all m activations are held at once)."""
    return [Action("F", mb, stage) for mb in range(n_microbatches)] + [
        Action("B", mb, stage) for mb in range(n_microbatches)
    ]


def one_f_one_b_actions(stage: int, n_stages: int, n_microbatches: int) -> list[Action]:
    """1F1B: a warm-up of forwards, then alternate one forward and one backward, then drain.

    Stage s runs n_stages - 1 - s warm-up forwards: just enough that the first
    gradient arrives as its warm-up ends, so at most n_stages - s activations
    are ever in flight instead of m.
    """
    warmup = min(n_stages - 1 - stage, n_microbatches)
    actions = [Action("F", mb, stage) for mb in range(warmup)]
    for mb in range(n_microbatches - warmup):  # steady state: F(next) then B(oldest)
        actions += [Action("F", warmup + mb, stage), Action("B", mb, stage)]
    actions += [Action("B", mb, stage) for mb in range(n_microbatches - warmup, n_microbatches)]
    return actions


def interleaved_actions(rank: int, n_ranks: int, n_virtual: int, n_microbatches: int) -> list[Action]:
    """Interleaved 1F1B (Megatron-LM): rank r holds stages r, r + p, r + 2p, ... (`n_virtual` of them).

    Forwards go through the rank's stages p micro-batches at a time; the warm-up
    is longer, (p - r - 1) * 2 + (v - 1) * p forwards, then 1F1B. Each stage
    is 1/v of the work, so the fill and drain of the pipeline are v times shorter.
    """
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


def schedule_actions(name: str, n_ranks: int, n_microbatches: int, n_virtual: int = 2) -> dict[int, list[Action]]:
    """Every rank's action list for the schedule called `name` (one of SCHEDULES)."""
    if name == "GPipe":
        return {r: gpipe_actions(r, n_ranks, n_microbatches) for r in range(n_ranks)}
    if name == "1F1B":
        return {r: one_f_one_b_actions(r, n_ranks, n_microbatches) for r in range(n_ranks)}
    if name == "interleaved 1F1B":
        return {r: interleaved_actions(r, n_ranks, n_virtual, n_microbatches) for r in range(n_ranks)}
    raise ValueError(f"unknown schedule {name!r}; choose from {SCHEDULES}")


def ideal_bubble(n_ranks: int, n_microbatches: int, n_virtual: int = 1) -> float:
    """Idle fraction of a pipeline step: (p - 1) / (v m + p - 1), with v = 1 for GPipe and 1F1B."""
    return (n_ranks - 1) / (n_virtual * n_microbatches + n_ranks - 1)


# ---- timelines: simulated and measured ----------------------------------------


class Event(NamedTuple):
    rank: int
    action: Action
    start: float
    end: float


class Deadlock(RuntimeError):
    """No rank can take its next action: each waits for one that will never run."""

    def __init__(self, message: str, waiting: dict[int, tuple[Action, Action | None]]):
        super().__init__(message)
        self.waiting = waiting  # rank -> (its next action, the action it waits for)


def validate(actions: dict[int, list[Action]], n_stages: int, n_microbatches: int) -> None:
    """Every forward and backward of every (stage, micro-batch) exactly once, on the rank holding the stage."""
    n_ranks = len(actions)
    seen: dict[Action, int] = {}
    for rank, todo in actions.items():
        for a in todo:
            if a.kind not in ("F", "B") or not 0 <= a.microbatch < n_microbatches or not 0 <= a.stage < n_stages:
                raise ValueError(f"rank {rank}: {a!r} is not an action of this pipeline")
            if a.stage % n_ranks != rank:
                raise ValueError(f"rank {rank}: {a!r} belongs to stage {a.stage}, held by rank {a.stage % n_ranks}")
            if a in seen:
                raise ValueError(f"rank {rank}: {a!r} appears twice")
            seen[a] = rank
    for stage in range(n_stages):
        for mb in range(n_microbatches):
            for kind in "FB":
                if Action(kind, mb, stage) not in seen:
                    raise ValueError(f"rank {stage % n_ranks}: {Action(kind, mb, stage)!r} is missing")


def _dependency(action: Action, n_stages: int) -> Action | None:
    """The action whose result `action` needs (its input activation or output gradient)."""
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
    latency: float = 0.0,
) -> list[Event]:
    """Ideal timeline: each rank runs its list in order, as soon as the data an action needs exists.

    `t_forward` / `t_backward` are the times of a whole rank's share of the model;
    with v stages per rank each action takes 1/v of it. Raises :class:`Deadlock`
    (naming the waiting ranks) instead of hanging when the lists cannot finish.
    """
    n_ranks = len(actions)
    n_stages = n_stages or n_ranks
    per_rank = n_stages // n_ranks
    duration = {"F": t_forward / per_rank, "B": t_backward / per_rank}
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
                free_at[rank] = done[action] = start + duration[action.kind]
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


def peak_in_flight(actions: Sequence[Action]) -> dict[int, int]:
    """Per stage, the most micro-batches whose forward ran and whose backward has not (activations kept)."""
    held: dict[int, int] = {}
    peak: dict[int, int] = {}
    for a in actions:
        held[a.stage] = held.get(a.stage, 0) + (1 if a.kind == "F" else -1)
        peak[a.stage] = max(peak.get(a.stage, 0), held[a.stage])
    return peak


def plot_timeline(ax, events: Sequence[Event], n_ranks: int, title: str = "") -> None:
    """Gantt chart: one row per rank, forwards blue, backwards orange, labelled by micro-batch."""
    import matplotlib.pyplot as plt

    t0 = min(e.start for e in events)
    scale = max(e.end for e in events) - t0
    for e in events:
        chunk = e.action.stage // n_ranks  # virtual stage index on its rank (0 unless interleaved)
        color = plt.cm.tab20(0 + chunk if e.action.kind == "F" else 2 + chunk)
        ax.barh(e.rank, e.end - e.start, left=e.start - t0, height=0.8, color=color, edgecolor="white", linewidth=0.5)
        if (e.end - e.start) / scale > 0.018:
            ax.text((e.start + e.end) / 2 - t0, e.rank, str(e.action.microbatch), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)])
    ax.set_ylim(n_ranks - 0.5, -0.5)
    ax.set_title(title, fontsize=9)


# ---- running a schedule for real ------------------------------------------------


class RunRecord(NamedTuple):
    losses: dict[int, float]  # micro-batch -> loss (on the rank holding the last stage)
    events: list[Event]  # this rank's actions, start/end in time.perf_counter() seconds
    peak: dict[int, int]  # stage -> most activations held at once


_MESSAGE_GROUPS: dict[str, dist.ProcessGroup] = {}


def message_group() -> dist.ProcessGroup | None:
    """The group :func:`execute` sends through: the default group when it is gloo, else a gloo group of all ranks.

    NCCL runs a rank's sends and receives with one peer in order on one stream, so
    "send F to the next rank, then receive B from it" on both sides of a pair can wait
    on each other (production schedules batch such pairs); gloo matches each message by
    its tag instead. Under NCCL the gloo group is created on the first call, which every
    rank must therefore make.
    """
    if "gloo" in str(dist.get_backend()):
        return None
    if "gloo" not in _MESSAGE_GROUPS:
        _MESSAGE_GROUPS["gloo"] = dist.new_group(backend="gloo")
    return _MESSAGE_GROUPS["gloo"]


def _tag(action_kind: str, microbatch: int, stage: int, n_microbatches: int) -> int:
    # A distinct tag per message (named by the action and stage that sent it), so gloo matches
    # each recv with its send whatever the order.
    return 2 * (stage * n_microbatches + microbatch) + (0 if action_kind == "F" else 1)


def execute(
    actions: Sequence[Action],
    modules: Mapping[int, nn.Module],
    n_stages: int,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    activation_shape: Sequence[int],
    *,
    stage_ranks: Sequence[int] | None = None,
    min_seconds: dict[str, float] | None = None,
    group: dist.ProcessGroup | None = None,
) -> RunRecord:
    """Run this rank's `actions` over its stage `modules` ({stage: module}); gradients accumulate in them.

    inputs/targets: the micro-batches (used by the first/last stage). Every
    activation between stages has `activation_shape`. Each micro-batch's loss
    is divided by the number of micro-batches, so the gradients equal those of
    the mean loss over the whole batch. `stage_ranks[s % p]` is the global rank
    holding stage s (default: rank s % p). `min_seconds` pads each action
    to a fixed duration ({"F": ..., "B": ...}), as if every rank had its own device.
    An event lasts until the rank has the result in hand (a late wake-up counts as busy).
    Event times are seconds of time.perf_counter(), a clock all processes of one
    machine share, so the ranks' timelines line up. Messages go through `group`
    (default: :func:`message_group`), as CPU tensors unless it is the default group.
    """
    stage_ranks = list(stage_ranks) if stage_ranks is not None else list(range(dist.get_world_size()))
    n_ranks, m = len(stage_ranks), len(inputs)
    device = next(next(iter(modules.values())).parameters()).device
    group = group if group is not None else message_group()
    wire = device if group is None else torch.device("cpu")  # a gloo side group carries CPU tensors
    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (stage, mb) -> (input, output)
    peak: dict[int, int] = {}
    losses: dict[int, float] = {}
    events: list[Event] = []
    pending: list = []  # isend handles (their tensors must stay alive until sent)
    pipeline_rank = stage_ranks.index(dist.get_rank())

    here: dict[int, torch.Tensor] = {}  # results for a stage on this same rank (one rank, or interleaved): no message

    def receive(kind: str, mb: int, src_stage: int) -> torch.Tensor:
        tag = _tag(kind, mb, src_stage, m)
        if src_stage % n_ranks == pipeline_rank:
            return here.pop(tag)
        buf = torch.empty(*activation_shape, device=wire)
        dist.recv(buf, src=stage_ranks[src_stage % n_ranks], tag=tag, group=group)
        return buf.to(device)

    for action in actions:
        kind, mb, stage = action
        last = stage == n_stages - 1
        # 1. wait for the data this action needs: time spent here is the bubble
        if kind == "F":
            x = inputs[mb].to(device) if stage == 0 else receive("F", mb, stage - 1).requires_grad_()
        else:
            grad = None if last else receive("B", mb, stage + 1)
        # 2. compute
        start = time.perf_counter()
        if kind == "F":
            out = modules[stage](x)
            if last:
                out = loss_fn(out, targets[mb].to(device))
                losses[mb] = out.item()
                out = out / m  # mean over micro-batches = mean over the batch
            saved[(stage, mb)] = (x, out)  # kept until this micro-batch's backward
            peak[stage] = max(peak.get(stage, 0), sum(1 for s, _ in saved if s == stage))
            result, to_stage = (None if last else out.detach()), stage + 1
        else:
            x, out = saved.pop((stage, mb))
            out.backward(grad)  # grad is None for the loss
            result, to_stage = (x.grad if stage > 0 else None), stage - 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # time the kernels, not their launch
        if min_seconds:  # the result is only "ready" once the emulated compute time has passed
            time.sleep(max(0.0, start + min_seconds[kind] - time.perf_counter()))
        events.append(Event(pipeline_rank, action, start, time.perf_counter()))
        # 3. pass the result on without waiting for it to arrive
        if result is not None and to_stage % n_ranks == pipeline_rank:
            here[_tag(kind, mb, stage, m)] = result.detach().clone()
        elif result is not None:
            payload = result.to(wire)
            work = dist.isend(payload, dst=stage_ranks[to_stage % n_ranks], tag=_tag(kind, mb, stage, m), group=group)
            pending.append((work, payload))
    for work, _ in pending:
        work.wait()
    return RunRecord(losses, events, peak)


def naive_model_parallel(
    stage_module: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    activation_shape: Sequence[int],
) -> float | None:
    """Naive model parallelism: rank k holds stage k; the whole batch goes forward rank by rank, then back.

    Returns the loss on the last rank (None elsewhere); gradients accumulate in
    `stage_module`. While one rank computes, every other rank waits in recv.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world - 1
    # forward: receive the activation from the previous rank, compute, pass it on
    inp = x if first else torch.empty(*activation_shape, device=x.device)
    if not first:
        dist.recv(inp, src=rank - 1)
        inp.requires_grad_()
    out = stage_module(inp)
    if not last:
        dist.send(out.detach(), dst=rank + 1)
        # backward: wait for d loss / d out from the next rank, then back-propagate
        grad_out = torch.empty_like(out)
        dist.recv(grad_out, src=rank + 1)
        out.backward(grad_out)
        loss = None
    else:
        loss_tensor = loss_fn(out, y)
        loss_tensor.backward()
        loss = loss_tensor.item()
    if not first:
        dist.send(grad_of(inp), dst=rank - 1)  # d loss / d input is the previous rank's d loss / d out
    return loss


def reference_gradients(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[float, list[torch.Tensor]]:
    """Single-process training step on the whole batch: (loss, gradient of every parameter)."""
    model.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.item(), [grad_of(p).clone() for p in model.parameters()]


def stage_gradients(stages: Sequence[nn.Module]) -> list[torch.Tensor]:
    """Gradients of the stage modules, in the order of the unsplit model's parameters."""
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for s in stages for p in s.parameters()]


# ---- one training step, from scratch and with torch.distributed.pipelining -------


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def local_stages(model: nn.Sequential, rank: int, n_ranks: int, n_virtual: int = 1) -> dict[int, nn.Sequential]:
    """The stages rank `rank` holds when `model` is cut into n_ranks * n_virtual stages: rank, rank + p, ..."""
    stages = split_into_stages(model, n_ranks * n_virtual)
    return {s: stages[s] for s in range(rank, n_ranks * n_virtual, n_ranks)}


def reference_stage_gradients(
    model: nn.Sequential, n_stages: int, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, dict[int, list[torch.Tensor]]]:
    """Single-process step on the whole batch; the gradients grouped by the stage that owns each parameter."""
    loss, grads = reference_gradients(model, x, y, loss_fn)
    by_stage, i = {}, 0
    for s, stage in enumerate(split_into_stages(model, n_stages)):
        n = len(list(stage.parameters()))
        by_stage[s], i = grads[i : i + n], i + n
    return loss, by_stage


def max_gradient_error(modules: Mapping[int, nn.Module], expected: dict[int, list[torch.Tensor]]) -> float:
    """Largest |difference| between the stage modules' gradients and the expected ones."""
    return max(
        float((grad_of(p) - g).abs().max())
        for s, module in modules.items()
        for p, g in zip(module.parameters(), expected[s])
    )


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
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    rank, p = dist.get_rank(group), dist.get_world_size(group)
    v = n_virtual if schedule == "interleaved 1F1B" else 1
    modules = local_stages(model if model is not None else course_model(), rank, p, v)
    device = next(next(iter(modules.values())).parameters()).device
    stages = [PipelineStage(module, s, p * v, device, group=group) for s, module in modules.items()]
    if schedule == "interleaved 1F1B":
        runner: PipelineScheduleMulti | PipelineScheduleSingle = ScheduleInterleaved1F1B(
            stages,  # type: ignore[arg-type]  # a list of PipelineStage is a list of _PipelineStageBase
            n_microbatches=n_microbatches,
            loss_fn=loss_fn,
        )
    else:
        kind = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule]
        runner = kind(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    losses: list[torch.Tensor] = []
    holds_first, holds_last = 0 in modules, p * v - 1 in modules
    args = (x,) if holds_first else ()
    runner.step(*args, target=y if holds_last else None, losses=losses if holds_last else None)
    return [float(loss.detach()) for loss in losses], modules


# ---- exercise: 1F1B for one stage ------------------------------------------------


def _as_actions(got, stage: int) -> list[Action]:
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


def check_one_f_one_b(fn) -> None:
    """fn(stage, n_stages, n_microbatches) -> 1F1B list of ("F"|"B", microbatch) for that stage.

    Every rank builds all stages' lists (pure functions), validates and
    simulates them for several m, and compares them with the reference order;
    all ranks reach the same verdict, and only the rank of the first faulty
    stage raises. If all is right, the lists are run for real and the
    gradients compared with single-process training.
    """
    rank, p = dist.get_rank(), dist.get_world_size()

    def fail_on(stage: int, message: str) -> None:
        if rank == stage:
            raise ExerciseFailed(message)

    for m in (1, 2, p, 2 * p + 1):
        lists = {}
        for s in range(p):
            try:
                lists[s] = _as_actions(fn(s, p, m), s)
                _validate_stage(lists[s], s, m)
            except (ExerciseFailed, ValueError) as error:
                return fail_on(s, f"n_microbatches={m}: {error}")
        try:
            simulate(lists, p)
        except Deadlock as error:
            return fail_on(min(error.waiting), f"n_microbatches={m}: the stages' lists {error}")
        for s in range(p):
            expected = one_f_one_b_actions(s, p, m)
            if lists[s] != expected:
                k = next((i for i, (a, b) in enumerate(zip(lists[s], expected)) if a != b), len(expected))
                return fail_on(
                    s,
                    f"stage {s} of {p}, n_microbatches={m}: action {k} should be "
                    f"{expected[k].kind}{expected[k].microbatch}; expected [{_short(expected)}], got "
                    f"[{_short(lists[s])}] (holds {peak_in_flight(lists[s])[s]} activations at once, "
                    f"1F1B holds {min(p - s, m)})",
                )
    # The lists are right: run them on the ranks and compare with single-process training.
    _run_and_compare(lists[rank], p, len(lists[rank]) // 2)


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


def _run_and_compare(actions: Sequence[Action], p: int, m: int) -> None:
    rank = dist.get_rank()
    model = course_model(n_units=max(p, 2))
    stages = split_into_stages(model, p)
    torch.manual_seed(1)
    x, y = torch.randn(4 * m, 64), torch.randn(4 * m, 8)
    _, expected = reference_gradients(model, x, y, nn.functional.mse_loss)
    mine = split_into_stages(course_model(n_units=max(p, 2)), p)[rank]
    execute(actions, {rank: mine}, p, list(x.chunk(m)), list(y.chunk(m)), nn.functional.mse_loss, (4, 64))
    offset = sum(len(list(s.parameters())) for s in stages[:rank])
    for i, param in enumerate(mine.parameters()):
        if not torch.allclose(grad_of(param), expected[offset + i], atol=1e-6, rtol=1e-4):
            raise ExerciseFailed(f"stage {rank}: gradient of parameter {i} differs from single-process training")


def solution_one_f_one_b(stage: int, n_stages: int, n_microbatches: int) -> list[tuple[str, int]]:
    return [(a.kind, a.microbatch) for a in one_f_one_b_actions(stage, n_stages, n_microbatches)]
