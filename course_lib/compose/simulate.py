"""N-rank layouts in one process on torch's fake backend: real shards and calls, fake values; a fake recv is empty."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from course_lib import comms
from course_lib.compose.parallelize import Dims, apply_fsdp, apply_tp, loss_fn, make_batch, make_model, stage_blocks
from course_lib.launch.runtime import fake_rank


@dataclass(frozen=True)
class Shard:
    """One rank's local shape of a parameter, and on how many ranks of its stage that shard is replicated."""

    shape: tuple[int, ...]
    copies: int


def parallelized_stage(dims: Dims, n_blocks: int) -> tuple[nn.Sequential, DeviceMesh, int]:
    """This rank's stage with TP over "tp" and FSDP over "dp" as notebook 13 builds it; its mesh; its first block."""
    mesh = dims.build_mesh()
    stage = mesh["pp"].get_local_rank()
    blocks = stage_blocks(make_model(n_blocks), stage, dims.pp)
    return apply_fsdp(apply_tp(blocks, mesh["tp"]), mesh["dp"]), mesh, stage * len(blocks)


def shard_shapes(dims: Dims, n_blocks: int = 4) -> list[dict[str, Shard]]:
    """Every rank's shard of every parameter of its stage (named as in the whole model), rank by rank."""
    ranks = []
    for rank in range(dims.world):
        with fake_rank(rank, dims.world):
            blocks, _, first = parallelized_stage(dims, n_blocks)
            shards = {}
            for name, param in blocks.named_parameters():
                assert isinstance(param, DTensor)
                index, rest = name.split(".", 1)
                replicated = [n for n, p in zip(param.device_mesh.shape, param.placements) if isinstance(p, Replicate)]
                # a parameter TP leaves whole has a mesh without "tp": it is replicated over tp too
                copies = math.prod(replicated) * dims.dp * dims.tp // param.device_mesh.size()
                shards[f"{int(index) + first}.{rest}"] = Shard(tuple(param.to_local().shape), copies)
            ranks.append(shards)
    return ranks


def stage_step(blocks: nn.Sequential, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], pipelined: bool) -> None:
    """One training step of an FSDP stage. Alone: forward and backward per micro-batch, FSDP's defaults.
    In a pipeline: GPipe's order, all forwards then all backwards, with the FSDP choices pipelining makes (stage.py)
    and turns back on for the last backward."""
    if not pipelined:
        for x, y in micro_batches:
            loss_fn(blocks(x), y).backward()
        return
    blocks.set_reshard_after_backward(False)  # type: ignore[operator]
    blocks.set_requires_gradient_sync(False)  # type: ignore[operator]
    outputs = [blocks(x) for x, _ in micro_batches]
    for i, (out, (_, y)) in enumerate(zip(outputs, micro_batches)):
        if i == len(outputs) - 1:
            blocks.set_reshard_after_backward(True)  # type: ignore[operator]
            blocks.set_requires_gradient_sync(True)  # type: ignore[operator]
        loss_fn(out, y).backward()


@dataclass(frozen=True)
class StageStep:
    """A stage's first rank's step: collective calls by "dim op", bytes sent by dimension (as Recorder.by_dimension)."""

    calls: dict[str, int]
    sent: dict[str, float]


def step_collectives(dims: Dims, n_mb: int, global_batch: int, n_blocks: int = 4) -> list[StageStep]:
    """One training step of `n_mb` micro-batches per dp rank, simulated on the first rank of every stage (the
    other ranks of a stage run the same program on other shards: the same calls)."""
    steps = []
    for stage in range(dims.pp):
        with fake_rank(stage * dims.dp * dims.tp, dims.world):
            blocks, mesh, _ = parallelized_stage(dims, n_blocks)
            x, y = make_batch(global_batch)
            d = mesh["dp"].get_local_rank()
            x_d, y_d = x.tensor_split(dims.dp)[d], y.tensor_split(dims.dp)[d]
            micro_batches = list(zip(x_d.tensor_split(n_mb), y_d.tensor_split(n_mb)))
            if stage > 0:  # a later stage's input comes from the previous stage, which needs its gradient
                micro_batches = [(x_m.requires_grad_(), y_m) for x_m, y_m in micro_batches]
            with comms.Recorder() as recorder:
                stage_step(blocks, micro_batches, pipelined=dims.pp > 1)
            steps.append(StageStep(_calls_by_dimension(recorder, mesh), recorder.by_dimension(mesh)))
    return steps


def _calls_by_dimension(recorder: comms.Recorder, mesh: DeviceMesh) -> dict[str, int]:
    names = mesh.mesh_dim_names or ()  # the course's meshes are always named (Dims.mesh)
    groups = {tuple(dist.get_process_group_ranks(mesh[name].get_group())): name for name in names}
    calls: dict[str, int] = {}
    for (op, ranks), (n, _) in recorder.per_group().items():
        calls[f"{groups[ranks]} {op}"] = calls.get(f"{groups[ranks]} {op}", 0) + n
    return dict(sorted(calls.items()))
