"""The tables notebook 04 prints: the formats' range and precision, and (GPU only) matmul throughput."""

from __future__ import annotations

import math

import torch

from course_lib.precision.number_formats import DTYPE_NAMES, FLOAT_DTYPES, LAYOUT, smallest_subnormal


def finfo_table(dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> list[dict]:
    """Range and precision of each of `dtypes` (fp32, fp16 and bf16 unless told), from torch.finfo."""
    rows = []
    for dtype in dtypes:
        info = torch.finfo(dtype)
        exponent_bits, mantissa_bits = LAYOUT[dtype]
        rows.append(
            {
                "dtype": DTYPE_NAMES[dtype],
                "bits": info.bits,
                "exponent bits": exponent_bits,
                "mantissa bits": mantissa_bits,
                "max": info.max,
                "smallest normal": info.smallest_normal,
                "smallest subnormal": smallest_subnormal(dtype),
                "eps": info.eps,
                "decimal digits": round(math.log10(2) * (mantissa_bits + 1), 1),
            }
        )
    return rows


def matmul_tflops(dtype: torch.dtype, device: torch.device, n: int = 8192, repeats: int = 10) -> float:
    """Median TFLOP/s of an n x n x n matmul on a CUDA device (2 n^3 flops per product)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):  # warm-up: kernel selection, clocks
        a @ b
    torch.cuda.synchronize(device)
    times_ms = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times_ms.append(start.elapsed_time(end))
    median_s = sorted(times_ms)[len(times_ms) // 2] / 1e3
    return 2 * n**3 / median_s / 1e12
