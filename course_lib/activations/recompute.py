"""Activation checkpointing: from scratch with saved-tensor hooks, and with torch.utils.checkpoint."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

RECOMPUTE_MODES = ("none", "full", "selective", "from scratch")


def checkpoint_from_scratch(block: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """block(x), keeping only x for backward: what the forward saves is recomputed when backward needs it."""
    recomputed: dict[int, torch.Tensor] = {}
    tickets = 0

    def pack(tensor: torch.Tensor) -> int:  # the forward wants to save `tensor`: keep a ticket instead
        nonlocal tickets
        tickets += 1
        return tickets - 1

    def unpack(ticket: int) -> torch.Tensor:
        if not recomputed:  # first request in backward: run the forward again, collecting what it saves, in order
            collected: list[torch.Tensor] = []

            def collect(tensor: torch.Tensor) -> int:
                collected.append(tensor.detach())  # the data only: no link back to this throwaway graph
                return len(collected) - 1

            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(collect, lambda i: collected[i]):
                block(x.detach().requires_grad_(x.requires_grad))
            recomputed.update(enumerate(collected))
        return recomputed.pop(ticket)  # handed over once: freed as soon as backward is done with it

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return block(x)


MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}


def is_attention_kernel(op: Any) -> bool:
    """The fused attention kernels: _scaled_dot_product_{flash,efficient,cudnn,...}_attention[_for_cpu]."""
    name = op.overloadpacket.__name__
    return name.startswith("_scaled_dot_product") and not name.endswith("backward")


def save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing policy: keep what matmuls and attention computed, recompute everything else."""
    if op.overloadpacket in MATMULS or is_attention_kernel(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed(nn.Module):
    """`block` under activation checkpointing ("full", "selective", "from scratch"); fully_shard wraps it as is."""

    def __init__(self, block: nn.Module, mode: str = "full", policy: Callable[..., CheckpointPolicy] = save_matmuls):
        super().__init__()
        if mode not in RECOMPUTE_MODES[1:]:
            raise ValueError(f"mode must be one of {RECOMPUTE_MODES[1:]}, got {mode!r}")
        self.block, self.mode, self.policy = block, mode, policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "from scratch":
            return checkpoint_from_scratch(self.block, x)
        if self.mode == "selective":
            context = functools.partial(create_selective_checkpoint_contexts, self.policy)
            return checkpoint(self.block, x, use_reentrant=False, context_fn=context)
        return checkpoint(self.block, x, use_reentrant=False)


def block_stack(layers: int, mode: str = "none", seed: int = 0, **block_args: Any) -> nn.Sequential:
    """`layers` TransformerBlocks (seeded: the same weights for every mode), each checkpointed unless mode='none'."""
    from course_lib.models import TransformerBlock

    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"mode must be one of {RECOMPUTE_MODES}, got {mode!r}")
    blocks = [TransformerBlock(seed=seed + i, **block_args) for i in range(layers)]
    return nn.Sequential(*(block if mode == "none" else Checkpointed(block, mode) for block in blocks))
