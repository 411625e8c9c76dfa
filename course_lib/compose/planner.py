"""A planner for real clusters (kernel-only): memory, bytes and time per GPU for a (dp, tp, pp) choice.

Bytes are what one GPU sends per step under a ring algorithm (``comms.RING``, the course's one cost table);
notebook 13 counts them on ranks (:mod:`.traffic`) and asserts the planner's numbers for small layouts.
"""

from __future__ import annotations

from typing import Any

from course_lib.comms import sent_per_rank
from course_lib.compose.shapes import (  # noqa: F401 (the planner's names)
    A100_NODES,
    GPT3_175B,
    H100_NODES,
    LLAMA3_70B,
    LLAMA31_8B,
    LLAMA_70B,
    MEGATRON_1T,
    Cluster,
    ModelShape,
    flops_per_token,
    parameters,
)
from course_lib.memory import GB, zero_bytes_per_gpu


def activation_bytes_per_layer(
    m: ModelShape, tp: int, sequence_parallel: bool = True, recompute: str = "none", attention: str = "sdpa"
) -> float:
    """Activations one layer keeps for backward, per micro-batch, 16-bit (Korthikanti et al. 2022, as torch runs it),
    in units of s·b·h (r = h_kv/h, f = d_ff/h; a GPT layer: r = 1, f = 4, dropout):

    whole on every tp rank: the two norms' inputs (4), the inputs of q/k/v and of the MLP (2 + 2), the two dropout
    masks (2); split over tp: q, k, v, the attention output (2 + 4r + 2), the MLP's hidden (4f, or 6f gated):
    s*b*h * (10 + 24/t) for a GPT layer
    + sequence parallel with torch's plan: the norms and masks run on s/t tokens, but the all-gathered
    norm outputs that q, k, v and the MLP's first Linear save stay whole: s*b*h * (4 + 30/t); Megatron
    all-gathers them again in backward instead and keeps 34/t
    + 5*a*s/(h*t)             attention="eager": the s x s scores kept (probabilities, dropout mask and output).
                              SDPA's fused kernels keep none, only a log-sum-exp per query; selective
                              recomputation (recompute="selective") drops them too
    2*s*b*h (/t with SP)      recompute="full": only the layer's input is kept
    """
    s, b, h, a = m.seq, m.micro_batch, m.hidden, m.heads
    if recompute == "full":
        return 2 * s * b * h / (tp if sequence_parallel else 1)
    scores = 5 * a * s / (h * tp) if attention == "eager" and recompute != "selective" else 0.0
    masks = 2 if m.dropout else 0
    split = 4 + 4 * m.kv_ratio + (6 if m.glu else 4) * m.ffn / h
    whole = 4 + 4 + masks
    linear = 4 + (whole - 4 + split) / tp if sequence_parallel else whole + split / tp
    return s * b * h * (linear + scores)


def microbatches(global_batch: int, dp: int, micro_batch: float) -> int:
    """Micro-batches per dp rank and step: the global batch over dp replicas, micro_batch sequences each."""
    return max(1, round(global_batch / (dp * micro_batch)))


def fsdp_collectives(
    n_mb: int,
    zero_stage: int = 3,
    reshard_after_forward: bool = True,
    reshard_after_backward: bool = True,
    defer_grad_sync: bool = False,
) -> dict[str, int]:
    """Data-parallel collectives per FSDP unit and step, each moving that unit's parameters (or gradients).

    ZeRO-3 gathers a unit's parameters whenever it runs while resharded: with reshard_after_forward, in
    every micro-batch's forward and again in its backward (2 per micro-batch); without it, once per
    micro-batch. reshard_after_backward=False keeps them gathered after the first backward, so the
    other micro-batches gather them only in the forward that resharded them (n_mb + 1), or never
    again (1), when micro-batches run all forwards then all backwards (GPipe) or one after the other.
    Gradients are reduce-scattered after every micro-batch's backward unless the sync is deferred to
    the last (set_requires_gradient_sync(False) before, as DDP's no_sync). ZeRO-1/2 gather the updated
    parameters once per step; ZeRO-0 (DDP) all-reduces the gradients instead.
    """
    syncs = 1 if defer_grad_sync else n_mb
    if zero_stage == 0:
        return {"all_gather": 0, "reduce_scatter": 0, "all_reduce": syncs}
    if zero_stage in (1, 2):
        return {"all_gather": 1, "reduce_scatter": syncs, "all_reduce": 0}
    if reshard_after_backward:
        gathers = n_mb * (2 if reshard_after_forward else 1)
    else:
        gathers = n_mb + 1 if reshard_after_forward else 1
    return {"all_gather": gathers, "reduce_scatter": syncs, "all_reduce": 0}


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
    zero_stage: int = 3,
    reshard_after_forward: bool = True,
    reshard_after_backward: bool | None = None,
    defer_grad_sync: bool | None = None,
) -> dict[str, int]:
    """Collective calls one GPU issues per step for its stage's L/pp layers, by mesh dimension ("dp all_gather"):
    FSDP's :func:`fsdp_collectives` per unit (one unit per layer) over dp, and `m.tp_all_reduces` activation
    all-reduces per layer and micro-batch over tp. A dimension of one rank issues none. The FSDP choices
    default as in :func:`plan` (pipelining's where pp > 1). Notebook 13 asserts these counts against simulated ranks.
    """
    reshard_after_backward, defer_grad_sync = _pipelining_choices(pp, reshard_after_backward, defer_grad_sync)
    layers = m.layers // pp
    calls = {}
    if dp > 1:
        per_unit = fsdp_collectives(n_mb, zero_stage, reshard_after_forward, reshard_after_backward, defer_grad_sync)
        calls.update({f"dp {op}": layers * n for op, n in per_unit.items() if n})
    if tp > 1:
        calls["tp all_reduce"] = layers * m.tp_all_reduces * n_mb
    return dict(sorted(calls.items()))


