"""Fewer synchronisations with torchft: LocalSGD and DiLoCo against DDP, the bytes of every all-reduce counted."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from course_lib.checkpoint.fault_tolerance import GLOBAL_BATCH, _manager, wait_at_lighthouse

SYNC_RUNS = {
    "DDP": ("ddp", 1),
    "LocalSGD H=2": ("local_sgd", 2),
    "LocalSGD H=4": ("local_sgd", 4),
    "LocalSGD H=8": ("local_sgd", 8),
    "DiLoCo H=4, outer SGD lr 1": ("diloco", 4),
    "DiLoCo H=4, outer Nesterov": ("diloco_nesterov", 4),
}


def synchronised(
    method: str, sync_every: int, manager: Any, model: torch.nn.Module, inner: Any
) -> tuple[Any, Any, Any]:
    """(the module to call, the optimizer to step, the context to train in) for one method of :data:`SYNC_RUNS`."""
    from torchft import DistributedDataParallel, Optimizer
    from torchft.local_sgd import DiLoCo, LocalSGD

    if method == "ddp":  # gradients averaged at every step
        return DistributedDataParallel(manager, model), Optimizer(manager, inner), contextlib.nullcontext()
    if method == "local_sgd":  # H steps alone, then the weights averaged
        return model, inner, LocalSGD(manager, model, inner, sync_every=sync_every)
    nesterov = method == "diloco_nesterov"  # H steps alone, then the outer optimizer on the mean pseudo-gradient
    outer = torch.optim.SGD(
        model.parameters(), lr=0.7 if nesterov else 1.0, momentum=0.9 if nesterov else 0.0, nesterov=nesterov
    )
    return model, inner, DiLoCo(manager, [model], inner, outer, sync_every=sync_every, pin_memory=False)


def train_synced(
    root: str | os.PathLike,
    replica: int,
    lighthouses: dict[str, str],
    steps: int,
    *,
    replicas: int = 2,
    limit_s: float = 60.0,
) -> None:
    """Train the same MLP `steps` steps once per entry of :data:`SYNC_RUNS`, with that entry's lighthouse."""
    from course_lib.data import batch_for_step, regression
    from course_lib.models import MLP

    root = Path(root)
    data = regression(n=480)
    x_all, y_all = data.tensors
    result: dict[str, dict[str, list]] = {}
    for name, (method, sync_every) in SYNC_RUNS.items():
        model = MLP()
        inner = torch.optim.Adam(model.parameters(), lr=1e-2)
        # DiLoCo requires a synchronous quorum (at the synchronisation, not during the steps)
        manager, group, _store = _manager(lighthouses[name], replica, model, inner, use_async_quorum=method == "ddp")
        # every manager heartbeats before the first quorum, which would otherwise form without the later one
        wait_at_lighthouse(lighthouses[name], f"{replicas} replicas", lambda _, beating: beating >= replicas, limit_s)
        forward, optimizer, algorithm = synchronised(method, sync_every, manager, model, inner)
        losses = []
        with algorithm:
            for step in range(steps):
                x, y = batch_for_step(data, step, GLOBAL_BATCH, replica, replicas)
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(forward(x), y).backward()
                optimizer.step()  # LocalSGD and DiLoCo synchronise in the optimizer's post-step hook
                if (step + 1) % 8 == 0:  # a synchronisation point of every H here: the replicas agree
                    with torch.no_grad():
                        losses.append(torch.nn.functional.mse_loss(model(x_all), y_all).item())
        result[name] = {"allreduced": group.allreduced, "losses": losses}
        manager.shutdown(wait=False)
    (root / f"synced_{replica}.json").write_text(json.dumps(result))
