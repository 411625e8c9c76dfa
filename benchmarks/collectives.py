"""From-scratch ring all-reduce vs dist.all_reduce, and the bandwidth of torch's collectives.

    .venv/bin/python benchmarks/collectives.py                # 16 MB on 4 ranks: the ratio (goal <= 2.0)
    .venv/bin/python benchmarks/collectives.py --sweep        # also every collective from 4 KB to 64 MB

Runs alternate (ring, torch, ring, torch, ...) inside one launch, so a slow phase of a shared
machine hits both alike; each time is the slowest rank's; the figure is the median of the runs.
"""

from __future__ import annotations

import argparse
import os
import sys

from _report import report  # benchmarks/ is the script's directory: on sys.path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from course_lib import collectives
from course_lib.launch import launcher

BODY = r"""
from course_lib import collectives as C
ratio_rows = C.benchmark([SIZE], ["ring_all_reduce", "all_reduce"], repeats=REPEATS, device=device, warmup=2)
sweep_rows = C.benchmark(SWEEP, ["all_reduce", "ring_all_reduce", "naive_all_reduce", "all_gather",
                                 "reduce_scatter", "broadcast"], repeats=5, device=device) if SWEEP else []
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--mb", type=float, default=16, help="message size in MB (default 16)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--sweep", action="store_true", help="also sweep every collective over sizes")
    args = parser.parse_args()

    size = int(args.mb * 2**20)
    sweep = [4 * 2**10 * 4**k for k in range(8)] if args.sweep else []  # 4 KB ... 64 MB
    body = BODY.replace("SIZE", str(size)).replace("REPEATS", str(args.repeats)).replace("SWEEP", repr(sweep))
    result = launcher.launch(
        body,
        args.nproc,
        backend=args.backend,
        out=["ratio_rows", "sweep_rows"],
        timeout=900,
        write=lambda text, stream: None,
    )
    rows = result.values["ratio_rows"][0]
    by_name = {row["name"]: row for row in rows}
    ring, torch_ar = by_name["ring_all_reduce"], by_name["all_reduce"]
    print(
        f"{args.nproc} ranks, {result.backend}, {collectives.human_bytes(ring['bytes'])} float32, "
        f"median of {args.repeats} alternating runs (slowest rank per run):"
    )
    print(collectives.format_table(rows))
    ratio = ring["seconds"] / torch_ar["seconds"]
    report(
        f"ring_all_reduce / dist.all_reduce time, {collectives.human_bytes(ring['bytes'])}, {args.nproc} ranks",
        ratio,
        "<= 2.0",
    )
    if sweep:
        sweep_rows = result.values["sweep_rows"][0]
        print("\nsweep (median of 5):")
        print(collectives.format_table(sorted(sweep_rows, key=lambda r: (r["name"], r["bytes"]))))
        ar = [r for r in sweep_rows if r["name"] == "all_reduce"]
        alpha, beta = collectives.fit_alpha_beta(
            "all_reduce", [r["bytes"] for r in ar], [r["seconds"] for r in ar], args.nproc
        )
        print(
            f"\nalpha-beta fit to dist.all_reduce: alpha = {alpha * 1e6:.0f} us per message, "
            f"bandwidth 1/beta = {1 / beta / 1e9 if beta else float('inf'):.2f} GB/s"
        )


if __name__ == "__main__":
    main()
