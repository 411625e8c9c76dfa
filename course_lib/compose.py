"""Notebook 09: composing data, tensor and pipeline parallelism on one DeviceMesh.

The rank grid is built in one place (:func:`rank_grid` by hand, :func:`build_mesh` with
init_device_mesh); each parallelism is a function applied to a model over a mesh dimension
(:func:`apply_tp`, :func:`apply_fsdp`, :func:`pipeline_stage`); :func:`plan` estimates memory and
communication per GPU for a (dp, tp, pp) choice on a real cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from course_lib.compare import grad_of
from course_lib.exercises import ExerciseFailed, expect_equal
from course_lib.memory import GB, zero_bytes_per_gpu
from course_lib.models import TransformerBlock
from course_lib.tensor_parallel import tp_plan

DIMS = ("pp", "dp", "tp")  # outermost to innermost: tp varies fastest, so a TP group sits inside one node


# ---- the rank grid ------------------------------------------------------------------------------


def coordinates(rank: int, pp: int, dp: int, tp: int) -> dict[str, int]:
    """Where `rank` sits in a (pp, dp, tp) grid laid out row-major: rank = (p * dp + d) * tp + t."""
    return {"pp": rank // (dp * tp), "dp": rank // tp % dp, "tp": rank % tp}


def rank_grid(world_size: int, pp: int, dp: int, tp: int) -> dict[str, list[list[int]]]:
    """Every group of every dimension, by hand: the ranks that differ only in that coordinate."""
    if pp * dp * tp != world_size:
        raise ValueError(
            f"pp x dp x tp = {pp} x {dp} x {tp} = {pp * dp * tp}, but the world has {world_size} "
            f"ranks: choose sizes whose product is the world size"
        )
    groups: dict[str, dict[tuple, list[int]]] = {name: {} for name in DIMS}
    for rank in range(world_size):
        c = coordinates(rank, pp, dp, tp)
        for name in DIMS:
            key = tuple(c[other] for other in DIMS if other != name)
            groups[name].setdefault(key, []).append(rank)
    return {name: sorted(by_key.values()) for name, by_key in groups.items()}


def new_groups_by_hand(world_size: int, pp: int, dp: int, tp: int) -> dict[str, dist.ProcessGroup]:
    """The pre-DeviceMesh way: dist.new_group for every group, called by EVERY rank in the same order.

    new_group is itself a collective: a rank that skips the groups it is not in (the classic bug)
    leaves the others waiting, or silently pairs up the wrong groups.
    """
    mine = {}
    for name, groups in rank_grid(world_size, pp, dp, tp).items():
        for ranks in groups:
            group = dist.new_group(ranks)  # every rank makes every call
            if dist.get_rank() in ranks:
                mine[name] = group
    return mine


def build_mesh(pp: int, dp: int, tp: int, device_type: str = "cpu") -> DeviceMesh:
    """The same grid in one call: a 3-D DeviceMesh with named dimensions."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=DIMS)


# ---- the model and the parallelisms as functions over mesh dimensions ---------------------------


def make_model(n_blocks: int = 4, seed: int = 0) -> nn.Sequential:
    """A stack of the course's transformer blocks (48 wide, 12 heads): same weights on every rank."""
    return nn.Sequential(*[TransformerBlock(seed=seed + i) for i in range(n_blocks)])


