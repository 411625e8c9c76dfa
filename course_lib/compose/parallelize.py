"""Each parallelism of notebook 13 as a function applied to a model over one mesh dimension.

:func:`apply_tp` (tensor parallel, notebook 08), :func:`apply_fsdp` (FSDP2 or HSDP, notebook 03),
:func:`stage_blocks` (a pipeline stage, notebook 09), on a stack of the course's transformer blocks.
The composed model must train exactly as one process does: :func:`reference_grads` is that process,
:func:`unsharded_gradients` what a rank compares with it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from course_lib.compare import full_gradients
from course_lib.models import BLOCK, TransformerBlock, shard_layers_then_root
from course_lib.tensor_parallel import tp_plan

Model = TypeVar("Model", bound=nn.Module)  # the model given is the model returned, sharded in place


def make_model(n_blocks: int = 4, seed: int = 0) -> nn.Sequential:
    """A stack of the course's transformer blocks (models.BLOCK): same weights on every rank."""
    return nn.Sequential(*[TransformerBlock(seed=seed + i) for i in range(n_blocks)])


def make_batch(
    global_batch: int = 8, seq: int = 6, d_model: int = BLOCK.d_model, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded inputs and targets: the same on every rank and every machine."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(global_batch, seq, d_model, generator=g), torch.randn(global_batch, seq, d_model, generator=g)


def transformer_blocks(model: nn.Module) -> list[TransformerBlock]:
    """The course's transformer blocks in `model`, in order: a stack of them, or a GPT's (or one stage's)."""
    return [m for m in model.modules() if isinstance(m, TransformerBlock)]


def apply_tp(model: Model, tp_mesh: DeviceMesh) -> Model:
    """Tensor parallel inside every block (q/k/v/up column-wise, o/down row-wise; notebook 08)."""
    from torch.distributed.tensor.parallel import parallelize_module

    for block in transformer_blocks(model):
        parallelize_module(block, tp_mesh, tp_plan())
    return model


def apply_fsdp(model: Model, dp_mesh: DeviceMesh) -> Model:
    """FSDP2 per block, then the root: what no block holds (a GPT's embeddings, final norm and head, whose tied
    table is used twice inside the root's forward: one gathered copy serves both). Notebook 03; a 2-D mesh
    (replicate, shard) gives HSDP."""
    shard_layers_then_root(model, transformer_blocks(model), mesh=dp_mesh)
    return model


def stage_blocks(model: nn.Sequential, pp_rank: int, pp: int) -> nn.Sequential:
    """This pipeline stage's contiguous slice of blocks (notebook 09)."""
    if len(model) % pp:
        raise ValueError(f"{len(model)} blocks do not split into {pp} equal stages")
    per = len(model) // pp
    return nn.Sequential(*list(model)[pp_rank * per : (pp_rank + 1) * per])


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def shard_loss(out: torch.Tensor, target: torch.Tensor, global_batch: int, dp: int) -> torch.Tensor:
    """This dp rank's share of the global-batch mean loss, scaled for a gradient average over `dp` ranks.

    FSDP (and DDP) average gradients over the dp ranks. With shares of unequal size (12 sequences over
    5 ranks: 3, 3, 2, 2, 2) a plain per-rank mean would weigh a sample of a small share more; scaling
    by dp * n_local / n_global makes the average over dp exactly the mean over the global batch.
    """
    return loss_fn(out, target) * (dp * len(out) / global_batch)


@contextmanager
def quiet_full_tensor() -> Iterator[None]:
    """Gathering a (FSDP x TP) gradient for a check logs a note that it takes two all-gathers.

    That note is about speed, and these gathers exist only to compare with the reference.
    """
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def unsharded_gradients(blocks: nn.Module, first_block: int = 0) -> dict[str, torch.Tensor]:
    """compare.full_gradients named as in the whole model: a pipeline stage's blocks are numbered from 0,
    the model's from `first_block` (a collective when the gradients are sharded)."""
    with quiet_full_tensor():
        gradients = full_gradients(blocks)
    renamed = {}
    for name, grad in gradients.items():
        index, rest = name.split(".", 1)
        renamed[f"{int(index) + first_block}.{rest}"] = grad
    return renamed


def reference_grads(n_blocks: int, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process training on the whole global batch, on x's device: the loss and every gradient."""
    model = make_model(n_blocks).to(x.device)
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.item(), full_gradients(model)
