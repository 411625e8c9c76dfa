"""Rank programs of tests/test_debugging.py: the debugger's scenarios and a DETAIL mismatch."""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from course_lib.data import regression
from course_lib.debugging import (
    DistributedDebugger,
    GradientDesyncError,
    NonFiniteError,
    NonFiniteEvent,
    allreduce_sizes,
    environment_report,
    is_allreduce,
    trace_event_names,
    train_monitored,
)
from course_lib.models import MLP


class SqrtActivation(torch.nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(t.abs())  # finite forward, infinite gradient where t == 0


def _desync_verdicts(rank: int, world_size: int) -> tuple[dict, tuple]:
    """The gradient check on a healthy step and on each injected fault; the profiled all-reduce sizes."""
    results: dict[str, tuple] = {}
    data = regression(n=32 * world_size)
    x, y = data.tensors[0][rank::world_size], data.tensors[1][rank::world_size]
    model = DDP(MLP(), bucket_cap_mb=0.01)
    debugger = DistributedDebugger(model)

    def backward(forward: torch.nn.Module = model) -> None:
        model.zero_grad()
        torch.nn.functional.mse_loss(forward(x), y).backward()

    def verdict() -> tuple:
        try:
            return ("ok", debugger.check_gradient_sync())
        except (GradientDesyncError, NonFiniteError) as error:
            return (type(error).__name__, str(error))

    backward()
    results["healthy"] = verdict()
    backward(model.module)
    results["bypass"] = verdict()
    backward()
    if rank == 1:
        model.module[0].weight.grad[2, 3] += 1e-6  # tiny: float64 checksums still see it
    results["nudge rank 1"] = verdict()
    backward()
    if rank == world_size - 1:
        g = model.module[2].weight.grad
        g[0, 0], g[0, 1] = g[0, 1].clone(), g[0, 0].clone()  # a plain sum would not change
    results["swap last rank"] = verdict()
    backward()
    for p in model.module[-1].parameters():
        p.grad = None  # no gradient on any rank: still in sync
    results["grad None everywhere"] = verdict()
    backward()
    if rank == 0:
        model.module[2].bias.grad[0] = float("nan")
    results["nan rank 0"] = verdict()

    # profiler trace: all-reduce events and their sizes
    for _ in range(2):
        backward()
    trace = os.path.join(tempfile.mkdtemp(), "trace.json")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        backward()
    prof.export_chrome_trace(trace)
    names = trace_event_names(trace)
    profiled = (any(is_allreduce(n) for n in names), allreduce_sizes(trace), sum(p.numel() for p in model.parameters()))
    return results, profiled


def _nonfinite_events(rank: int, world_size: int) -> dict:
    """NaN/Inf hooks: forward input, forward output, backward of a module, loss gradient, parameter gradient."""
    events: dict = {}
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), SqrtActivation(), torch.nn.Linear(4, 2))
    inputs = torch.ones(3, 4)

    def run(watcher: DistributedDebugger, inputs: torch.Tensor, loss_scale: float = 1.0) -> str:
        watcher.reset()
        plain.zero_grad()
        (plain(inputs).sum() * loss_scale).backward()
        return str(watcher.first_nonfinite())

    bad = inputs.clone()
    bad[1, 2] = float("nan")
    watcher = DistributedDebugger(plain).watch_nonfinite()
    events["input"] = run(watcher, bad)
    with torch.no_grad():
        plain[0].weight.zero_()
        plain[0].bias.zero_()  # sqrt sees exact zeros
    events["backward"] = run(watcher, inputs)
    with torch.no_grad():
        plain[0].weight.fill_(0.1)
        plain[0].bias.fill_(0.1)
    events["loss"] = run(watcher, inputs, float("inf"))
    with torch.no_grad():
        plain[2].weight[0, 0] = float("inf")
    events["output"] = run(watcher, inputs)
    with torch.no_grad():
        plain[2].weight[0, 0] = 0.0
    watcher.remove()
    run(watcher, bad)
    events["clean after remove"] = watcher.first_nonfinite()
    handle = plain[2].weight.register_hook(lambda g: g * float("nan"))  # before the debugger's own hook
    injected = DistributedDebugger(plain).watch_nonfinite()
    events["gradient"] = run(injected, inputs)
    injected.remove()
    handle.remove()
    raiser = DistributedDebugger(plain).watch_nonfinite(raise_on_nonfinite=True)
    try:
        plain(bad)
        events["raised"] = None
    except NonFiniteError as error:
        events["raised"] = str(error)
    raiser.remove()
    watcher.reset()
    if rank == world_size - 1:
        watcher.events.append(NonFiniteEvent(rank, "gradient", "w", 1))
    events["gathered"] = [str(e) if e else None for e in watcher.gather_nonfinite()]
    return events


def scenarios(rank: int, world_size: int) -> dict:
    """Every debugger scenario in one launch (each launch costs seconds of start-up)."""
    results, profiled = _desync_verdicts(rank, world_size)
    return {
        "results": results,
        "events": _nonfinite_events(rank, world_size),
        "profiled": profiled,
        "report": environment_report(),
        "monitor": train_monitored(4, 8, report=False).as_dict(),
    }


def detail_mismatch(rank: int, world_size: int) -> dict:
    """Rank 2 all-reduces 5 elements where the others all-reduce 4: DETAIL must name each call."""
    group = dist.new_group(timeout=timedelta(seconds=20))
    x = torch.ones(5 if rank == 2 else 4)
    dist.all_reduce(x, group=group)
    return {}
