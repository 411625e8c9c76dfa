"""The capstone's predictions per layout (memory per rank, bytes per step); a rank's FLOPs, matmul limit, GPU peak."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from course_lib.comms import sent_per_rank
from course_lib.gpt.layouts import Layout
from course_lib.gpt.model import GPTConfig, count_parameters
from course_lib.launch.runtime import synchronize

BYTES = 4  # fp32 parameters, gradients and activations
ADAM_FP32 = (4, 4, 8)  # bytes per parameter: weight, gradient, Adam's two moments


def parameter_shapes(layout: Layout, config: GPTConfig, stage: int = 0) -> list[tuple[int, ...]]:
    """Shapes a `stage` rank holds before dp sharding: q, k, v, up split by rows over tp; o, down by columns."""
    d, f, tp = config.d_model, config.d_ff, layout.tp
    column = [(d // tp, d), (d // tp,)] * 3 + [(f // tp, d), (f // tp,)]  # q, k, v, up
    row = [(d, d // tp), (d,), (d, f // tp), (d,)]  # o, down
    norms = [(d,)] * 4
    shapes = (column + row + norms) * (config.n_layers // layout.pp)
    first, last = stage == 0, stage == layout.pp - 1
    if first:
        shapes += [(config.vocab, d), (config.seq, d)]  # token table, positions
    if last:
        shapes += ([] if first else [(config.vocab, d)]) + [(d,), (d,)]  # the table's copy, final norm
    return shapes


def root_parameters(config: GPTConfig, stage: int = 0, stages: int = 1) -> int:
    """Non-block parameters on `stage`: token table (first; copy on last), positions (first), final norm (last)."""
    first, last = stage == 0, stage == stages - 1
    table = config.vocab * config.d_model if first or last else 0
    return table + (config.seq * config.d_model if first else 0) + (2 * config.d_model if last else 0)


def parameters_before_dp(layout: Layout, config: GPTConfig, stage: int = 0) -> int:
    """Parameters of this rank's part of the model before data-parallel sharding (its stage, its tp shard)."""
    return sum(math.prod(shape) for shape in parameter_shapes(layout, config, stage))


def predicted_memory(layout: Layout, config: GPTConfig, stage: int = 0) -> dict[str, float]:
    """memory.zero_bytes_per_gpu for a rank of `stage`: parameters, gradients, Adam state and total, bytes."""
    from course_lib.memory import zero_bytes_per_gpu

    zero_stage = 0 if layout.ddp or layout.world == 1 else 3
    n = parameters_before_dp(layout, config, stage)
    return zero_bytes_per_gpu(n, layout.dp, zero_stage, *ADAM_FP32)


def predicted_shard_bytes(layout: Layout, config: GPTConfig, stage: int, dp_rank: int) -> int:
    """Exact bytes per rank: fully_shard splits rows like torch.chunk, so shares differ where rows don't divide."""
    from course_lib.memory import fully_shard_numel

    shapes = parameter_shapes(layout, config, stage)
    if layout.ddp or layout.world == 1:
        return sum(ADAM_FP32) * sum(math.prod(shape) for shape in shapes)
    return sum(ADAM_FP32) * sum(fully_shard_numel(shape, layout.dp, dp_rank) for shape in shapes)


def predicted_traffic(layout: Layout, config: GPTConfig, global_batch: int) -> dict[str, float]:
    """Bytes one rank sends per step, by dimension ("tp", "dp", "pp"), the mean over the layout's ranks."""
    from course_lib.compose import Cluster, ModelShape, fsdp_collectives, plan

    if layout.world == 1:
        return {"tp": 0.0, "dp": 0.0, "pp": 0.0}
    counts = count_parameters(config)
    micro_batch = global_batch / (layout.dp * layout.n_mb)
    piped: dict[str, Any] = {"reshard_after_backward": False, "defer_grad_sync": True} if layout.pp > 1 else {}
    shape = ModelShape(
        counts["total"] if layout.ddp else counts["blocks"],
        config.n_layers,
        config.d_model,
        config.n_heads,
        config.seq,
        micro_batch,
        tp_all_reduces=6,  # 2 in forward (o, down), 4 in backward (q, k, v and up's input gradients, one by one)
    )
    r = plan(
        shape,
        layout.dp,
        layout.tp,
        layout.pp,
        Cluster(gpus_per_node=layout.tp),
        global_batch=global_batch,
        zero_stage=0 if layout.ddp else 3,
        bytes_per_value=BYTES,
        **piped,
    )
    traffic = {dim: r[f"{dim}_comm_GB"] * 1e9 for dim in ("tp", "dp", "pp")}
    if not layout.ddp:
        calls = fsdp_collectives(layout.n_mb, reshard_after_forward=False, **piped)  # the root unit
        root_bytes = sum(root_parameters(config, s, layout.pp) for s in range(layout.pp)) / layout.pp * BYTES
        for op in ("all_gather", "reduce_scatter"):
            traffic["dp"] += calls[op] * sent_per_rank(op, root_bytes, layout.dp)
    if layout.pp > 1:  # first and last stage all-reduce their dp shard of the tied table's gradient, on the pp group
        traffic["pp"] += sent_per_rank("all_reduce", config.vocab * config.d_model / layout.dp * BYTES, 2)
    return traffic


