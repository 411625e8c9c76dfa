"""torch.compile under DDP: DDPOptimizer cuts graphs at bucket ends, so each bucket's all-reduce starts early."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import training
from course_lib.ddp.comm_hooks import recording_hook
from course_lib.launch.runtime import seconds_in_turns


def recording_backend(graphs: list[int], inductor: bool = False) -> Callable[..., Any]:
    """A torch.compile backend recording each graph's parameter bytes (they arrive as inputs); Inductor optional."""

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        graphs.append(sum(t.numel() * t.element_size() for t in example_inputs if isinstance(t, nn.Parameter)))
        if inductor:
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)  # type: ignore[return-value]
        return gm.forward

    return backend


def graphs_and_buckets(
    module: nn.Module, x: torch.Tensor, bucket_cap_mb: float | None = None, split: bool = True
) -> dict[str, list[int]]:
    """`DDP(torch.compile(module))`, two forward and backward passes (DDP settles its buckets after the first).

    Returns the parameter bytes of each graph Dynamo captured and of each bucket DDP all-reduced in the second
    backward, both in backward order (last layers first). `split=False` turns DDPOptimizer off.
    """
    graphs: list[int] = []
    buckets: dict[int, list[str]] = {}
    sizes = {name: p.numel() * p.element_size() for name, p in module.named_parameters()}
    with torch._dynamo.config.patch(optimize_ddp=split):
        model = DDP(torch.compile(module, backend=recording_backend(graphs)), bucket_cap_mb=bucket_cap_mb)
        model.register_comm_hook(None, recording_hook(model, buckets))
        for _ in range(2):
            model(x).square().mean().backward()
    torch._dynamo.reset()  # the next compile starts afresh
    bucket_bytes = [sum(sizes[name.removeprefix("_orig_mod.")] for name in buckets[i]) for i in sorted(buckets)]
    return {"graphs": graphs[::-1], "buckets": bucket_bytes}


def compile_then_ddp(model: nn.Module, backend: Callable[..., Any] | None) -> nn.Module:
    """`DDP(torch.compile(model, backend=backend))`, or `DDP(model)` when `backend` is None (eager)."""
    return DDP(model if backend is None else torch.compile(model, backend=backend))


def compiled_against_eager(
    make_model: Callable[[], nn.Module],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    lr: float = 1e-2,
    parallelize: Callable[[nn.Module, Callable[..., Any] | None], nn.Module] = compile_then_ddp,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.mse_loss,
) -> dict[str, Any]:
    """Eager and compiled DDP taking turns: losses, first-step time, graphs (a late one is a recompile), breaks."""
    from torch._dynamo.utils import counters

    breaks_before = sum(counters["graph_break"].values())
    graphs: list[int] = []
    models = {
        "eager": parallelize(make_model(), None),
        "compiled": parallelize(make_model(), recording_backend(graphs, inductor=True)),
    }
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=lr) for name, model in models.items()}

    def step(name: str, x: torch.Tensor, y: torch.Tensor) -> float:
        return training.step(models[name], optimizers[name], x, y, loss_fn=loss_fn).item()

    losses: dict[str, list[float]] = {name: [] for name in models}
    first_step_s: dict[str, float] = {}
    for x, y in batches:
        for name in models:
            start = time.perf_counter()
            losses[name].append(step(name, x, y))
            first_step_s.setdefault(name, time.perf_counter() - start)
        if len(losses["compiled"]) == 1:
            graphs_after_first_step = len(graphs)
    graph_breaks = sum(counters["graph_break"].values()) - breaks_before
    x, y = batches[-1]
    steps: dict[str, Callable[[], object]] = {name: functools.partial(step, name, x, y) for name in models}
    seconds = seconds_in_turns(steps, repeats=10, warmup=1)
    torch._dynamo.reset()
    return {
        "losses": losses,
        "first step s": first_step_s,
        "step s": seconds,
        "graphs": (graphs_after_first_step, len(graphs)),
        "graph bytes": graphs,
        "graph breaks": graph_breaks,
    }
