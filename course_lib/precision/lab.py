"""Notebook 04's lab: the formats' table, (GPU only) matmul throughput, and the storage explorer."""

from __future__ import annotations

import math

import torch

from course_lib.precision import inspection as formats

# The tables and figures of notebook 04: the formats' range and precision, (GPU only) matmul throughput, and the
# explorer of how a number is stored and which scaled gradients fp16 keeps.


def finfo_table(dtypes: tuple[torch.dtype, ...] = formats.FLOAT_DTYPES) -> list[dict]:
    """Range and precision of each of `dtypes` (fp32, fp16 and bf16 unless told), from torch.finfo."""
    rows = []
    for dtype in dtypes:
        info = torch.finfo(dtype)
        exponent_bits, mantissa_bits = formats.LAYOUT[dtype]
        rows.append(
            {
                "dtype": formats.DTYPE_NAMES[dtype],
                "bits": info.bits,
                "exponent bits": exponent_bits,
                "mantissa bits": mantissa_bits,
                "max": info.max,
                "smallest normal": info.smallest_normal,
                "smallest subnormal": formats.smallest_subnormal(dtype),
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


def draw_storage(value: float, dtype_name: str, log2_loss_scale: int, *, grads: torch.Tensor) -> None:
    """Left: `value`'s bits and rounding error; right: scaled gradients' log2 over fp16's zero/subnormal/inf bands."""
    import matplotlib.pyplot as plt

    dtype = {formats.DTYPE_NAMES[d]: d for d in formats.FLOAT_DTYPES + formats.FLOAT8_DTYPES}[dtype_name]
    sign, exponent, mantissa = formats.bit_fields(value, dtype)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 2.8), gridspec_kw={"width_ratios": [1.2, 1]})
    for i, (bit, colour) in enumerate(
        [(b, "C3") for b in sign] + [(b, "C0") for b in exponent] + [(b, "C2") for b in mantissa]
    ):
        left.add_patch(plt.Rectangle((i, 0), 0.95, 1, color=colour, alpha=0.35))
        left.text(i + 0.47, 0.5, bit, ha="center", va="center", fontsize=7)
    left.set_xlim(0, len(sign + exponent + mantissa))
    left.set_ylim(0, 1.6)
    left.axis("off")
    left.text(
        0,
        1.2,
        f"{value:g} as {dtype_name}: stored {formats.stored_value(value, dtype):.8g}, "
        f"relative error {formats.rounding_error(value, dtype):.1e}   (sign | exponent | mantissa)",
    )
    scaled = torch.log2(grads.abs()) + log2_loss_scale
    lowest, highest = float(scaled.min()), float(scaled.max())
    right.hist(scaled, bins=60, color="C0")
    right.axvspan(min(lowest, -25.0) - 2, -25, color="0.6", alpha=0.4)  # rounds to 0 (below half of 2^-24)
    right.axvspan(-25, -14, color="C1", alpha=0.25)  # subnormal: fewer digits
    right.axvspan(math.log2(65504), max(highest, 17.0) + 2, color="C3", alpha=0.25)
    in_fp16 = (grads * 2.0**log2_loss_scale).to(torch.float16)
    zero, inf = (in_fp16 == 0).float().mean().item(), in_fp16.isinf().float().mean().item()
    right.set_title(f"loss scale 2^{log2_loss_scale}: {zero:.0%} underflow, {inf:.0%} overflow in fp16", fontsize=9)
    right.set_xlabel("log2 |gradient x scale|")
    plt.tight_layout()
    plt.show()


def special_patterns(dtype: torch.dtype) -> dict[str, list[str]]:
    """Every 8-bit pattern of a float8 `dtype` that is not a finite number, as 'S.EEEE.MMM', by what it decodes to."""
    exponent_bits = formats.LAYOUT[dtype][0]
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    found: dict[str, list[str]] = {"nan": [], "inf": []}
    for pattern, value in enumerate(values.tolist()):
        if not math.isfinite(value):
            bits = format(pattern, "08b")
            found["nan" if math.isnan(value) else "inf"].append(
                f"{bits[0]}.{bits[1 : 1 + exponent_bits]}.{bits[1 + exponent_bits :]}"
            )
    return found


