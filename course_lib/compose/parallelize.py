"""Notebook 13's rank grid and one function per parallelism; reference_grads is the one process they must match."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
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
    """This dp rank's loss share, scaled by dp·n_local/n_global so unequal shares average to the global-batch mean."""
    return loss_fn(out, target) * (dp * len(out) / global_batch)


@contextmanager
def quiet_full_tensor() -> Iterator[None]:
    """Silences DTensor's two-all-gathers speed note: these gathers exist only to compare with the reference."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def unsharded_gradients(blocks: nn.Module, first_block: int = 0) -> dict[str, torch.Tensor]:
    """Full gradients named as in the whole model (a stage numbers its blocks from 0); a collective when sharded."""
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


DIMS = ("pp", "dp", "tp")  # outermost to innermost: tp varies fastest, so a TP group sits inside one node


def rank_grid(world_size: int, pp: int, dp: int, tp: int) -> dict[str, list[list[int]]]:
    """Every group of every dimension, as DeviceMesh finds them: the ranks laid out row-major in a (pp, dp, tp)
    array; a group of one dimension is a line of that array along it (the ranks that differ only there)."""
    if pp * dp * tp != world_size:
        raise ValueError(
            f"pp x dp x tp = {pp} x {dp} x {tp} = {pp * dp * tp}, but the world has {world_size} "
            f"ranks: choose sizes whose product is the world size"
        )
    grid = torch.arange(world_size).view(pp, dp, tp)
    return {
        name: sorted(grid.movedim(axis, -1).reshape(-1, size).tolist())
        for axis, (name, size) in enumerate(zip(DIMS, (pp, dp, tp)))
    }


def new_groups_by_hand(world_size: int, pp: int, dp: int, tp: int) -> dict[str, dist.ProcessGroup]:
    """The pre-DeviceMesh way: every rank calls new_group for every group in order, or the ranks hang or mispair."""
    mine = {}
    for name, groups in rank_grid(world_size, pp, dp, tp).items():
        for ranks in groups:
            group = dist.new_group(ranks)  # every rank makes every call
            if dist.get_rank() in ranks:
                mine[name] = group
    return mine


@dataclass(frozen=True, kw_only=True)
class Dims:
    """How many ranks along each parallel dimension (torchtitan's ParallelDims); the one place a mesh is built."""

    pp: int = 1
    dp: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    def __str__(self) -> str:
        return f"pp={self.pp} x dp={self.dp} x tp={self.tp} ({self.world} ranks)"

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The grid in one call: a 3-D DeviceMesh with named dimensions, tp innermost."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=DIMS)
