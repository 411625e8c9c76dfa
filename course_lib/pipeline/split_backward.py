"""The backward split in two, for zero-bubble schedules: B (input gradient) now, W (weight gradients) later.

A stage's backward computes two things: the gradient of its input, which the previous stage waits
for, and the gradients of its own weights, which nobody waits for until the optimizer step. B asks
autograd for the first only, and on its way keeps the gradient at each layer's output; W later turns
those into weight gradients, one layer at a time, without going through the stage again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

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