def draw_float8_layouts() -> None:
    """e4m3fn's and e5m2's bits at their largest number, with the smallest normal and nan/inf pattern counts."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 2.8))
    for ax, dtype in zip(axes, formats.FLOAT8_DTYPES):
        info, special = torch.finfo(dtype), special_patterns(dtype)
        sign, exponent, mantissa = formats.bit_fields(info.max, dtype)
        colours = ["C3"] * len(sign) + ["C0"] * len(exponent) + ["C2"] * len(mantissa)
        for i, (bit, colour) in enumerate(zip(sign + exponent + mantissa, colours)):
            ax.add_patch(plt.Rectangle((i, 0), 0.95, 1, color=colour, alpha=0.35))
            ax.text(i + 0.47, 0.5, bit, ha="center", va="center")
        notes = (
            f"{formats.DTYPE_NAMES[dtype]}: max {info.max:g} (shown), "
            f"smallest normal 2^{math.log2(info.smallest_normal):.0f}\n"
            f"nan: {', '.join(special['nan'][:3])}{' ...' if len(special['nan']) > 3 else ''} ({len(special['nan'])})"
            f";  inf: {', '.join(special['inf']) or 'none: a cast saturates at max'}"
        )
        ax.text(8.5, 0.5, notes, va="center", fontsize=9)
        ax.set_xlim(0, 26)
        ax.set_ylim(0, 1)
        ax.axis("off")
    axes[0].set_title("float8 bit layouts: sign (red) | exponent (blue) | mantissa (green)", fontsize=9, loc="left")
    plt.tight_layout()
    plt.show()


def draw_policy_stages(policies: dict[str, dict]) -> None:
    """Per MixedPrecisionPolicy: the dtype at each stage, from fp32 shard to gradient shard (fp32 blue, bf16 orange)."""
    import matplotlib.pyplot as plt

    stages = ["sharded parameter", "all_gather input", "gathered weight", "layer input", "layer output"]
    stages += ["reduce_scatter input", "sharded gradient"]
    fig, ax = plt.subplots(figsize=(12, 0.9 + 0.8 * len(policies)))
    for row, (name, seen) in enumerate(policies.items()):
        for col, stage in enumerate(stages):
            dtype = "".join(seen[stage]) if isinstance(seen[stage], list) else seen[stage]
            ax.add_patch(plt.Rectangle((col * 1.5, -row), 1.2, 0.6, color="C0" if dtype == "fp32" else "C1", alpha=0.4))
            ax.text(col * 1.5 + 0.6, -row + 0.3, dtype, ha="center", va="center")
        ax.text(-0.2, -row + 0.3, name, ha="right", va="center", fontsize=9)
    for col, stage in enumerate(stages):
        ax.text(col * 1.5 + 0.6, 0.75, stage, ha="center", fontsize=8)
    ax.set_xlim(-3.5, len(stages) * 1.5 - 0.2)
    ax.set_ylim(-len(policies) + 0.9, 0.95)
    ax.axis("off")
    plt.tight_layout()
    plt.show()


def draw_op_dtypes(ops: list[tuple[str, tuple[str, ...], str]], title: str) -> None:
    """One autocast forward's ops in order, coloured by output dtype: where autocast casts down, where it keeps fp32."""
    import matplotlib.pyplot as plt

    colours = {"fp32": "C0", "bf16": "C1", "fp16": "C2"}
    fig, ax = plt.subplots(figsize=(12, 1.6))
    for i, (op, _, output) in enumerate(ops):
        ax.add_patch(plt.Rectangle((i, 0), 0.9, 1, color=colours.get(output, "0.7"), alpha=0.45))
        ax.text(i + 0.45, 0.5, op, rotation=90, ha="center", va="center", fontsize=8)
    for dtype, colour in colours.items():
        ax.bar(0, 0, color=colour, alpha=0.45, label=f"output {dtype}")
    ax.set_xlim(0, len(ops))
    ax.set_ylim(0, 1)
    ax.axis("off")
    ax.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, 0.0))
    ax.set_title(title, fontsize=9)
    plt.tight_layout()
    plt.show()
