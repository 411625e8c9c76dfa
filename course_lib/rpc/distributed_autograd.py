"""Distributed autograd: a forward across three workers, its backward, and a step on every owner."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn

from course_lib.compare import full_gradients
from course_lib.rpc.train import make_model, snapshot


def three_stage_model() -> list[nn.Module]:
    """The course MLP (two hidden layers) cut into three stages: Linear+GELU | Linear+GELU | Linear."""
    layers = list(make_model())
    return [nn.Sequential(*layers[0:2]), nn.Sequential(*layers[2:4]), nn.Sequential(*layers[4:])]


class PythonSGD(torch.optim.SGD):
    """torch.optim.SGD under another name, for DistributedOptimizer."""


@contextlib.contextmanager
def _logger_level(name: str, level: int) -> Iterator[None]:
    logger = logging.getLogger(name)
    previous = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)


class Stage(nn.Module):
    """One stage of `three_stage_model`, built on the worker that owns it."""

    def __init__(self, index: int):
        super().__init__()
        self.net = three_stage_model()[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def parameter_rrefs(self) -> list[rpc.RRef]:
        return [rpc.RRef(p) for p in self.parameters()]


def stage_gradients(stage_rref: rpc.RRef, context_id: int) -> list[torch.Tensor]:
    """Runs on the stage's owner: the gradients distributed autograd accumulated there."""
    grads = dist_autograd.get_gradients(context_id)
    return [grads[p].clone() for p in stage_rref.local_value().parameters()]


def stage_parameters(stage_rref: rpc.RRef) -> list[torch.Tensor]:
    return snapshot(stage_rref.local_value())


def stage_owner(index: int, world_size: int) -> str:
    """Stage k lives on worker k mod world_size: three different processes when there are three."""
    return f"worker{index % world_size}"


def distributed_training_step(world_size: int, x: torch.Tensor, y: torch.Tensor, lr: float = 0.1) -> dict[str, Any]:
    """Runs on worker0: one SGD step of the three-stage model spread over the workers.

    Forward: x -> stage 0 -> stage 1 -> stage 2, each an RPC to the stage's owner; the loss
    is computed here. `dist_autograd.backward` runs the backward pass through every worker
    the forward touched; `DistributedOptimizer` steps each parameter on its owner.
    """
    from torch.distributed.optim import DistributedOptimizer  # imported here: it loads TorchScript machinery

    stages = [rpc.remote(stage_owner(k, world_size), Stage, args=(k,)) for k in range(3)]
    param_rrefs = [p for s in stages for p in s.rpc_sync().parameter_rrefs()]
    # For a class without TorchScript support DistributedOptimizer logs that the Python optimizer
    # may be slow under the GIL. Known and chosen (see PythonSGD): that logger only, only here.
    with _logger_level("torch.distributed.optim.optimizer", logging.ERROR):
        optimizer = DistributedOptimizer(PythonSGD, param_rrefs, lr=lr)
    with dist_autograd.context() as context_id:
        h = x
        for stage in stages:
            h = stage.rpc_sync().forward(h)
        loss = nn.functional.mse_loss(h, y)
        dist_autograd.backward(context_id, [loss])
        gradients = [g for s in stages for g in rpc.rpc_sync(s.owner(), stage_gradients, args=(s, context_id))]
        local_grads_here = len(dist_autograd.get_gradients(context_id))
        optimizer.step(context_id)
    parameters = [p for s in stages for p in rpc.rpc_sync(s.owner(), stage_parameters, args=(s,))]
    return {
        "loss": loss.item(),
        "gradients": gradients,
        "parameters": parameters,
        "owners": [s.owner().name for s in stages],
        "local_grads_here": local_grads_here,
    }


def local_training_step(x: torch.Tensor, y: torch.Tensor, lr: float = 0.1) -> dict[str, Any]:
    """The same step in one process: the reference distributed autograd must reproduce."""
    model = nn.Sequential(*three_stage_model())
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    gradients = list(full_gradients(model).values())
    torch.optim.SGD(model.parameters(), lr=lr).step()
    return {"loss": loss.item(), "gradients": gradients, "parameters": snapshot(model)}
