"""Pipeline schedules: the measured bubble against (p-1)/(vm+p-1), and our step time against torch's.

    .venv/bin/python benchmarks/pipeline.py                 # 4 stages, m = 1..16, padded actions (10 ms / 20 ms)
    .venv/bin/python benchmarks/pipeline.py --nproc 2 --ms 8
    .venv/bin/python benchmarks/pipeline.py --versus-torch  # also: unpadded step time, ours / torch's

First, exactly, on paper: the bubble and peak activations of every schedule at p = 4, m = 8 (ours, and torch's
two-stages-per-rank ones), simulated from its action lists (t_F = 1, t_B + t_W = 2), with ZB-H1's bubble over
1F1B's as a figure.
Bubble: every action is padded to a fixed time (as if each rank had its own device), the schedules
alternate inside each repeat, and the table gives the bubble of the fastest step and the median.
Versus torch: the same 1F1B / GPipe step, real compute only, alternating ours and torch's; the figure
is the median step time (slowest rank) and the ratio ours / torch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict

from _report import report  # benchmarks/ is the script's directory: on sys.path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from course_lib import pipeline as pp
from course_lib.launch import launcher

BODY = r"""
import time
from course_lib import pipeline as pp
torch.manual_seed(1)
x, y = torch.randn(batch, 64, device=device), torch.randn(batch, 8, device=device)
pad = {"F": ms / 1e3, "B": 2 * ms / 1e3}
p = world_size
pp.schedule_step("1F1B", p, x, y, model=pp.course_model().to(device))  # warm-up
runs = []
for repeat in range(repeats):
    for m in microbatches:
        for schedule in pp.SCHEDULES:
            if schedule == "interleaved 1F1B" and m % p:
                continue
            dist.barrier()
            record, _ = pp.schedule_step(schedule, m, x, y, min_seconds=pad, model=pp.course_model().to(device))
            runs.append((schedule, m, repeat, record.events, record.peak))

versus = []
if versus_torch:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    wide_x = torch.randn(batch * 4, width, device=device)
    wide_y = torch.randn(batch * 4, 8, device=device)
    models = {who: pp.course_model(width=width).to(device) for who in ("ours", "torch")}
    runners = {}
    for schedule, kind in (("GPipe", ScheduleGPipe), ("1F1B", Schedule1F1B)):  # built once, like a training loop
        stage = PipelineStage(pp.split_into_stages(models["torch"], p)[rank], rank, p, device)
        runners[schedule] = kind(stage, n_microbatches=2 * p, loss_fn=pp.mse_loss)

    def torch_step(runner):
        if rank == 0:
            runner.step(wide_x)
        elif rank == p - 1:
            runner.step(target=wide_y, losses=[])
        else:
            runner.step()

    for repeat in range(repeats + 1):  # the first round warms up (torch infers shapes on its first step)
        for schedule in ("GPipe", "1F1B"):
            for who in ("ours", "torch"):
                dist.barrier()
                start = time.perf_counter()
                if who == "ours":
                    pp.schedule_step(schedule, 2 * p, wide_x, wide_y, model=models["ours"])
                else:
                    torch_step(runners[schedule])
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
                if repeat:
                    versus.append((schedule, who, float(elapsed)))
