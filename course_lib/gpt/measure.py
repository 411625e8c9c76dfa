"""What the capstone measures on a rank: FLOPs (counted and by formula), the matmul limit, a GPU's peak."""

from __future__ import annotations

import time
from typing import Any

import torch

from course_lib.launch.runtime import synchronize

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
