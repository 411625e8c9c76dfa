"""The capstone's speed: achieved FLOP/s over the matmul limit the same ranks get, for every layout.

    .venv/bin/python benchmarks/gpt.py                  # 60 steps per layout (the notebook's), DDP and FSDP2 on 2 ranks
    .venv/bin/python benchmarks/gpt.py --steps 120 --nproc 4

Each layout trains the notebook's GPT with gpt.run_layout (one thread per rank on a CPU): the median step
time of the slowest rank, and the machine's limit measured after every 10th step with the same ranks all
multiplying at once (the median). Goal: one process reaches at least half the limit; the other layouts are
reported as measured (their communication, bubble and smaller matmuls keep them lower, notebook 13 says why).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from _report import report  # benchmarks/ is the script's directory: on sys.path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from course_lib import gpt
from course_lib.gpt.figures import achieved
from course_lib.launch import launcher

BODY = """
from course_lib import gpt
summary, _ = gpt.run_layout(gpt.Layout(**fields), steps, device=device)
summary["layout"] = fields
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the DDP and FSDP2 layouts")
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()

    summaries = []
    for layout in gpt.layouts(args.nproc):
        done = launcher.launch(
            BODY,
            layout.world,
            backend=args.backend,
            out=["summary"],
            push={"fields": dataclasses.asdict(layout), "steps": args.steps},
            timeout=900,
            write=lambda text, stream: None,
        )
        summary = done.values["summary"][0]
        summary["layout"] = layout
        summaries.append(summary)
    print(f"{args.steps} steps per layout, global batch 16 x 64 characters")
    print(gpt.speed_table(summaries))
    for summary in summaries:
        layout = summary["layout"]
        goal = ">= 0.5" if layout.world == 1 else "as measured"
        report(f"achieved / matmul limit, {layout.describe()}", achieved(summary)["of_limit"], goal)


if __name__ == "__main__":
    main()