def step_time(r: dict[str, float]) -> float:
    """Seconds per step: compute stretched by the bubble, plus what communication cannot hide.

    TP's all-reduces sit on the critical path (the next matmul needs their sum): counted exposed, the worst case
    (async TP, on GPUs, overlaps part of them with chunks of the matmul). FSDP's gathers
    are prefetched one unit ahead and its reduce-scatters run during the backward of earlier units, and PP
    sends overlap other micro-batches' compute: hidden as long as compute lasts longer (its bubble stays).
    """
    hidden = r["dp_s"] + r["pp_s"]
    return r["compute_s"] / (1 - r["bubble"]) + r["tp_s"] + max(0.0, hidden - r["compute_s"])


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
    recompute: str = "none",
    attention: str = "sdpa",
    reshard_after_forward: bool = True,
    reshard_after_backward: bool | None = None,
    defer_grad_sync: bool | None = None,
    bytes_per_value: int = 2,
    reduce_bytes_per_value: int = 4,
    mfu: float = 0.4,
) -> dict[str, float]:
    """Memory per GPU (GB), bytes each GPU sends per step (GB) and their time at the cluster's link speeds.

    A step is global_batch / (dp x micro_batch) micro-batches per dp rank, each a forward and a backward.
    States (16 bytes/param) are split over tp x pp and sharded over dp by ZeRO `zero_stage`; activations:
    one micro-batch per layer (1F1B keeps pp micro-batches of L/pp layers on the first stage).
    Per micro-batch: TP all-reduces activations `m.tp_all_reduces` times per layer (and the forward's half again
    when recompute="full" reruns the forward); PP sends one activation
    forward and one gradient back per stage boundary. FSDP's traffic is in :func:`fsdp_collectives`:
    ZeRO-3 all-gathers parameters in every micro-batch's forward and backward and reduce-scatters
    gradients per micro-batch, unless told otherwise; parameters travel in `bytes_per_value`, gradients in
    `reduce_bytes_per_value` (fp32 by default: FSDP2's reduce_dtype in torchtitan).
    With pp > 1, `reshard_after_backward` and `defer_grad_sync` default to what torch.distributed.pipelining sets
    on an FSDP stage (stage.py: parameters kept gathered after a micro-batch's backward, one gradient sync after
    the last): False and True.
    """
    if tp > cluster.gpus_per_node:
        raise ValueError(f"tp={tp} spans nodes: keep tensor parallelism inside a node (tp <= {cluster.gpus_per_node})")
    if m.layers % pp:
        raise ValueError(f"{m.layers} layers do not split into pp={pp} equal stages")
    reshard_after_backward, defer_grad_sync = _pipelining_choices(pp, reshard_after_backward, defer_grad_sync)
    n_mb = microbatches(global_batch, dp, m.micro_batch)
    calls = collectives_per_step(
        m,
        dp,
        tp,
        pp,
        n_mb,
        zero_stage=zero_stage,
        reshard_after_forward=reshard_after_forward,
        reshard_after_backward=reshard_after_backward,
        defer_grad_sync=defer_grad_sync,
    )
    params_per_gpu = parameters(m) / (tp * pp)
    state = zero_bytes_per_gpu(params_per_gpu, dp, zero_stage)
    kept = 0.0  # what the choices keep whole between micro-batches: gathered params, unsharded gradients
    if zero_stage == 3 and not (reshard_after_forward and reshard_after_backward):
        kept += params_per_gpu * 2 * (dp - 1) / dp
    if zero_stage >= 2 and defer_grad_sync:
        kept += params_per_gpu * 4 * (dp - 1) / dp  # fp32 gradients accumulate unsharded
    activations = m.layers * activation_bytes_per_layer(m, tp, sequence_parallel, recompute, attention)
    act_msg = m.seq * m.micro_batch * m.hidden * bytes_per_value  # one activation tensor of a micro-batch
    tp_calls = calls.get("tp all_reduce", 0) * (1.5 if recompute == "full" else 1)  # the rerun forward's again
    tp_bytes = tp_calls * sent_per_rank("all_reduce", act_msg, tp)
    unit = params_per_gpu / (m.layers / pp)  # values of one FSDP unit (a layer) on this GPU
    gather = sent_per_rank("all_gather", unit * bytes_per_value, dp)
    reduce = sent_per_rank("reduce_scatter", unit * reduce_bytes_per_value, dp)
    dp_bytes = (
        calls.get("dp all_gather", 0) * gather
        + (calls.get("dp reduce_scatter", 0) + 2 * calls.get("dp all_reduce", 0)) * reduce
    )
    pp_bytes = 2 * (pp - 1) / pp * act_msg * n_mb  # mean per GPU: the end stages send one way, the others both
    intra, inter = cluster.intra_node_GBps, cluster.inter_node_GBps
    dp_link = intra if tp * dp <= cluster.gpus_per_node else inter
    pp_link = intra if tp * dp * pp <= cluster.gpus_per_node else inter
    flops = flops_per_token(m) * (4 / 3 if recompute == "full" else 1) * global_batch * m.seq
    return {
        "dp": dp,
        "tp": tp,
        "pp": pp,
        "gpus": dp * tp * pp,
        "microbatches": n_mb,
        "params_GB": state["params"] / GB,
        "grads_GB": state["grads"] / GB,
        "optimizer_GB": state["optimizer"] / GB,
        "kept_GB": kept / GB,
        "activations_GB": activations / GB,
        "memory_GB": (state["total"] + kept + activations) / GB,
        "tp_comm_GB": tp_bytes / GB,
        "dp_comm_GB": dp_bytes / GB,
        "pp_comm_GB": pp_bytes / GB,
        "tp_s": tp_bytes / (intra * GB),
        "dp_s": dp_bytes / (dp_link * GB),
        "pp_s": pp_bytes / (pp_link * GB),
        "compute_s": flops / (dp * tp * pp * cluster.peak_TFLOPs * 1e12 * mfu),
        "bubble": (pp - 1) / (n_mb + pp - 1),
    }


