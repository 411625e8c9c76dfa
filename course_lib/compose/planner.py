"""Kernel-only planner: memory, bytes, time per GPU for (dp, tp, pp, cp, v) of Llama 3 or Megatron's runs on H100 or
A100 nodes; bytes follow comms.RING, as ranks count."""

from __future__ import annotations

from dataclasses import dataclass, replace

from course_lib.activations import KORTHIKANTI_TERMS, korthikanti_terms
from course_lib.comms import sent_per_rank
from course_lib.fsdp import fsdp_collectives
from course_lib.memory import GB, zero_bytes_per_gpu
from course_lib.models import ModelShape, flops_per_token, outer_parameters, parameters
from course_lib.pipeline import ideal_bubble

LOSS_BYTES = 4  # the logits the loss keeps: Megatron and torchtitan upcast them to fp32 for the cross-entropy
CP_GRAD_BYTES = 4  # torch's ring attention sends dK/dV in fp32 (_cp_options.convert_to_f32 is True by default)

LLAMA_70B = ModelShape(  # Llama 3 70B (Meta's params.json), at its 8,192-token pre-training context
    None, 80, 8192, 64, 8192, kv_heads=8, d_ff=28672, glu=True, vocab=128256, tied=False, dropout=False
)
LLAMA31_8B = ModelShape(
    None, 32, 4096, 32, 8192, kv_heads=8, d_ff=14336, glu=True, vocab=128256, tied=False, dropout=False
)
GPT3_175B = ModelShape(None, 96, 12288, 96, 2048, vocab=51200)
MEGATRON_1T = ModelShape(None, 128, 25600, 160, 2048, vocab=51200)


@dataclass(frozen=True)
class Cluster:
    """GPUs per node, and one GPU's bandwidth inside a node (NVLink) and between nodes (InfiniBand)."""

    gpus_per_node: int = 8
    intra_node_GBps: float = 450.0
    inter_node_GBps: float = 50.0
    peak_TFLOPs: float = 989.0  # dense 16-bit matmuls (H100 SXM)
    # the step-time model's assumptions: start-up time of one collective step, and the fraction of the peak that
    # the layers' matmuls reach (large GEMMs; attention kernels and element-wise work reach less)
    intra_latency_s: float = 5e-6
    inter_latency_s: float = 10e-6
    matmul_efficiency: float = 0.7


H100_NODES = Cluster()  # 8 H100 per node: NVLink 4 inside, one 400 Gb/s InfiniBand link per GPU between nodes
# 8 A100 80GB per node (Selene): NVLink 3 (300 GB/s each way), 8 x 200 Gb/s HDR InfiniBand per node
A100_NODES = Cluster(intra_node_GBps=300.0, inter_node_GBps=25.0, peak_TFLOPs=312.0, matmul_efficiency=0.8)


def activation_bytes_per_layer(
    m: ModelShape, tp: int, sequence_parallel: bool = True, recompute: str = "none", attention: str = "sdpa"
) -> float:
    """16-bit bytes a layer keeps per micro-batch: Korthikanti et al.'s terms fitted to GQA, SwiGLU and torch's SP."""
    s, b, h = m.seq, m.micro_batch, m.d_model
    if recompute == "full":
        return 2 * s * b * h / (tp if sequence_parallel else 1)
    keep_scores = attention == "eager" and recompute != "selective"
    hidden = m.ffn / (4 * h) * (1.5 if m.glu else 1)  # the paper's MLP keeps two tensors of 4h
    scale = {
        "attention: Q and K, for QKᵀ": (1 + m.kv_ratio) / 2,
        "attention: V": m.kv_ratio,
        "MLP: GeLU input": hidden,
        "MLP: second linear input": hidden,
        "attention: dropout mask": float(m.dropout),
        "MLP: dropout mask": float(m.dropout),
    }
    gathered = ("attention: QKV input (LayerNorm output)", "MLP: first linear input")  # whole under torch's SP
    sequence_split = {name for name, _, _, split in KORTHIKANTI_TERMS if not split and name not in gathered}
    terms = korthikanti_terms(s, 1, h, m.n_heads, tp, selective=not keep_scores)  # b may be fractional: times b below
    return b * sum(
        size * scale.get(name, 1.0) / (tp if sequence_parallel and name in sequence_split else 1)
        for name, size in terms.items()
    )


def microbatches(global_batch: int, dp: int, micro_batch: float) -> int:
    """Micro-batches per dp rank and step: the global batch over dp replicas, micro_batch sequences each."""
    return max(1, round(global_batch / (dp * micro_batch)))


