"""Async TP from scratch (notebook 08): the chunked all-gather matmul against the plain all-gather, then matmul.

    .venv/bin/python benchmarks/async_tp.py [--nproc 4] [--repeats 7]

Each rank multiplies the gathered (N * rows, d_in) input by its (d_in, d_out) column shard both ways
(course_lib.tensor_parallel.time_overlap: the two alternate, every call starts at a barrier), for three sizes.
A product lasts as long as its slowest rank; the figure is the median over the repeats.
Overlap wins when a chunk's transfer and the matmul of the previous chunk can run at the same time on different
resources: a GPU's copy engines or NVLink beside its SMs. With gloo on a CPU the transfer is the same cores'
work, so chunking adds messages and hides little: expect a ratio near or above 1 here.
"""

from __future__ import annotations

import argparse

from _report import report  # benchmarks/ is the script's directory: on sys.path

from course_lib.launch import launch

SIZES = [(64, 256, 256), (256, 512, 512), (512, 1024, 1024)]  # (rows per rank, d_in, d_out)

BODY = r"""
from course_lib import tensor_parallel as tp

results = {}
for rows, d_in, d_out in sizes:
    times = tp.time_overlap(rows=rows, d_in=d_in, d_out=d_out, device=device, repeats=repeats)
    slowest = torch.tensor([times["plain"], times["chunked"]])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    results[(rows, d_in, d_out)] = slowest.tolist()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    run = launch(
        BODY,
        args.nproc,
        backend="gloo",
        out=["results"],
        push={"repeats": args.repeats, "sizes": SIZES},
        env={"OMP_NUM_THREADS": "1"},
        timeout=600,
        write=lambda text, stream: None,
    )
    results = run.values["results"][0]
    print(f"{args.nproc} ranks, gloo, median of {args.repeats} alternating calls, slowest rank")
    print(f"{'rows x d_in x d_out':>20} {'plain ms':>9} {'chunked ms':>11} {'chunked / plain':>16}")
    for rows, d_in, d_out in SIZES:
        plain, chunked = results[(rows, d_in, d_out)]
        print(f"{f'{rows} x {d_in} x {d_out}':>20} {plain * 1e3:9.2f} {chunked * 1e3:11.2f} {chunked / plain:16.2f}")
    plain, chunked = results[SIZES[1]]  # notebook 08's size
    report(
        f"async TP chunked / plain all-gather matmul, {args.nproc} ranks, notebook 08's size",
        chunked / plain,
        "as measured",
    )


if __name__ == "__main__":
    main()
