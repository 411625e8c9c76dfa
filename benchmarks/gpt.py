"""The capstone's speed: achieved FLOP/s over the matmul limit the same ranks get, for every layout.

    .venv/bin/python benchmarks/gpt.py                  # 60 steps per layout (the notebook's), DDP and FSDP2 on 2 ranks
    .venv/bin/python benchmarks/gpt.py --steps 120 --nproc 4

Each layout trains the notebook's GPT with gpt.run_layout (one thread per rank on a CPU): the median step
time of the slowest rank, and the machine's limit measured after every 10th step with the same ranks all
multiplying at once (the median). Goal: one process reaches at least 0.6 of the limit; the other layouts are
reported as measured (their communication, bubble and smaller matmuls keep them lower, notebook 15 says why).

One process eager and compiled (gpt.compiled_layouts: each block compiled) run in one process: each layout's run
(run_layout: achieved / limit, goals >= 0.6 eager, >= 0.7 compiled), then the two models' steps in turns (eager,
compiled, eager, ...: runtime.seconds_in_turns, the fastest of each), so that both see the same load: compiled /
eager step time, goal <= 0.85.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from _report import report  # benchmarks/ is the script's directory: on sys.path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from course_lib import gpt
from course_lib.gpt.lab import achieved
from course_lib.launch import launcher

BODY = """
from course_lib import gpt
summary, _ = gpt.run_layout(gpt.Layout(**fields), steps, device=device)
summary["layout"] = fields
"""

IN_TURNS = """
import functools
from course_lib import gpt
from course_lib.launch.runtime import seconds_in_turns

pair = {"eager": gpt.layouts(1)[0], "compiled": gpt.compiled_layouts(1)[0]}
runs = {name: gpt.run_layout(layout, steps, device=device)[0] for name, layout in pair.items()}
for summary in runs.values():
    summary["layout"] = None
config = gpt.default_config()
batches = gpt.ShardedBatches(gpt.split()[0], config.seq, 16)
one_step = {}
for name, layout in pair.items():
    model = gpt.parallelize(layout, config, None, device)
    one_step[name] = functools.partial(gpt.plain_step(model, gpt.adam_per_mesh(model), batches, device, layout), 0)
turns = seconds_in_turns(one_step, repeats=steps, warmup=2)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the DDP and FSDP2 layouts")
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()

    done = launcher.launch(
        IN_TURNS,
        1,
        backend=args.backend,
        out=["runs", "turns"],
        push={"steps": args.steps},
        timeout=900,
        write=lambda text, stream: None,
    )
    one_process, turns = done.values["runs"][0], done.values["turns"][0]
    one_process["eager"]["layout"], one_process["compiled"]["layout"] = gpt.layouts(1)[0], gpt.compiled_layouts(1)[0]

    summaries = []
    for layout in gpt.layouts(args.nproc):
        if layout.world == 1:
            summaries += [one_process["eager"], one_process["compiled"]]
            continue
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
    print(gpt.compiled_summary(one_process["eager"], one_process["compiled"]), "(in separate runs)")
    ratio = turns["compiled"] / turns["eager"]
    print(f"in turns, fastest step: eager {turns['eager'] * 1e3:.1f} ms, compiled {turns['compiled'] * 1e3:.1f} ms")
    report("compiled / eager step time, one process", ratio, "<= 0.85")
    for summary in summaries:
        layout = summary["layout"]
        goal = {"one process": ">= 0.6", "one process, compiled": ">= 0.7"}.get(layout.name, "as measured")
        report(f"achieved / matmul limit, {layout.describe()}", achieved(summary)["of_limit"], goal)


if __name__ == "__main__":
    main()
