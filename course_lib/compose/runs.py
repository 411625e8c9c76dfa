"""Published runs against the planner's step-time model and MFU; FSDP traffic costs only what exceeds compute."""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.compose.planner import (
    A100_NODES,
    GPT3_175B,
    H100_NODES,
    LLAMA31_8B,
    MEGATRON_1T,
    Cluster,
    ModelShape,
    collectives_per_step,
    flops_per_token,
    microbatches,
    plan,
)

RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1}


@dataclass(frozen=True)
class Run:
    """A training run as a paper reports it: the model, the layout, and the throughput it measured."""

    name: str
    model: ModelShape
    cluster: Cluster
    dp: int
    tp: int
    pp: int
    global_batch: int  # sequences per step
    recompute: str  # "full": the forward runs again in backward (Megatron's 2021 runs)
    zero_stage: int  # 0: gradients all-reduced (Megatron); 3: FSDP
    published_mfu: float  # model FLOPs per second over the peak, from the paper's own figures
    source: str


def megatron_mfu(tflops_per_gpu: float, m: ModelShape, peak_tflops: float) -> float:
    """MFU from Megatron's TFLOP/s per GPU, which count the recomputed forward too (Narayanan et al. 2021, eq. 3)."""
    layers, h, s = m.n_layers, m.d_model, m.seq
    counted = 96 * layers * h * h + 16 * layers * h * s + 6 * m.vocab * h
    return tflops_per_gpu / peak_tflops * flops_per_token(m) / counted


PUBLISHED = [
    Run(
        "GPT-3 175B, Megatron",
        GPT3_175B,
        A100_NODES,
        8,
        8,
        16,
        1536,
        "full",
        0,
        megatron_mfu(140, GPT3_175B, 312),
        "Narayanan et al. 2021 (arXiv:2104.04473), section 5.1: 1,024 A100, batch 1,536, 140 TFLOP/s per GPU",
    ),
    Run(
        "GPT 1T, Megatron",
        MEGATRON_1T,
        A100_NODES,
        6,
        8,
        64,
        3072,
        "full",
        0,
        megatron_mfu(163, MEGATRON_1T, 312),
        "Narayanan et al. 2021 (arXiv:2104.04473), Table 1: 3,072 A100, batch 3,072, 163 TFLOP/s per GPU",
    ),
    Run(
        "Llama 3.1 8B, torchtitan",
        LLAMA31_8B,
        H100_NODES,
        8,
        1,
        1,
        8,
        "selective",
        3,
        5762 * 5.79e10 / 989e12,
        "torchtitan, docs/performance.md: 8 H100, FSDP, 5,762 tokens/s per GPU",
    ),
]


def predicted_step(run: Run, virtual_stages: int = 1) -> dict[str, float]:
    """Seconds per step, by part, and the predicted MFU, under the module's model."""
    m, c = run.model, run.cluster
    gpus = run.dp * run.tp * run.pp
    n_mb = microbatches(run.global_batch, run.dp, m.micro_batch)
    model_flops = flops_per_token(m) * run.global_batch * m.seq
    rerun = 4 / 3 if run.recompute == "full" else 1
    compute = model_flops * rerun / gpus / (c.peak_TFLOPs * 1e12 * c.matmul_efficiency)
    r = plan(
        m,
        run.dp,
        run.tp,
        run.pp,
        c,
        virtual_stages=virtual_stages,
        global_batch=run.global_batch,
        zero_stage=run.zero_stage,
        recompute=run.recompute,
    )
    calls = collectives_per_step(m, run.dp, run.tp, run.pp, n_mb, zero_stage=run.zero_stage)
    across_dp = run.tp * run.dp > c.gpus_per_node
    dp_latency = c.inter_latency_s if across_dp else c.intra_latency_s
    tp_steps = calls.get("tp all_reduce", 0) * rerun * RING_STEPS["all_reduce"](run.tp)
    dp_steps = sum(n * RING_STEPS[op[3:]](run.dp) for op, n in calls.items() if op.startswith("dp "))
    pp_link = c.inter_node_GBps if run.tp * run.dp * run.pp > c.gpus_per_node else c.intra_node_GBps
    parts = {
        "compute_s": compute,
        "bubble_s": compute * r["bubble"] / (1 - r["bubble"]),  # (pp - 1) / (v x micro-batches) of the compute
        "tp_s": r["tp_s"] + tp_steps * c.intra_latency_s,
        "pp_s": r["pp_comm_GB"] / run.tp / pp_link + (2 * n_mb * c.inter_latency_s if run.pp > 1 else 0.0),
        "dp_s": r["dp_s"] + dp_steps * dp_latency,
    }
    parts["dp_exposed_s"] = parts["dp_s"] if run.zero_stage == 0 else max(0.0, parts["dp_s"] - compute)
    step = sum(parts[k] for k in ("compute_s", "bubble_s", "tp_s", "pp_s", "dp_exposed_s"))
    return {**parts, "step_s": step, "mfu": model_flops / (step * gpus * c.peak_TFLOPs * 1e12)}


def published_table(runs: list[Run] = PUBLISHED) -> str:
    """Each run's layout, its published MFU and the model's, and where the model's step time goes."""
    lines = [
        f"{'run':<26} {'GPUs':>5} {'dp tp pp':>9} {'published':>9} {'model':>6}  {'compute':>7} {'bubble':>6}"
        f" {'TP':>5} {'PP':>5} {'DP':>5}  (share of the model's step; DP: what the compute does not hide)"
    ]
    for run in runs:
        p = predicted_step(run)
        share = {k: p[f"{k}_s"] / p["step_s"] for k in ("compute", "bubble", "tp", "pp", "dp_exposed")}
        layout = f"{run.dp} {run.tp} {run.pp}"
        lines.append(
            f"{run.name:<26} {run.dp * run.tp * run.pp:>5} {layout:>9} {run.published_mfu:>9.1%} {p['mfu']:>6.1%}  "
            + " ".join(
                f"{share[k]:>{w}.0%}"
                for k, w in (("compute", 7), ("bubble", 6), ("tp", 5), ("pp", 5), ("dp_exposed", 5))
            )
        )
    return "\n".join(lines)