# bf16 dense tensor-core peak from NVIDIA's data sheets, FLOP/s: MFU's usual denominator (torchtitan's, and most
# published runs'), whatever dtype the run computes in. Most sheets give the peak with 2:4 sparsity, twice the dense
# one: H100 Tensor Core GPU: BF16 1,979 TFLOPS (SXM), 1,671 (NVL), 1,513 (PCIe); H200: 1,979 (SXM), 1,671 (NVL);
# A100: 312 dense (SXM and PCIe); L40S: 362.05 dense; L4: 242 with sparsity; A10: 125 dense. The first entry whose
# parts all occur in the device's name (any case) wins, so a variant comes before its family: an H100 PCIe ("NVIDIA
# H100 PCIe") before the SXM part ("NVIDIA H100 80GB HBM3", like the GH200's GPU), the A100 before the A10, the L40S
# before the L4. Unlisted (None): the L40 and AWS's A10G (other parts, other peaks), the V100 (no bf16 tensor cores).
BF16_DENSE_PEAK: tuple[tuple[tuple[str, ...], float | None], ...] = (
    (("H100", "PCIe"), 756e12),
    (("H100", "NVL"), 835e12),
    (("H100",), 989e12),
    (("H200", "NVL"), 835e12),
    (("H200",), 989e12),
    (("A100",), 312e12),
    (("L40S",), 362e12),
    (("L40",), None),
    (("L4",), 121e12),
    (("A10G",), None),
    (("A10",), 125e12),
)


def counted_flops(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, int]:
    """FLOPs of one forward and backward of `model` on (x, y), by kind: "matmul" and "attention", as counted."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    from course_lib.gpt.model import loss_fn

    aten = torch.ops.aten

    def forward(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return sdpa_flop_count(q, k, v)

    def backward(grad: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return sdpa_backward_flop_count(grad, q, k, v)

    cpu_attention = {
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
    }
    with FlopCounterMode(display=False, custom_mapping=cpu_attention) as counter:
        loss_fn(model(x), y).backward()
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    attention = {k: v for k, v in by_op.items() if "attention" in k}
    return {
        "matmul": sum(v for k, v in by_op.items() if k not in attention),
        "attention forward": sum(v for k, v in attention.items() if not k.endswith("backward")),
        "attention backward": sum(v for k, v in attention.items() if k.endswith("backward")),
    }


def matmul_flops(device: torch.device | str = "cpu", n: int | None = None, seconds: float = 0.3) -> float:
    """FLOP/s of (n x n) @ (n x n) fp32 matmuls on this rank (at least 4 of them), for about `seconds`.

    n: 512 on a CPU, 4096 on a GPU (a small matmul there measures the kernel launch, not the arithmetic).
    """
    device = torch.device(device)
    n = n or (4096 if device.type == "cuda" else 512)
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)

    a @ b  # warm-up
    synchronize(device)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(4):
            a @ b
        done += 4
        synchronize(device)
    return 2 * n**3 * done / (time.perf_counter() - start)


def peak_flops_of(name: str) -> float | None:
    """The data-sheet bf16 dense peak of the GPU torch.cuda.get_device_name calls `name` (None if unlisted)."""
    name = name.lower()
    return next((peak for parts, peak in BF16_DENSE_PEAK if all(part.lower() in name for part in parts)), None)


def device_peak_flops(device: torch.device | str) -> float | None:
    """The data-sheet bf16 dense peak of one GPU (None on a CPU or an unlisted GPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))
