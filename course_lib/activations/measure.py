"""What the notebook measures on each rank: bytes saved per layer, and what recomputation saves and costs.

Everything runs on `device` (the CPU with gloo, the rank's GPU with nccl). Bytes are counted from the tensors
(`compare.saved_activation_bytes`, `inspection.LiveBytes`) and FLOPs from the ops (`inspection.matmul_flops`),
so both are the same under any load; time is measured too, and only compared as ratios within one run.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from course_lib.activations.formulas import course_block_bytes, selective_block_bytes, stack_bytes
from course_lib.activations.inspection import LiveBytes, matmul_flops
from course_lib.compare import full_gradients, saved_activation_bytes
from course_lib.launch.runtime import seconds_in_turns
from course_lib.models import BLOCK


def attention_backend(attention: str) -> Any:
    """A context that makes scaled_dot_product_attention use the fused ("flash") or the "math" kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION if attention == "flash" else SDPBackend.MATH)


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def stats_bytes(dtype: torch.dtype, device: torch.device) -> int:
    """Bytes of LayerNorm's saved mean and 1/σ: fp32 on CUDA for 16-bit inputs, the input's dtype on the CPU."""
    return 4 if device.type == "cuda" else element_size(dtype)


def head_multiple(device: torch.device) -> int:
    """CUDA's fused attention pads each head to a multiple of 8 values; the CPU's does not."""
    return 8 if device.type == "cuda" else 1


def layer_bytes(
    s: int, b: int, *, attention: str = "flash", dtype: torch.dtype = torch.bfloat16, device: torch.device | None = None
) -> dict[str, Any]:
    """One TransformerBlock at (s, b): bytes saved for backward, measured by saved-tensor hooks, and derived."""
    from course_lib.models import TransformerBlock

    device = device or torch.device("cpu")
    block = TransformerBlock().to(device, dtype)
    x = torch.randn(b, s, BLOCK.d_model, device=device, dtype=dtype, requires_grad=True)
    with attention_backend(attention):
        measured = saved_activation_bytes(block, x)
    derived = course_block_bytes(
        s,
        b,
        element_bytes=element_size(dtype),
        stats_bytes=stats_bytes(dtype, device),
        attention=attention,
        head_multiple=head_multiple(device),
    )
    return {"s": s, "b": b, "measured": measured, "derived": derived}


def derived_held(mode: str, layers: int, s: int, b: int, dtype: torch.dtype, device: torch.device) -> float:
    """Bytes `layers` blocks hold after the forward under `mode` (formulas.stack_bytes, flash attention)."""
    e, multiple = element_size(dtype), head_multiple(device)
    per_layer = course_block_bytes(
        s, b, element_bytes=e, stats_bytes=stats_bytes(dtype, device), head_multiple=multiple
    )
    selective = selective_block_bytes(s, b, element_bytes=e, head_multiple=multiple)
    kept = "full" if mode == "from scratch" else mode
    return stack_bytes(per_layer, layers, e * s * b * BLOCK.d_model, kept, selective)["held"]


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.float().square().mean()


def measure_step(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """One forward and backward of model(x): the bytes held after the forward for backward and at the peak
    (LiveBytes), and the gradients (whole: a collective under FSDP). The model's gradients are cleared before
    and after."""
    model.zero_grad(set_to_none=True)
    with attention_backend("flash"), LiveBytes() as live:
        out = model(x)
        held = live.now(communication=False)  # FSDP's last all-gather buffer is not kept for backward
        loss_of(out).backward()
    gradients = list(full_gradients(model).values())
    model.zero_grad(set_to_none=True)
    return {"held": held, "peak": live.peak, "gradients": gradients}


def step_flops(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Matmul FLOPs of a forward of model(x), and of a whole step (forward, recomputation, backward)."""
    with attention_backend("flash"):
        forward = matmul_flops(lambda: model(x))
        step = matmul_flops(lambda: loss_of(model(x)).backward())
    model.zero_grad(set_to_none=True)
    return {"forward flops": forward, "step flops": step}


def time_steps(models: dict[str, nn.Module], x: torch.Tensor, reps: int = 5) -> dict[str, float]:
    """Median seconds of one forward and backward per model, the models taking turns (load hits them alike)."""

    def step(model: nn.Module) -> None:
        with attention_backend("flash"):
            loss_of(model(x)).backward()

    steps: dict[str, Callable[[], object]] = {name: functools.partial(step, model) for name, model in models.items()}
    return seconds_in_turns(steps, repeats=reps, warmup=1, statistic=statistics.median)


def cuda_memory(fn: Callable[[], Any], device: torch.device) -> dict[str, int]:
    """torch.cuda's allocator view of fn(): bytes allocated at its peak and when it ends, above those before."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return {
        "peak": torch.cuda.max_memory_allocated(device) - before,
        "end": torch.cuda.memory_allocated(device) - before,
    }


def cuda_memory_report(step: Callable[[], Any], device: torch.device, snapshot_path: str) -> dict[str, Any]:
    """On a GPU, the allocator's own record of step(): its peak (`cuda_memory`), `torch.cuda.memory_summary`, and
    a snapshot of every allocation with its stack (`_record_memory_history`), written to snapshot_path for
    https://pytorch.org/memory_viz. Expandable segments (PYTORCH_ALLOC_CONF=expandable_segments:True, set here
    at run time) let a segment grow in place instead of leaving fragments that a later allocation cannot use."""
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        usage = cuda_memory(step, device)
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._dump_snapshot(snapshot_path)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = sum(len(trace) for trace in snapshot["device_traces"])
    summary = torch.cuda.memory_summary(device, abbreviated=True)
    return {**usage, "events": events, "segments": len(snapshot["segments"]), "summary": summary}