def in_flight(pp: int, virtual_stages: int = 1) -> float:
    """Micro-batches alive at 1F1B's peak on the first stage, in L/pp-layer units (Korthikanti et al. 2022, 4.2.3)."""
    return pp * (1 + (pp - 1) / (pp * virtual_stages)) if virtual_stages > 1 else pp


def _pipelining_choices(
    pp: int, reshard_after_backward: bool | None, defer_grad_sync: bool | None
) -> tuple[bool, bool]:
    """FSDP's choices where not given: its defaults, or with pp > 1 what pipelining sets on a stage (stage.py)."""
    piped = pp > 1
    return (
        not piped if reshard_after_backward is None else reshard_after_backward,
        piped if defer_grad_sync is None else defer_grad_sync,
    )


def collectives_per_step(
    m: ModelShape,
    dp: int,
    tp: int,
    pp: int,
    n_mb: int,
    *,
    cp: int = 1,
    zero_stage: int = 3,
    reshard_after_forward: bool = True,
    reshard_after_backward: bool | None = None,
    defer_grad_sync: bool | None = None,
) -> dict[str, int]:
    """Collective calls one GPU issues per step for its stage's L/pp layers, by mesh dimension ("dp all_gather"):
    FSDP's :func:`fsdp_collectives` per unit (one unit per layer) over dp x cp (torchtitan shards over both), and
    `m.tp_all_reduces` activation all-reduces per layer and micro-batch over tp. A dimension of one rank issues
    none. The FSDP choices default as in :func:`plan` (pipelining's where pp > 1). Notebook 13 asserts these counts
    against simulated ranks."""
    reshard_after_backward, defer_grad_sync = _pipelining_choices(pp, reshard_after_backward, defer_grad_sync)
    layers = m.n_layers // pp
    calls = {}
    if dp * cp > 1:
        per_unit = fsdp_collectives(n_mb, zero_stage, reshard_after_forward, reshard_after_backward, defer_grad_sync)
        calls.update({f"dp {op}": layers * n for op, n in per_unit.items() if n})
    if tp > 1:
        calls["tp all_reduce"] = layers * m.tp_all_reduces * n_mb
    return dict(sorted(calls.items()))


def step_time(r: dict[str, float]) -> float:
    """Seconds per step: compute stretched by the bubble, plus what communication cannot hide.

    TP's all-reduces and CP's K/V exchanges sit on the critical path (attention and the next matmul need them):
    counted exposed, the worst case (async TP and the ring's overlap hide part of them on GPUs). FSDP's gathers
    are prefetched one unit ahead and its reduce-scatters run during the backward of earlier units, and PP
    sends overlap other micro-batches' compute: hidden as long as compute lasts longer (its bubble stays).
    """
    hidden = r["dp_s"] + r["pp_s"]
    return r["compute_s"] / (1 - r["bubble"]) + r["tp_s"] + r["cp_s"] + max(0.0, hidden - r["compute_s"])


