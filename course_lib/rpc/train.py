"""The training both parameter servers run, and the data-parallel reference they are compared with."""

from __future__ import annotations

import functools
import statistics
import threading
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.data import TensorDataset

from course_lib.data import regression
from course_lib.models import MLP

_MODEL_BUILD_LOCK = threading.Lock()


def make_model() -> nn.Sequential:
    """The small course MLP, built under a lock: MLP draws from the global RNG and RPC threads would interleave."""
    with _MODEL_BUILD_LOCK:
        return MLP(d_in=32, d_hidden=32, d_out=8, n_layers=2, seed=0)


@functools.lru_cache(maxsize=4)
def _dataset(n_samples: int) -> TensorDataset:
    return regression(n=n_samples, d_in=32, d_out=8, seed=0)


def trainer_batch(
    step: int, trainer: int, n_trainers: int, batch_size: int = 16, n_samples: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer `trainer`'s slice of step `step`'s global batch (n_trainers x batch_size rows of a permutation)."""
    data = _dataset(n_samples)
    order = torch.randperm(n_samples, generator=torch.Generator().manual_seed(step))
    rows = order[(trainer * batch_size) % n_samples :][:batch_size]
    return data.tensors[0][rows], data.tensors[1][rows]


def full_data_loss(parameters: list[torch.Tensor]) -> float:
    """Loss of `parameters` on the whole data set: convergence measured without mini-batch noise."""
    model = make_model()
    load_parameters(model, parameters)
    x, y = _dataset(512).tensors
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


def loss_and_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    loss = nn.functional.mse_loss(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return loss.item(), [g.detach() for g in grads]


def load_parameters(model: nn.Module, values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(model.parameters(), values):
            p.copy_(v)


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def set_average_gradient(model: nn.Module, gradients: Sequence[list[torch.Tensor]]) -> None:
    """Each parameter's `.grad` = the mean of the trainers' gradients for it, summed in the order given."""
    for i, p in enumerate(model.parameters()):
        total = gradients[0][i].clone()
        for grads in gradients[1:]:
            total += grads[i]
        p.grad = total / len(gradients)


def data_parallel_reference(
    n_trainers: int, steps: int = 40, batch_size: int = 16, lr: float = 1.0
) -> tuple[list[torch.Tensor], list[float]]:
    """Single process: what data-parallel training (DDP) computes with the same data."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        results = [
            loss_and_gradients(model, *trainer_batch(step, t, n_trainers, batch_size)) for t in range(n_trainers)
        ]
        losses.append(statistics.fmean(loss for loss, _ in results))
        set_average_gradient(model, [grads for _, grads in results])
        optimizer.step()
        optimizer.zero_grad()
    return snapshot(model), losses