"""


def simulated_table(p: int = 4, m: int = 8) -> None:
    """Bubble and the most activations a rank holds at one moment (whole-stage units), simulated: exact, load-free."""
    print(f"simulated, p = {p}, m = {m}, t_F = 1, t_B + t_W = 2 (exact)")
    print(f"{'schedule':29} {'bubble':>7} {'formula':>8} {'peak':>5}")
    lists = {name: pp.schedule_actions(name, p, m) for name in (*pp.SCHEDULES, pp.ZERO_BUBBLE)}
    lists |= {name: pp.torch_schedule_order(name, p, m) for name in pp.TORCH_SCHEDULES}  # two stages per rank
    bubble = {}
    for schedule, actions in lists.items():
        v = pp.stages_per_rank(schedule)
        bubble[schedule] = pp.bubble_fraction(pp.simulate(actions, p * v), p)
        formula = pp.published_bubble(schedule, p, m)
        peak = max(pp.simultaneous_peak(todo) / v for todo in actions.values())  # a rank's peak, whole-stage units
        print(f"{schedule:29} {bubble[schedule]:>7.3f} {formula:>8.3f} {peak:>5g}")
    report(f"ZB-H1 / 1F1B bubble, p={p}, m={m} (simulated)", bubble[pp.ZERO_BUBBLE] / bubble["1F1B"], "<= 0.5")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--ms", type=float, default=10.0, help="padded forward time per micro-batch (backward: 2x)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--versus-torch", action="store_true")
    parser.add_argument("--width", type=int, default=512, help="model width for --versus-torch")
    args = parser.parse_args()

    simulated_table()
    p = args.nproc
    microbatches = sorted({1, 2, 4, 8, 16, p, 2 * p, 4 * p})
    batch = 16 * p * 3  # divisible by every m above
    settings = dict(
        batch=batch,
        ms=args.ms,
        repeats=args.repeats,
        microbatches=microbatches,
        versus_torch=args.versus_torch,
        width=args.width,
    )
    result = launcher.launch(
        BODY,
        p,
        backend=args.backend,
        out=["runs", "versus"],
        push=settings,
        timeout=900,
        write=lambda text, stream: None,
    )

    timelines, peaks = defaultdict(list), defaultdict(dict)
    for rank_runs in result.values["runs"]:
        for schedule, m, repeat, events, peak in rank_runs:
            timelines[(schedule, m, repeat)] += events
            peaks[(schedule, m)].update(peak)
    print(
        f"{p} stages, {result.backend}, actions padded to {args.ms:g} ms forward / {2 * args.ms:g} ms backward, "
        f"{args.repeats} alternating repeats"
    )
    print(f"{'schedule':17} {'m':>3} {'fastest ms':>10} {'bubble':>7} {'median':>7} {'formula':>8} {'peak rank 0':>11}")
    steps = {}
    for schedule in pp.SCHEDULES:
        for m in microbatches:
            if (schedule, m, 0) not in timelines:
                continue
            runs = [timelines[(schedule, m, r)] for r in range(args.repeats)]
            spans = [max(e.end for e in ev) - min(e.start for e in ev) for ev in runs]
            bubbles = [pp.bubble_fraction(ev, p) for ev in runs]
            fastest = min(range(len(runs)), key=spans.__getitem__)
            v = 2 if schedule == "interleaved 1F1B" else 1
            steps[(schedule, m)] = statistics.median(spans)
            held = sum(n for s, n in peaks[(schedule, m)].items() if s % p == 0) / v
            print(
                f"{schedule:17} {m:>3} {1e3 * spans[fastest]:>10.1f} {bubbles[fastest]:>7.3f} "
                f"{statistics.median(bubbles):>7.3f} {pp.ideal_bubble(p, m, v):>8.3f} {held:>11g}"
            )
    for m in (2 * p, 4 * p):
        ratio = steps[("interleaved 1F1B", m)] / steps[("1F1B", m)]
        ideal = (2 * m + p - 1) / 2 / (m + p - 1)
        print(f"interleaved / 1F1B median step time at m={m}: {ratio:.2f} (formula {ideal:.2f})")
        report(f"interleaved / 1F1B step time over the formula's ratio, m={m}", ratio / ideal, "<= 1.10")
    if args.versus_torch:
        times = defaultdict(list)
        for schedule, who, seconds in result.values["versus"][0]:
            times[(schedule, who)].append(seconds)
        print(f"\nunpadded step, width {args.width}, m = {2 * p}, median of {args.repeats} alternating runs:")
        for schedule in ("GPipe", "1F1B"):
            ours, theirs = (statistics.median(times[(schedule, who)]) for who in ("ours", "torch"))
            print(
                f"{schedule:6} ours {1e3 * ours:7.1f} ms   torch {1e3 * theirs:7.1f} ms   "
                f"ours / torch = {ours / theirs:.2f}"
            )


if __name__ == "__main__":
    main()
