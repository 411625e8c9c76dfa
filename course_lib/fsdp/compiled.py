"""Notebook 03, section 8: torch.compile with FSDP2, two orders.
FSDP2's hooks are dynamo-disabled, so graphs break at them; compiling blocks first puts graphs between the hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from course_lib.models import shard_layers_then_root


def compile_blocks_then_shard(model: nn.Module, backend: Callable[..., Any] | None) -> nn.Module:
    """torchtitan's order: `block.compile()` on each of `model.blocks`, then `fully_shard` each block and the root.

    Each block's forward is compiled on its own, between the FSDP2 hooks that run around it; the root's own
    modules (embeddings, head) stay eager. `backend=None`: the same sharding, nothing compiled."""
    blocks = list(model.get_submodule("blocks").children())
    if backend is not None:
        for block in blocks:
            block.compile(backend=backend)
    return shard_layers_then_root(model, blocks)


def shard_then_compile(model: nn.Module, backend: Callable[..., Any] | None) -> nn.Module:
    """The whole model: `fully_shard` each of `model.blocks` and the root, then `torch.compile(model)`.

    Dynamo traces from the top and breaks its graph where it meets an FSDP2 hook. `backend=None`: no compile."""
    sharded = shard_layers_then_root(model, list(model.get_submodule("blocks").children()))
    return sharded if backend is None else cast(nn.Module, torch.compile(sharded, backend=backend))


COMPILE_ORDERS: dict[str, Callable[[nn.Module, Callable[..., Any] | None], nn.Module]] = {
    "per block, then fully_shard": compile_blocks_then_shard,
    "fully_shard, then whole model": shard_then_compile,
}
