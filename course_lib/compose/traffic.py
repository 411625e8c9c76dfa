"""Bytes each rank sends in a step, and its collective calls: the planner's prediction for notebook 11's model, and
its comparison with what the ranks counted (``comms.Recorder.by_dimension(mesh)``: every collective charged to the
mesh dimension whose group it ran on, under the ring cost model the planner uses).
"""

from __future__ import annotations

from typing import Any

from course_lib.compose.planner import Cluster, ModelShape, collectives_per_step, plan
from course_lib.memory import GB


def course_model_shape(n_blocks: int, micro_batch: float, seq: int = 6) -> ModelShape:
    """The planner's view of notebook 11's model: `n_blocks` of the course's blocks (models.BLOCK)."""
    from course_lib.models import BLOCK, TransformerBlock

    per_block = sum(p.numel() for p in TransformerBlock().parameters())
    return ModelShape(n_blocks * per_block, n_blocks, BLOCK.d_model, BLOCK.n_heads, seq, micro_batch, tp_all_reduces=6)


def predicted_traffic(
    n_blocks: int, dp: int, tp: int, pp: int, n_mb: int, global_batch: int, **choices: Any
) -> dict[str, float]:
    """The planner's bytes per GPU per step (fp32, as the ranks train) for the course's model, by dimension."""
    shape = course_model_shape(n_blocks, micro_batch=global_batch / (dp * n_mb))
    r = plan(
        shape, dp, tp, pp, Cluster(gpus_per_node=max(tp, 1)), global_batch=global_batch, bytes_per_value=4, **choices
    )
    return {dim: r[f"{dim}_comm_GB"] * GB for dim in ("tp", "dp", "pp")}


def predicted_collectives(n_blocks: int, dp: int, tp: int, pp: int, n_mb: int, **choices: Any) -> dict[str, int]:
    """The planner's collective calls per GPU per step for the course's model (micro-batch size does not matter)."""
    return collectives_per_step(course_model_shape(n_blocks, micro_batch=1), dp, tp, pp, n_mb, **choices)


def compare_traffic(layout: str, predicted: dict[str, float], measured: dict[str, float]) -> tuple[float, str]:
    """The largest relative error over the dimensions, and a line: predicted vs counted bytes per GPU."""
    errors, parts = [], []
    for dim in ("tp", "dp", "pp"):
        p, m = predicted[dim], measured[dim]
        errors.append(abs(p - m) / m if m else float(p != 0))
        parts.append(f"{dim.upper()} {p / 1e3:7.1f} vs {m / 1e3:7.1f} kB")
    return max(errors), f"{layout:<34} " + " | ".join(parts) + f"  (max error {max(errors):.1%})"
