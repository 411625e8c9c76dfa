"""Running a schedule: each rank takes its actions in order; sends are isend, so a rank blocks only in recv."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from course_lib.compare import grad_of
from course_lib.pipeline.schedules import Action
from course_lib.pipeline.stages import backward_input, backward_weight, recording_layer_outputs
from course_lib.pipeline.timeline import Event


class RunRecord(NamedTuple):
    """What :func:`execute` returns on one rank."""

    losses: dict[int, float]  # micro-batch -> loss (on the rank holding the last stage)
    events: list[Event]  # this rank's actions, start/end in time.perf_counter() seconds
    peak: dict[int, int]  # stage -> most activations held at once


_MESSAGE_GROUPS: dict[str, dist.ProcessGroup] = {}


def message_group() -> dist.ProcessGroup | None:
    """Gloo group for :func:`execute` (NCCL's in-order peer streams deadlock crossed pairs); 1st call is collective."""
    if dist.get_backend() == "gloo":
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
    """Runs this rank's actions on its stages; losses scaled by 1/m so the gradients are those of the batch mean."""
    stage_ranks = list(stage_ranks) if stage_ranks is not None else list(range(dist.get_world_size()))
    n_ranks, m = len(stage_ranks), len(inputs)
    device = next(next(iter(modules.values())).parameters()).device
    group = group if group is not None else message_group()
    wire = device if group is None else torch.device("cpu")  # a gloo side group carries CPU tensors
    split = {(a.stage, a.microbatch) for a in actions if a.kind == "W"}  # backwards whose W runs separately
    saved: dict[tuple[int, int], tuple] = {}  # (stage, mb) -> (input, output, layers), then what W needs
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
        received = None
        if kind == "F":
            received = inputs[mb].to(device) if stage == 0 else receive("F", mb, stage - 1).requires_grad_()
        elif kind == "B" and not last:
            received = receive("B", mb, stage + 1)
        # 2. compute
        start = time.perf_counter()
        target = targets[mb].to(device) if last and kind == "F" else None
        result = run_action(action, modules[stage], received, saved, split, target, loss_fn, m)
        if target is not None and result is not None:  # the last stage's forward returned its loss
            losses[mb], result = result.item(), None
        if kind == "F":
            peak[stage] = max(peak.get(stage, 0), sum(1 for s, _ in saved if s == stage))
        to_stage = stage + 1 if kind == "F" else stage - 1
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


def run_action(
    action: Action,
    module: nn.Module,
    received: torch.Tensor | None,
    saved: dict[tuple[int, int], tuple],
    split: set[tuple[int, int]],
    target: torch.Tensor | None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    n_microbatches: int,
) -> torch.Tensor | None:
    """One action on its stage. F: `received` is the input; returns the output the next stage waits for (the
    loss on the last stage, which has a `target`). B: `received` is the output's gradient (None under the
    loss); returns the input gradient the previous stage waits for. A B whose W is in the list (`split`)
    computes only that; W adds the weight gradients, and nobody waits for it."""
    kind, mb, stage = action
    if kind == "F":
        with recording_layer_outputs(module) as layers:  # where a split backward's W starts
            out = module(received)
        if target is not None:
            loss = loss_fn(out, target)
            out = loss / n_microbatches  # mean over micro-batches = mean over the batch
        saved[(stage, mb)] = (received, out, layers)  # kept until this micro-batch's backward (its W if split)
        return loss.detach() if target is not None else out.detach()
    if kind == "B" and (stage, mb) not in split:
        x, out, _ = saved.pop((stage, mb))
        out.backward(received)  # the whole backward: input and weight gradients
        return x.grad if stage > 0 else None
    if kind == "B":  # the input gradient only: the layers and the gradients at their outputs wait for W
        x, out, layers = saved[(stage, mb)]
        input_grad, output_grads = backward_input(x, out, received, layers)
        saved[(stage, mb)] = (layers, output_grads)
        return input_grad
    backward_weight(*saved.pop((stage, mb)))  # W: the weight gradients
    return None


def naive_model_parallel(
    stage_module: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    activation_shape: Sequence[int],
) -> float | None:
    """Naive model parallelism: the whole batch forward rank by rank, then back, every other rank waiting in recv."""
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