def plan_options(m: ModelShape, n_gpus: int, cluster: Cluster = H100_NODES, **choices: Any) -> list[dict[str, float]]:
    """Every (dp, tp, pp) of powers of two, tp inside a node, that the model's layers and heads allow, by memory.

    `choices` (global_batch=, zero_stage=, ...) go to :func:`plan` for every row."""
    rows = []
    powers = [2**k for k in range(n_gpus.bit_length())]
    for tp in powers:
        for pp in powers:
            if tp > cluster.gpus_per_node or n_gpus % (tp * pp) or m.layers % pp or m.heads % tp:
                continue
            rows.append(plan(m, n_gpus // (tp * pp), tp, pp, cluster, **choices))
    return sorted(rows, key=lambda r: r["memory_GB"])


def format_plan(rows: list[dict[str, float]]) -> str:
    """The rows of :func:`plan_options` as a table: memory per GPU, bytes per GPU per step, time per step."""
    head = (
        f"{'dp':>3} {'tp':>3} {'pp':>3} {'mb':>4} {'states':>6} {'kept':>5} {'activ':>6} {'memory':>7}"
        f" {'TP':>7} {'DP':>7} {'PP':>6} {'compute':>8} {'TP s':>6} {'DP s':>6} {'bubble':>7} {'step s':>7}"
    )
    lines = [head, " " * 17 + "(GB per GPU)" + " " * 15 + "(GB sent per GPU per step)  (seconds per step)"]
    for r in rows:
        states = r["params_GB"] + r["grads_GB"] + r["optimizer_GB"]
        lines.append(
            f"{r['dp']:>3} {r['tp']:>3} {r['pp']:>3} {r['microbatches']:>4} {states:>6.1f} {r['kept_GB']:>5.1f} "
            f"{r['activations_GB']:>6.1f} {r['memory_GB']:>7.1f} {r['tp_comm_GB']:>7.0f} {r['dp_comm_GB']:>7.0f} "
            f"{r['pp_comm_GB']:>6.1f} {r['compute_s']:>8.1f} {r['tp_s']:>6.1f} {r['dp_s']:>6.1f} "
            f"{r['bubble']:>7.1%} {step_time(r):>7.1f}"
        )
    return "\n".join(lines)
