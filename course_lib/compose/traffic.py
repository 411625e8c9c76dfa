"""Bytes each rank sends in a step, counted from the collectives torch really runs (for notebook 11).

:class:`CountBytes` is a TorchDispatchMode: every c10d or functional collective dispatched while it is
active passes through it (FSDP2's all-gathers and reduce-scatters, DTensor's all-reduces for tensor
parallelism, the pipeline's sends), with its tensors and group. It adds up the bytes this rank sends
under the planner's ring convention, by parallelism: "dp" (all-gather, reduce-scatter), "tp"
(all-reduce of activations) and "pp" (send). In these programs each parallelism uses only its own kind
of collective, so the kind names the mesh dimension.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib.compose.planner import Cluster, ModelShape, plan
from course_lib.memory import GB


def _group_size(name_or_group: Any) -> int:
    if isinstance(name_or_group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(cast(Any, name_or_group)).size()  # a group name as the op carries it
    if isinstance(name_or_group, torch.ScriptObject):  # c10d.allreduce_ (DDP's buckets, a new_group) boxes it
        import torch.distributed as dist

        return dist.ProcessGroup.unbox(name_or_group).size()
    return name_or_group.size()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def sent_bytes(op: str, args: tuple) -> tuple[str, float] | None:
    """(dimension, bytes this rank sends) for one dispatched collective, None for anything else.

    Ring convention: all-gather and reduce-scatter send (n-1)/n of the full tensor, all-reduce twice that.
    """
    if op in ("c10d._allgather_base_", "c10d._reduce_scatter_base_"):
        output, input = args[0], args[1]
        full = output if op.endswith("allgather_base_") else input
        n = max(output.numel(), input.numel()) // min(output.numel(), input.numel())
        return "dp", (n - 1) / n * _nbytes(full)
    if op == "_c10d_functional.all_reduce":
        n = _group_size(args[2])
        return "tp", 2 * (n - 1) / n * _nbytes(args[0])
    if op == "c10d.allreduce_":
        n = _group_size(args[1])
        return "dp", 2 * (n - 1) / n * sum(_nbytes(t) for t in args[0])
    if op == "c10d.send":
        return "pp", float(sum(_nbytes(t) for t in args[0]))
    return None


class CountBytes(TorchDispatchMode):
    """``with CountBytes() as sent:`` ... then ``sent.bytes["dp"]``, ``sent.calls["dp"]`` on this rank."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()
        self.ops: Counter = Counter()  # calls by op: c10d._allgather_base_, c10d._reduce_scatter_base_, ...

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace in ("c10d", "_c10d_functional"):
            op = f"{func.namespace}.{func._opname}"
            counted = sent_bytes(op, args)
            if counted is not None:
                self.ops[op] += 1
                dim, sent = counted
                self.bytes[dim] += sent
                self.calls[dim] += 1
        return func(*args, **(kwargs or {}))

    def totals(self) -> dict[str, float]:
        """Bytes sent per dimension (0 for one that sent nothing)."""
        return {dim: float(self.bytes[dim]) for dim in ("tp", "dp", "pp")}


def course_model_shape(n_blocks: int, micro_batch: float, seq: int = 6) -> ModelShape:
    """The planner's view of notebook 11's model: `n_blocks` of the course's blocks (48 wide, 12 heads)."""
    from course_lib.models import TransformerBlock

    per_block = sum(p.numel() for p in TransformerBlock().parameters())
    return ModelShape(n_blocks * per_block, n_blocks, 48, 12, seq, micro_batch, tp_all_reduces=6)


def predicted_traffic(
    n_blocks: int, dp: int, tp: int, pp: int, n_mb: int, global_batch: int, **choices: Any
) -> dict[str, float]:
    """The planner's bytes per GPU per step (fp32, as the ranks train) for the course's model, by dimension."""
    shape = course_model_shape(n_blocks, micro_batch=global_batch / (dp * n_mb))
    r = plan(
        shape, dp, tp, pp, Cluster(gpus_per_node=max(tp, 1)), global_batch=global_batch, bytes_per_value=4, **choices
    )
    return {dim: r[f"{dim}_comm_GB"] * GB for dim in ("tp", "dp", "pp")}


def compare_traffic(layout: str, predicted: dict[str, float], measured: dict[str, float]) -> tuple[float, str]:
    """The largest relative error over the dimensions, and a line: predicted vs counted bytes per GPU."""
    errors, parts = [], []
    for dim in ("tp", "dp", "pp"):
        p, m = predicted[dim], measured[dim]
        errors.append(abs(p - m) / m if m else float(p != 0))
        parts.append(f"{dim.upper()} {p / 1e3:7.1f} vs {m / 1e3:7.1f} kB")
    return max(errors), f"{layout:<34} " + " | ".join(parts) + f"  (max error {max(errors):.1%})"
