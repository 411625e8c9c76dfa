"""Ring attention: what the zig-zag layout saves on a causal mask, and what the ring saves over one rank.

    .venv/bin/python benchmarks/context_parallel.py                  # 2 ranks, 2048 tokens, 2 heads of 64
    .venv/bin/python benchmarks/context_parallel.py --nproc 4 --seq-len 4096

One causal attention layer, forward + backward, timed on one rank and on N ranks (contiguous and zig-zag layouts,
alternating inside each repeat; a step lasts as long as its slowest rank). The work model (course_lib.context_parallel
.computed_work) predicts zig-zag / contiguous = (N + 1) / (2N) and zig-zag on N ranks / one rank = (N + 1) / (2N²);
the messages and the merges cost extra, so the goals leave room.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from _report import report  # benchmarks/ is the script's directory: on sys.path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from course_lib import context_parallel as cp
from course_lib.launch import launcher

BODY = r"""
from course_lib import context_parallel as cp

solo = dist.new_group([0])
timed = {"one rank": [], "contiguous": [], "zigzag": []}
for repeat in range(repeats):
    if rank == 0:
        timed["one rank"].append(cp.time_ring_step("zigzag", seq_len, solo, heads=heads, head_dim=head_dim,
                                                   repeats=1, device=device))
    dist.barrier()
    for layout in cp.LAYOUTS:
        timed[layout].append(cp.time_ring_step(layout, seq_len, None, heads=heads, head_dim=head_dim, repeats=1,
                                               device=device))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()

    n = args.nproc
    settings = dict(seq_len=args.seq_len, heads=args.heads, head_dim=args.head_dim, repeats=args.repeats)
    result = launcher.launch(
        BODY, n, backend=args.backend, out=["timed"], push=settings, timeout=900, write=lambda text, stream: None
    )
    timed = {name: statistics.median(times) for name, times in result.values["timed"][0].items()}
    slowest = {
        layout: sum(max(step) for step in zip(*cp.computed_work(layout, args.seq_len, n))) for layout in cp.LAYOUTS
    }
    one_rank = args.seq_len**2  # one rank computes the whole block (the mask's rectangle is the whole matrix)
    print(f"{n} ranks, {result.backend}, S = {args.seq_len}, {args.heads} heads of {args.head_dim}, causal")
    print(f"{'':12} {'median ms':>10} {'work model':>11}")
    for name, work in (("one rank", one_rank), ("contiguous", slowest["contiguous"]), ("zigzag", slowest["zigzag"])):
        print(f"{name:12} {1e3 * timed[name]:>10.1f} {work / one_rank:>11.3f}")
    model = slowest["zigzag"] / slowest["contiguous"]
    report(
        f"zig-zag / contiguous step time, {n} ranks (model {model:.2f})",
        timed["zigzag"] / timed["contiguous"],
        "<= 0.9",
    )
    model = slowest["zigzag"] / one_rank
    report(
        f"zig-zag on {n} ranks / one rank, step time (model {model:.2f})",
        timed["zigzag"] / timed["one rank"],
        "<= 0.75",
    )


if __name__ == "__main__":
    main()
