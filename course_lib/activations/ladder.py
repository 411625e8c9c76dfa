"""The out-of-memory procedure's first and last steps: estimate bytes per GPU, then climb the ladder of fixes.

estimate = parameters + gradients + optimizer state (`memory.zero_bytes_per_gpu`, ZeRO's model)
         + activations (`formulas.course_block_terms` per layer, times the layers, under a recomputation mode).

Each rung keeps the previous ones and changes one thing, cheapest first; its cost is what it trades for memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from course_lib.activations.formulas import course_block_bytes, selective_block_bytes, stack_bytes
from course_lib.memory import GB, zero_bytes_per_gpu


@dataclass(frozen=True)
class Setup:
    """A GPT-like stack of course TransformerBlocks (d_ff = 4h), trained with bf16 mixed precision and Adam."""

    hidden: int = 4096
    heads: int = 32
    layers: int = 32
    seq: int = 4096
    micro_batch: int = 4
    gpus: int = 8
    recompute: str = "none"  # none | selective | full
    zero_stage: int = 0
    offload_optimizer: bool = False
    tensor_parallel: int = 1  # with sequence parallelism

    @property
    def parameters(self) -> float:
        return 12 * self.hidden**2 * self.layers  # attention 4h² + feed-forward 8h² per layer


def estimate(setup: Setup, element_bytes: int = 2, stats_bytes: int = 4) -> dict[str, float]:
    """Bytes per GPU: parameters, gradients, optimizer state (ZeRO stage over the data-parallel GPUs) and activations.

    Tensor parallelism divides the model states by t before ZeRO shards them over gpus / t data-parallel ranks.
    Activations are the peak of `formulas.stack_bytes`: 16-bit, flash attention, fp32 LayerNorm statistics (CUDA).
    """
    t = setup.tensor_parallel
    states = zero_bytes_per_gpu(setup.parameters / t, setup.gpus // t, setup.zero_stage)
    if setup.offload_optimizer:
        states["optimizer"] = 0.0  # lives in CPU memory; the CPU runs the Adam step
    s, b, h = setup.seq, setup.micro_batch, setup.hidden
    shape: dict[str, Any] = {"h": h, "a": setup.heads, "d_ff": 4 * h, "element_bytes": element_bytes}
    per_layer = course_block_bytes(s, b, **shape, stats_bytes=stats_bytes, t=t, sequence_parallel=True)
    block_input = element_bytes * s * b * h / t
    selective = selective_block_bytes(s, b, h, setup.heads, 4 * h, element_bytes=element_bytes) / t
    activations = stack_bytes(per_layer, setup.layers, block_input, setup.recompute, selective)["peak"]
    out = {
        "params": states["params"],
        "grads": states["grads"],
        "optimizer": states["optimizer"],
        "activations": activations,
    }
    out["total"] = sum(out.values())
    return out


RUNGS: list[tuple[str, dict[str, Any], str]] = [
    (
        "smaller micro-batch (4 -> 1)",
        {"micro_batch": 1},
        "4x the accumulation steps; smaller matmuls run less efficiently",
    ),
    ("full recomputation", {"recompute": "full"}, "one more forward per step: about +33% compute"),
    ("ZeRO-3 / FSDP over the GPUs", {"zero_stage": 3}, "all-gathers every layer's weights twice: 1.5x DDP's traffic"),
    ("offload the optimizer state", {"offload_optimizer": True}, "states cross PCIe every step; the CPU runs Adam"),
    ("tensor + sequence parallel (t = 8)", {"tensor_parallel": 8}, "collectives inside every layer: NVLink only"),
]


def ladder(setup: Setup, gpu_bytes: float = 80 * GB) -> list[dict[str, Any]]:
    """The baseline, then each rung of RUNGS applied on top of the previous ones: bytes per GPU, fits, cost."""
    rows: list[dict[str, Any]] = [{"rung": "baseline (DDP)", "setup": setup, **estimate(setup), "cost": "-"}]
    for name, change, cost in RUNGS:
        setup = replace(setup, **change)
        rows.append({"rung": name, "setup": setup, **estimate(setup), "cost": cost})
    for row in rows:
        row["fits"] = row["total"] <= gpu_bytes
    return rows