def plan(
    m: ModelShape,
    dp: int,
    tp: int,
    pp: int,
    cluster: Cluster = H100_NODES,
    *,
    cp: int = 1,
    virtual_stages: int = 1,
    global_batch: int = 1024,
    zero_stage: int = 3,
    sequence_parallel: bool = True,
    recompute: str = "none",
    attention: str = "sdpa",
    reshard_after_forward: bool = True,
    reshard_after_backward: bool | None = None,
    defer_grad_sync: bool | None = None,
    bytes_per_value: int = 2,
    reduce_bytes_per_value: int = 4,
    mfu: float = 0.4,
) -> dict[str, float]:
    """Memory (GB), bytes sent (GB) and their time per GPU and step on a (pp, dp, cp, tp) mesh, tp inside a node."""
    if tp > cluster.gpus_per_node:
        raise ValueError(f"tp={tp} spans nodes: keep tensor parallelism inside a node (tp <= {cluster.gpus_per_node})")
    if m.n_layers % (pp * virtual_stages):
        raise ValueError(f"{m.n_layers} layers do not split into pp={pp} x v={virtual_stages} equal stages")
    if cp > 1 and attention != "sdpa":
        raise ValueError("context parallelism runs torch's fused SDPA kernels only (attention='sdpa')")
    reshard_after_backward, defer_grad_sync = _pipelining_choices(pp, reshard_after_backward, defer_grad_sync)
    n_mb = microbatches(global_batch, dp, m.micro_batch)
    shard = dp * cp  # FSDP's group
    calls = collectives_per_step(m, dp, tp, pp, n_mb, cp=cp, zero_stage=zero_stage)
    local = replace(m, seq=m.seq // cp)  # what one cp rank computes on
    layer_params = (parameters(m) - outer_parameters(m)) / m.n_layers
    per_layer = activation_bytes_per_layer(local, tp, sequence_parallel, recompute, attention)
    one_layer = activation_bytes_per_layer(local, tp, sequence_parallel, "none", attention)
    tokens = local.seq * m.micro_batch
    sp = tp if sequence_parallel else 1
    stages = []
    for first, last in dict.fromkeys([(True, pp == 1), (pp == 1, True)]):
        tables = first + (last and (not m.tied or not first))  # embedding, head (a tied head's copy on the last)
        final_norm = m.d_model if last and m.vocab else 0  # whole on every tp rank
        params = (m.n_layers / pp * layer_params + tables * m.vocab * m.d_model) / tp + final_norm
        layers_alive = m.n_layers / pp * (in_flight(pp, virtual_stages) if first else 1)
        activations = layers_alive * per_layer + (one_layer if recompute == "full" else 0.0)
        output = tokens * (2 * m.d_model / sp + 2 * m.d_model + LOSS_BYTES * m.vocab / tp) if last and m.vocab else 0.0
        state = zero_bytes_per_gpu(params, shard, zero_stage)
        kept = 0.0  # what the choices keep whole between micro-batches: gathered params, unsharded gradients
        if zero_stage == 3 and not (reshard_after_forward and reshard_after_backward):
            kept += params * 2 * (shard - 1) / shard
        if zero_stage >= 2 and defer_grad_sync:
            kept += params * 4 * (shard - 1) / shard  # fp32 gradients accumulate unsharded
        total = state["total"] + kept + activations + output
        stages.append((total, params, state, kept, activations, output))
    total, params, state, kept, activations, output = max(stages, key=lambda stage: stage[0])

    rerun = recompute == "full"
    act_msg = tokens * m.d_model * bytes_per_value  # one activation tensor of a micro-batch on one cp rank
    tp_calls = calls.get("tp all_reduce", 0) * (1.5 if rerun else 1)  # the rerun forward's again
    tp_bytes = tp_calls * sent_per_rank("all_reduce", act_msg, tp)
    kv = 2 * m.seq * m.micro_batch * m.d_model * m.kv_ratio  # K and V values of a whole sequence, per layer
    cp_per_layer = kv * (cp - 1) / cp * bytes_per_value * (3 if rerun else 2) + kv * CP_GRAD_BYTES
    cp_bytes = m.n_layers / pp * n_mb * cp_per_layer / tp if cp > 1 else 0.0  # tp splits the K/V heads
    per_unit = fsdp_collectives(n_mb, zero_stage, reshard_after_forward, reshard_after_backward, defer_grad_sync)
    dp_bytes = (
        per_unit["all_gather"] * sent_per_rank("all_gather", params * bytes_per_value, shard)
        + (per_unit["reduce_scatter"] + 2 * per_unit["all_reduce"])
        * sent_per_rank("reduce_scatter", params * reduce_bytes_per_value, shard)
        if shard > 1
        else 0.0
    )
    pp_bytes = 2 * (virtual_stages * pp - 1) / pp * act_msg * n_mb  # mean per GPU: sends cross v·pp - 1 boundaries
    intra, inter = cluster.intra_node_GBps, cluster.inter_node_GBps
    node = cluster.gpus_per_node
    cp_link = intra if tp * cp <= node else inter
    dp_link = intra if tp * cp * dp <= node else inter
    pp_link = intra if tp * cp * dp * pp <= node else inter
    gpus = dp * tp * pp * cp
    flops = flops_per_token(m) * (4 / 3 if rerun else 1) * global_batch * m.seq
    return {
        "dp": dp,
        "tp": tp,
        "pp": pp,
        "cp": cp,
        "v": virtual_stages,
        "gpus": gpus,
        "microbatches": n_mb,
        "params_GB": state["params"] / GB,
        "grads_GB": state["grads"] / GB,
        "optimizer_GB": state["optimizer"] / GB,
        "kept_GB": kept / GB,
        "activations_GB": activations / GB,
        "output_GB": output / GB,
        "memory_GB": total / GB,
        "tp_comm_GB": tp_bytes / GB,
        "cp_comm_GB": cp_bytes / GB,
        "dp_comm_GB": dp_bytes / GB,
        "pp_comm_GB": pp_bytes / GB,
        "tp_s": tp_bytes / (intra * GB),
        "cp_s": cp_bytes / (cp_link * GB),
        "dp_s": dp_bytes / (dp_link * GB),
        "pp_s": pp_bytes / (pp_link * GB),
        "compute_s": flops / (gpus * cluster.peak_TFLOPs * 1e12 * mfu),
        "bubble": ideal_bubble(pp, n_mb, virtual_stages),
    }
