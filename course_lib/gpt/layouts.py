"""The capstone's layouts: one GPT, parallelized by applying one function per mesh dimension."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from course_lib.compare import local_tensor
from course_lib.compose import Dims, apply_fsdp, apply_tp
from course_lib.gpt.model import GPT, GPTConfig, pipeline_stage


@dataclass(frozen=True)
class Layout(Dims):
    """Name, mesh sizes (pp, dp, tp) and micro-batches per dp rank; on one rank every layout is the plain model."""

    name: str
    n_mb: int = 1
    ddp: bool = False
    compiled: bool = False

    def describe(self) -> str:
        sizes = [f"{k}={v}" for k, v in (("pp", self.pp), ("dp", self.dp), ("tp", self.tp)) if v > 1 or k == "dp"]
        return f"{self.name} ({' x '.join(sizes)}, {self.world} rank{'s' * (self.world > 1)})"


def layouts(nproc: int) -> list[Layout]:
    """The capstone's five layouts: DDP and FSDP2 on NPROC ranks, 2D on 2 x 2, 3D on 2 x 2 x 2 (2 micro-batches)."""
    return [
        Layout("one process"),
        Layout("DDP", dp=nproc, ddp=True),
        Layout("FSDP2", dp=nproc),
        Layout("FSDP2 x TP", dp=2, tp=2),
        Layout("PP x FSDP2 x TP", dp=2, tp=2, pp=2, n_mb=2),
    ]


def compiled_layouts(nproc: int) -> list[Layout]:
    """The compiled twins of one process and of FSDP2 on NPROC ranks."""
    return [Layout("one process, compiled", compiled=True), Layout("FSDP2, compiled", dp=nproc, compiled=True)]


def apply_ddp(model: nn.Module) -> nn.Module:
    """DDP over the default group: gradients all-reduced (averaged) in buckets during backward."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def apply_compile(blocks: nn.Sequential) -> None:
    """torch.compile each block in place, whole (fullgraph: a graph break would be an error). The blocks share
    one code: the first compile serves the others. Per block, not the whole model: FSDP2's all-gathers and
    reduce-scatters run between blocks, in its hooks, outside the compiled graphs, and each block's parameters
    keep their names (a checkpoint does not see the compile)."""
    for block in blocks:
        block.compile(fullgraph=True)


def parallelize(layout: Layout, config: GPTConfig, mesh: DeviceMesh | None, device: torch.device) -> nn.Module:
    """This rank's model for `layout`: built (or cut into its stage), then TP, then compiled, then FSDP2 or DDP."""
    if layout.pp > 1:
        assert mesh is not None
        model = pipeline_stage(config, mesh["pp"].get_local_rank(), layout.pp).to(device)
    else:
        model = GPT(config).to(device)
    if layout.tp > 1:
        assert mesh is not None
        apply_tp(model, mesh["tp"])
    if layout.compiled:
        apply_compile(model.blocks)
    if mesh is None:
        return model
    if layout.ddp:
        return apply_ddp(model)
    return apply_fsdp(model, mesh["dp"])


LR = 2e-3  # Adam's learning rate in every run


def adam_per_mesh(model: nn.Module, lr: float = LR) -> torch.optim.Optimizer:
    """Adam, a group per DeviceMesh: FSDP2 x TP puts blocks on (dp, tp), the root on dp; foreach can't mix them."""
    by_mesh: dict[object, list[nn.Parameter]] = {}
    for p in model.parameters():
        by_mesh.setdefault(getattr(p, "device_mesh", None), []).append(p)
    groups = [{"params": params} for params in by_mesh.values()]
    return torch.optim.Adam(groups, lr=lr, betas=(0.9, 0.95))


def tied_table(model: nn.Module) -> nn.Parameter | None:
    """This stage's copy of the token table: the embedding's on the first stage, the head's on the last."""
    inner: Any = getattr(model, "module", model)  # DDP keeps the model as .module
    if inner.embed is not None:
        return inner.embed.tokens.weight
    if inner.head is not None:
        return inner.head.output.weight
    return None


def sync_tied_gradients(model: nn.Module, stage_group: dist.ProcessGroup) -> None:
    """Pipeline stages: add the first stage's and the last stage's gradients of the token table.

    Both hold the same dp shard of it (same dp coordinate): one all-reduce over the two stages (pp = 2 here:
    with more stages, the first and last would need a group of their own).
    """
    table = tied_table(model)
    if table is None or table.grad is None:
        raise ValueError("this stage holds no copy of the token table, or backward did not reach it")
    dist.all_reduce(local_tensor(table.grad), group=stage_group)