def make_batch(
    global_batch: int = 8, seq: int = 6, d_model: int = 48, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded inputs and targets: the same on every rank and every machine."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(global_batch, seq, d_model, generator=g), torch.randn(global_batch, seq, d_model, generator=g)


def apply_tp(blocks: nn.Sequential, tp_mesh: DeviceMesh) -> nn.Sequential:
    """Tensor parallel inside every block (q/k/v/up column-wise, o/down row-wise; notebook 06)."""
    from torch.distributed.tensor.parallel import parallelize_module

    for block in blocks:
        parallelize_module(block, tp_mesh, tp_plan())
    return blocks


def apply_fsdp(blocks: nn.Sequential, dp_mesh: DeviceMesh) -> nn.Sequential:
    """FSDP2 per block, then the root (notebook 03). A 2-D mesh (replicate, shard) gives HSDP."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(blocks, mesh=dp_mesh)
    return blocks


def stage_blocks(model: nn.Sequential, pp_rank: int, pp: int) -> nn.Sequential:
    """This pipeline stage's contiguous slice of blocks (notebook 07)."""
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


def full_grads(module: nn.Module, offset: int = 0) -> dict[str, torch.Tensor]:
    """Gradients as full tensors, named as in the unsharded model (block index shifted by `offset`)."""
    out = {}
    with quiet_full_tensor():
        for name, p in module.named_parameters():
            index, rest = name.split(".", 1)
            grad = grad_of(p, name)
            if hasattr(grad, "full_tensor"):
                grad = grad.full_tensor()
            out[f"{int(index) + offset}.{rest}"] = grad.detach().cpu()
    return out


def reference_grads(n_blocks: int, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process training on the whole global batch: the loss and every gradient."""
    model = make_model(n_blocks)
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.item(), {n: grad_of(p, n).detach().clone() for n, p in model.named_parameters()}


def max_grad_difference(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two sets of gradients, over every named tensor."""
    return max((got[name] - reference[name]).abs().max().item() for name in got)


# ---- a planner for real clusters ---------------------------------------------------------------


@dataclass
class ModelShape:
    n_params: float
    layers: int
    hidden: int
    heads: int
    seq: int = 4096
    micro_batch: int = 1


LLAMA_70B = ModelShape(n_params=70e9, layers=80, hidden=8192, heads=64)


def activation_bytes_per_layer(
    m: ModelShape, tp: int, sequence_parallel: bool = True, recompute: str = "selective"
) -> float:
    """Activations one layer keeps for backward, per micro-batch, 16-bit (Korthikanti et al. 2022):

    s*b*h * (10 + 24/t + 5*a*s/(h*t))   plain tensor parallel
    s*b*h * (34/t + 5*a*s/(h*t))        + sequence parallel (norms and dropout sharded too)
    drop the 5*a*s/(h*t) term           + selective recomputation of attention scores
    2*s*b*h (/t with SP)                full recomputation: only the layer's input is kept
    """
    s, b, h, a = m.seq, m.micro_batch, m.hidden, m.heads
    if recompute == "full":
        return 2 * s * b * h / (tp if sequence_parallel else 1)
    attention_scores = 0.0 if recompute == "selective" else 5 * a * s / (h * tp)
    linear = 34 / tp if sequence_parallel else 10 + 24 / tp
    return s * b * h * (linear + attention_scores)


def plan(
    m: ModelShape,
    dp: int,
    tp: int,
    pp: int,
    gpus_per_node: int = 8,
    *,
    global_batch: int = 1024,
    intra_node_GBps: float = 450.0,
    inter_node_GBps: float = 50.0,
    zero_stage: int = 3,
    sequence_parallel: bool = True,
    recompute: str = "selective",
) -> dict[str, float]:
    """Memory per GPU (GB) and communication per GPU per step (GB, and seconds at the given link speeds).

    Parameters, gradients and Adam state (mixed precision, 16 bytes/param) are split over tp x pp and
    sharded over dp by ZeRO `zero_stage`; 1F1B keeps at most pp micro-batches of activations on the first
    stage, so activations ~ layers x one micro-batch's activations per layer. TP all-reduces activations
    4 times per layer (2 forward, 2 backward); FSDP all-gathers parameters twice and reduce-scatters
    gradients once; PP sends one activation forward and one gradient back per micro-batch.
    `global_batch` sequences per step: each dp replica runs global_batch / (dp x micro_batch) micro-batches.
    """
    if tp > gpus_per_node:
        raise ValueError(f"tp={tp} spans nodes: keep tensor parallelism inside a node (tp <= {gpus_per_node})")
    if m.layers % pp:
        raise ValueError(f"{m.layers} layers do not split into pp={pp} equal stages")
    n_microbatches = max(1, global_batch // (dp * m.micro_batch))
    params_per_gpu = m.n_params / (tp * pp)
    state = zero_bytes_per_gpu(params_per_gpu, dp, zero_stage)
    activations = m.layers * activation_bytes_per_layer(m, tp, sequence_parallel, recompute)
    act_msg = m.seq * m.micro_batch * m.hidden * 2  # one 16-bit activation tensor
    tp_bytes = (m.layers / pp) * 4 * 2 * (tp - 1) / tp * act_msg * n_microbatches
    dp_bytes = (3 if zero_stage == 3 else 2) * (dp - 1) / dp * params_per_gpu * 2
    pp_bytes = 2 * act_msg * n_microbatches if pp > 1 else 0.0
    dp_link = intra_node_GBps if tp * dp <= gpus_per_node else inter_node_GBps
    pp_link = intra_node_GBps if tp * dp * pp <= gpus_per_node else inter_node_GBps
    return {
        "dp": dp,
        "tp": tp,
        "pp": pp,
        "gpus": dp * tp * pp,
        "params_GB": state["params"] / GB,
        "grads_GB": state["grads"] / GB,
        "optimizer_GB": state["optimizer"] / GB,
        "activations_GB": activations / GB,
        "memory_GB": (state["total"] + activations) / GB,
        "tp_comm_GB": tp_bytes / GB,
        "dp_comm_GB": dp_bytes / GB,
        "pp_comm_GB": pp_bytes / GB,
        "comm_s": tp_bytes / (intra_node_GBps * GB) + dp_bytes / (dp_link * GB) + pp_bytes / (pp_link * GB),
        "bubble": (pp - 1) / (n_microbatches + pp - 1),
    }


def plan_options(m: ModelShape, n_gpus: int, gpus_per_node: int = 8, **kwargs) -> list[dict[str, float]]:
    """Every (dp, tp, pp) with tp inside a node that the model's layers allow, sorted by memory."""
    rows = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if tp > gpus_per_node or n_gpus % (tp * pp) or m.layers % pp or m.heads % tp:
                continue
            rows.append(plan(m, n_gpus // (tp * pp), tp, pp, gpus_per_node, **kwargs))
    return sorted(rows, key=lambda r: r["memory_GB"])


def format_plan(rows: list[dict[str, float]]) -> str:
    head = (
        f"{'dp':>3} {'tp':>3} {'pp':>3} {'params':>7} {'grads':>6} {'optim':>6} {'activ':>6} {'memory':>7}"
        f" {'TP comm':>8} {'DP comm':>8} {'PP comm':>8} {'comm s':>7} {'bubble':>7}"
    )
    lines = [head, " " * 12 + "(GB per GPU)" + " " * 28 + "(GB per GPU per step)"]
    for r in rows:
        lines.append(
            f"{r['dp']:>3} {r['tp']:>3} {r['pp']:>3} {r['params_GB']:>7.1f} {r['grads_GB']:>6.1f} "
            f"{r['optimizer_GB']:>6.1f} {r['activations_GB']:>6.1f} {r['memory_GB']:>7.1f} "
            f"{r['tp_comm_GB']:>8.1f} {r['dp_comm_GB']:>8.1f} {r['pp_comm_GB']:>8.2f} "
            f"{r['comm_s']:>7.2f} {r['bubble']:>7.1%}"
        )
    return "\n".join(lines)


# ---- exercise -----------------------------------------------------------------------------------


def solution_my_coordinates(rank: int, pp: int, dp: int, tp: int) -> tuple[int, int, int]:
    return rank // (dp * tp), rank // tp % dp, rank % tp


def check_my_coordinates(fn: Callable[[int, int, int, int], object]) -> None:
    """fn(rank, pp, dp, tp) -> (pp, dp, tp) coordinates must match the DeviceMesh's for every shape.

    Shapes (pp, dp, tp) with pp, dp in (1, 2, 4) and tp = world // (pp * dp); when the product is less
    than the world (5 ranks: (1, 2, 2)), the mesh takes the first pp * dp * tp ranks and the others sit
    it out, so a prime world size still tests shapes where dp and tp differ.
    """
    world = dist.get_world_size()
    me = dist.get_rank()
    shapes = [(pp, dp, world // (pp * dp)) for pp in (1, 2, 4) for dp in (1, 2, 4) if world >= pp * dp]
    for pp, dp, tp in shapes:
        size = pp * dp * tp
        mesh = DeviceMesh("cpu", torch.arange(size).view(pp, dp, tp), mesh_dim_names=DIMS)
        coordinate = mesh.get_coordinate()
        if coordinate is None:  # this rank is not in the mesh
            continue
        expected = tuple(coordinate)
        got = fn(me, pp, dp, tp)
        if not isinstance(got, tuple):
            raise ExerciseFailed(f"my_coordinates must return a tuple (pp, dp, tp), got {type(got).__name__}")
        expect_equal(f"my_coordinates({me}, pp={pp}, dp={dp}, tp={tp})", got, expected)
