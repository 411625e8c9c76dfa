"""Checkers of notebook 05's exercises; each runs on every rank, with that rank's own batch."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from course_lib.activations.formulas import course_block_bytes
from course_lib.activations.lab import LiveBytes, loss_of
from course_lib.activations.oom import MiB, allocation_scale, attempt, memory_limit, unmap_freed_memory
from course_lib.activations.recompute import Checkpointed, block_stack, checkpoint_from_scratch
from course_lib.compare import grad_of
from course_lib.exercises import ExerciseFailed, refusing
from course_lib.launch.runtime import rank_device
from course_lib.models import BLOCK

CHECKED_EVERY = (1, 2, 3, 4)
_CHECKPOINT_IT_YOURSELF = (
    "this wraps blocks in the course's Checkpointed (or checkpoint_from_scratch): the exercise is to choose the blocks "
    "and call torch.utils.checkpoint.checkpoint on them yourself"
)
LAYERS, SEQ = 5, 32


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def check_checkpoint_every(fn: Callable[[nn.Sequential, torch.Tensor, int], torch.Tensor]) -> None:
    """fn(blocks, x, k): blocks i = 0, k, 2k, ... run under activation checkpointing, the others as they are."""
    batch = 2 + _rank() % 3  # each rank its own batch size and data
    x = torch.randn(batch, SEQ, BLOCK.d_model, generator=torch.Generator().manual_seed(100 + _rank()))
    reference = block_stack(LAYERS)
    expected_output = reference(x)
    expected_output.square().mean().backward()
    per_layer, block_input = course_block_bytes(SEQ, batch, element_bytes=4), 4 * SEQ * batch * BLOCK.d_model
    for k in CHECKED_EVERY:
        blocks = block_stack(LAYERS)
        with refusing(Checkpointed, checkpoint_from_scratch, why=_CHECKPOINT_IT_YOURSELF), LiveBytes() as live:
            out = fn(blocks, x, k)
            held = live.now()
        if not isinstance(out, torch.Tensor) or not torch.equal(out, expected_output):
            raise ExerciseFailed(f"k={k}: the output differs from running the blocks one after the other")
        out.square().mean().backward()
        for (name, got), want in zip(blocks.named_parameters(), reference.parameters()):
            if got.grad is None:
                raise ExerciseFailed(f"k={k}: {name} got no gradient (did backward reach every checkpointed block?)")
            if not torch.equal(got.grad, grad_of(want)):
                raise ExerciseFailed(f"k={k}: the gradient of {name} differs from the run without checkpointing")
        checkpointed = len(range(0, LAYERS, k))
        expected = checkpointed * block_input + (LAYERS - checkpointed) * per_layer
        if held != expected:
            raise ExerciseFailed(
                f"k={k}: {held:,} bytes held after the forward, expected {expected:,.0f} "
                f"({checkpointed} of {LAYERS} blocks checkpointed, keeping only their input)"
            )


BUDGET_MIB, EVAL_BATCHES = 16, 8


def check_evaluate(fn: Callable[[nn.Module, list[torch.Tensor]], float]) -> None:
    """fn(model, batches) -> mean of mean(model(x)²) in 16 MiB: 1 batch's saved activations fit, 8 don't; save none."""
    unmap_freed_memory()
    device = rank_device()
    scale = allocation_scale(device)
    budget_mib = BUDGET_MIB * scale
    generator = torch.Generator().manual_seed(300 + _rank())
    batches = [torch.randn(8 * scale, 64, BLOCK.d_model, generator=generator).to(device) for _ in range(EVAL_BATCHES)]
    model = block_stack(4).to(device)
    with torch.no_grad():
        expected = sum(loss_of(model(x)).item() for x in batches) / len(batches)
    saved = 0

    def count(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.untyped_storage().nbytes()
        return tensor.detach()  # not the tensor itself: an op's saved output would then keep its own graph alive

    with memory_limit(budget_mib * MiB, device), torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        outcome = attempt(lambda: fn(model, batches))
    if not outcome["ok"]:
        raise ExerciseFailed(
            f"evaluating {EVAL_BATCHES} batches ran out of memory under a {budget_mib} MiB limit "
            f"({outcome['error']}): something keeps each batch's activations alive"
        )
    if saved:
        raise ExerciseFailed(f"the evaluation saved {saved:,} bytes of activations for a backward that never runs")
    value = outcome["value"]
    if not isinstance(value, float):
        raise ExerciseFailed(f"return the mean loss as a Python float, got {type(value).__name__}")
    if abs(value - expected) > 1e-6 * abs(expected):
        raise ExerciseFailed(f"mean loss {value:.6g}, expected {expected:.6g} (the mean over the batches)")
