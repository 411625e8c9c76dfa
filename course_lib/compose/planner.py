"""A planner for real clusters (kernel-only): memory and communication per GPU for a (dp, tp, pp) choice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from course_lib.memory import GB, zero_bytes_per_gpu


@dataclass
class ModelShape:
    """A transformer's size, and the sequences it trains on: `micro_batch` sequences of `seq` tokens."""

    n_params: float
    layers: int
    hidden: int
    heads: int
    seq: int = 4096
    micro_batch: int = 1


LLAMA_70B = ModelShape(n_params=70e9, layers=80, hidden=8192, heads=64)


@dataclass(frozen=True)
class Cluster:
    """GPUs per node, and one GPU's bandwidth inside a node (NVLink) and between nodes (InfiniBand)."""

    gpus_per_node: int = 8
    intra_node_GBps: float = 450.0
    inter_node_GBps: float = 50.0


H100_NODES = Cluster()  # 8 H100 per node: NVLink 4 inside, one 400 Gb/s InfiniBand link per GPU between nodes


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
    cluster: Cluster = H100_NODES,
    *,
    global_batch: int = 1024,
    zero_stage: int = 3,
    sequence_parallel: bool = True,
    recompute: str = "selective",
) -> dict[str, float]:
    """Memory per GPU (GB) and communication per GPU per step (GB, and seconds at the cluster's link speeds).

    Parameters, gradients and Adam state (mixed precision, 16 bytes/param) are split over tp x pp and
    sharded over dp by ZeRO `zero_stage`; 1F1B keeps at most pp micro-batches of activations on the first
    stage, so activations ~ layers x one micro-batch's activations per layer. TP all-reduces activations
    4 times per layer (2 forward, 2 backward); FSDP all-gathers parameters twice and reduce-scatters
    gradients once; PP sends one activation forward and one gradient back per micro-batch.
    `global_batch` sequences per step: each dp replica runs global_batch / (dp x micro_batch) micro-batches.
    """
    if tp > cluster.gpus_per_node:
        raise ValueError(f"tp={tp} spans nodes: keep tensor parallelism inside a node (tp <= {cluster.gpus_per_node})")
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
    intra, inter = cluster.intra_node_GBps, cluster.inter_node_GBps
    dp_link = intra if tp * dp <= cluster.gpus_per_node else inter
    pp_link = intra if tp * dp * pp <= cluster.gpus_per_node else inter
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
        "comm_s": tp_bytes / (intra * GB) + dp_bytes / (dp_link * GB) + pp_bytes / (pp_link * GB),
        "bubble": (pp - 1) / (n_microbatches + pp - 1),
    }


def plan_options(m: ModelShape, n_gpus: int, cluster: Cluster = H100_NODES, **choices: Any) -> list[dict[str, float]]:
    """Every (dp, tp, pp) with tp inside a node that the model's layers allow, sorted by memory.

    `choices` (global_batch=, zero_stage=, ...) go to :func:`plan` for every row."""
    rows = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if tp > cluster.gpus_per_node or n_gpus % (tp * pp) or m.layers % pp or m.heads % tp:
                continue
            rows.append(plan(m, n_gpus // (tp * pp), tp, pp, cluster, **choices))
    return sorted(rows, key=lambda r: r["memory_GB"])


def format_plan(rows: list[dict[str, float]]) -> str:
    """The rows of :func:`plan_options` as a table: memory per GPU, then communication per GPU per step."""
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
