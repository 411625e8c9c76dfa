"""Notebook 09's model cut into stages; zero-bubble's split backward: B (input gradients) now, W (weights) later."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from course_lib.models import MLP


def course_model(n_units: int = 16, width: int = 64, seed: int = 0) -> MLP:
    """The shared MLP in `n_units` pieces (blocks and head); 16 fit two virtual stages on each of up to 8 ranks."""
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


def local_stages(model: nn.Sequential, rank: int, n_ranks: int, n_virtual: int = 1) -> dict[int, nn.Sequential]:
    """The stages rank `rank` holds when `model` is cut into n_ranks * n_virtual stages: rank, rank + p, ..."""
    stages = split_into_stages(model, n_ranks * n_virtual)
    return {s: stages[s] for s in range(rank, n_ranks * n_virtual, n_ranks)}


Layers = list[tuple[nn.Module, torch.Tensor]]  # (a module that owns parameters, its output in this forward)


@contextmanager
def recording_layer_outputs(stage: nn.Module) -> Iterator[Layers]:
    """During the block, every forward of a submodule that owns parameters appends (module, output)."""
    layers: Layers = []
    owners = [m for m in stage.modules() if next(m.parameters(recurse=False), None) is not None]
    hooks = [m.register_forward_hook(lambda module, _inputs, out: layers.append((module, out))) for m in owners]
    try:
        yield layers
    finally:
        for hook in hooks:
            hook.remove()


def backward_input(
    x: torch.Tensor, out: torch.Tensor, grad: torch.Tensor | None, layers: Layers
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """B: (d loss / d x, or None on the first stage; d loss / d output of each layer).

    autograd.grad computes only what leads to the tensors it is asked for: the stage's
    input and the layers' outputs, which lie on that path anyway. No weight gradient is
    computed; the graph is kept for W.
    """
    wanted = [y for _, y in layers] + ([x] if x.requires_grad else [])
    grads = list(torch.autograd.grad(out, wanted, grad_outputs=grad, retain_graph=True))
    input_grad = grads.pop() if x.requires_grad else None
    return input_grad, grads


def backward_weight(layers: Layers, output_grads: list[torch.Tensor]) -> None:
    """W: each layer's weight gradients (accumulated in .grad) from the gradient B left at its output.

    `inputs=` limits autograd to the layer's own parameters: for a Linear that is one
    product, grad_output^T @ input, and the backward stops there.
    """
    for (layer, y), dy in zip(layers, output_grads):
        torch.autograd.backward(y, dy, inputs=list(layer.parameters(recurse=False)))
