"""Mixed precision: what bf16 buys, per device.

    .venv/bin/python benchmarks/precision.py [--repeats 7] [--n 1024]

GPU (CUDA available): median TFLOP/s of an n x n matmul in fp32, fp16 and bf16 (course_lib.precision.matmul_tflops,
n = 8192) and the ratio to fp32. CPU: median time of a forward+backward step of the course MLP (d_hidden=512) in
fp32, bf16 autocast and a pure bf16 model, alternating between them so load changes hit all alike; and the bytes of
parameters and saved activations in fp32 vs bf16 (ratio asked by the issue: about 0.5).
Both: the float8 all-gather under FSDP2 on 2 gloo ranks (course_lib.precision.train_fsdp): the bytes of the float8
weights in the recorded all-gathers against the same weights' fp32 bytes, exactly 0.25 (the biases, in bf16, are taken
out by their known size).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _report import report  # benchmarks/ is the script's directory: on sys.path
from torch import nn

from course_lib import compare, precision
from course_lib.launch import launch
from course_lib.models import MLP


def gpu(repeats: int) -> None:
    device = torch.device("cuda")
    tflops = {name: [] for name in ("fp32", "fp16", "bf16")}
    for _ in range(repeats):
        for dtype in precision.FLOAT_DTYPES:
            tflops[precision.DTYPE_NAMES[dtype]].append(precision.matmul_tflops(dtype, device))
    medians = {name: statistics.median(v) for name, v in tflops.items()}
    for name, value in medians.items():
        print(f"{name}: {value:8.1f} TFLOP/s   {value / medians['fp32']:5.1f}x fp32")
    report("bf16 / fp32 matmul TFLOP/s", medians["bf16"] / medians["fp32"], ">= 2")


def cpu(repeats: int, batch: int) -> None:
    torch.set_num_threads(1)
    x, y = torch.randn(batch, 32), torch.randn(batch, 8)
    modes = {
        "fp32": (MLP(d_hidden=512), x, y, None),
        "bf16 autocast": (MLP(d_hidden=512), x, y, torch.bfloat16),
        "bf16 model": (MLP(d_hidden=512).to(torch.bfloat16), x.bfloat16(), y.bfloat16(), None),
    }
    times = {name: [] for name in modes}
    for repeat in range(repeats + 1):  # repeat 0 warms up
        for name, (model, xs, ys, autocast_dtype) in modes.items():
            start = time.perf_counter()
            for _ in range(5):
                with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                    loss = nn.functional.mse_loss(model(xs).float(), ys.float())
                loss.backward()
            if repeat:
                times[name].append((time.perf_counter() - start) / 5)
    base = statistics.median(times["fp32"])
    for name, t in times.items():
        print(f"{name:14} step {statistics.median(t) * 1e3:7.2f} ms   {statistics.median(t) / base:5.2f}x fp32")
    fp32_model, bf16_model = MLP(d_hidden=512), MLP(d_hidden=512).to(torch.bfloat16)
    params = (compare.bytes_per_rank(bf16_model.parameters()), compare.bytes_per_rank(fp32_model.parameters()))
    acts = (compare.saved_activation_bytes(bf16_model, x.bfloat16()), compare.saved_activation_bytes(fp32_model, x))
    print(f"parameters  fp32 {params[1]:>10,} B  bf16 {params[0]:>10,} B  ratio {params[0] / params[1]:.2f}")
    print(f"activations fp32 {acts[1]:>10,} B  bf16 {acts[0]:>10,} B  ratio {acts[0] / acts[1]:.2f}")
    report("bf16 / fp32 parameter bytes", params[0] / params[1], "0.45..0.55")
    report("bf16 / fp32 saved activation bytes", acts[0] / acts[1], "0.45..0.55")


FLOAT8_BODY = """
from course_lib.precision import float8_width, rank_batches, train_fsdp

batches = rank_batches(1, 48, device)
width = float8_width(world_size)
runs = {kind: train_fsdp(kind, batches, width=width, lr=2.0, device=device) for kind in ("fp32", "float8")}
"""


def float8_all_gather() -> None:
    run = launch(FLOAT8_BODY, 2, backend="gloo", out=["runs", "width"], timeout=300, write=lambda text, stream: None)
    runs, width = run.values["runs"][0], run.values["width"][0]
    linears = [m for m in MLP(d_hidden=width, n_layers=2) if isinstance(m, nn.Linear)]  # one FSDP2 unit each
    weight_bytes = {"fp32": 0, "float8": 0}
    for name in runs["float8"]["float8_modules"]:
        unit = int(name) // 2  # Sequential index -> Linear
        bias = linears[unit].bias.numel()
        weight_bytes["fp32"] += runs["fp32"]["forward_all_gather_bytes"][unit] - 4 * bias
        weight_bytes["float8"] += runs["float8"]["forward_all_gather_bytes"][unit] - 2 * bias  # bias in bf16
    print(
        f"float8 all-gather, 2 ranks: float8 weights {weight_bytes['float8']:,} B, as fp32 {weight_bytes['fp32']:,} B"
    )
    report(
        "float8 / fp32 all-gather bytes of the float8 weights",
        weight_bytes["float8"] / weight_bytes["fp32"],
        "0.25..0.25",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--n", type=int, default=1024, help="CPU batch size")
    args = parser.parse_args()
    if torch.cuda.is_available():
        gpu(args.repeats)
    else:
        print("no GPU: matmul throughput skipped; CPU step time and memory instead")
        cpu(args.repeats, args.n)
    float8_all_gather()


if __name__ == "__main__":
    main()
