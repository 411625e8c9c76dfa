"""From-scratch DDP (course_lib.ddp.MinimalDDP) against torch's DistributedDataParallel: step time.

    .venv/bin/python benchmarks/ddp.py [--nproc 2] [--repeats 7] [--steps 20]

Each rank trains the course MLP (and the bigger MLP of notebook 02, section 4) with both wrappers,
alternating between them so that load changes on the machine hit both alike, and reports the
median time of a training step (forward, backward with the gradient all-reduce, Adam step).
Goal from the issue: MinimalDDP / torch DDP <= 1.5 on the course model.
"""

from __future__ import annotations

import argparse
import statistics

from _report import report  # benchmarks/ is the script's directory: on sys.path

from course_lib.launch import launch

BODY = r"""
import time
from torch.nn.parallel import DistributedDataParallel as DDP
from course_lib.ddp import MinimalDDP
from course_lib.models import MLP

results = {}
BIG = dict(d_in=256, d_hidden=1024, d_out=256, n_layers=4)
for label, shape, batch in (("course MLP", {}, 48), ("big MLP", BIG, 128)):
    torch.manual_seed(rank)
    x = torch.randn(batch // world_size, shape.get("d_in", 32))
    y = torch.randn(batch // world_size, shape.get("d_out", 8))
    models = {"MinimalDDP": MinimalDDP(MLP(**shape)), "torch DDP": DDP(MLP(**shape))}
    optimizers = {name: torch.optim.Adam(m.parameters(), lr=1e-3) for name, m in models.items()}
    times = {name: [] for name in models}
    for repeat in range(repeats + 1):                 # repeat 0 warms up (torch DDP rebuilds buckets)
        for name, model in (models.items() if repeat % 2 else reversed(models.items())):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                optimizers[name].step()
                optimizers[name].zero_grad(set_to_none=True)
            elapsed = torch.tensor([(time.perf_counter() - start) / steps])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)   # a step lasts as long as its slowest rank
            if repeat:
                times[name].append(elapsed.item())
    results[label] = times
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    run = launch(
        BODY,
        args.nproc,
        backend="gloo",
        out=["results"],
        push={"repeats": args.repeats, "steps": args.steps},
        env={"OMP_NUM_THREADS": "1"},
        timeout=600,
        write=lambda text, stream: None,
    )
    results = run.values["results"][0]
    print(f"{args.nproc} ranks, gloo, median of {args.repeats} alternating runs of {args.steps} steps")
    print(f"{'model':12} {'MinimalDDP ms':>14} {'torch DDP ms':>13} {'ratio':>7}")
    for label, times in results.items():
        mine, theirs = statistics.median(times["MinimalDDP"]), statistics.median(times["torch DDP"])
        print(f"{label:12} {mine * 1e3:14.3f} {theirs * 1e3:13.3f} {mine / theirs:7.2f}")
        if label == "course MLP":
            report("MinimalDDP / torch DDP step time, course MLP", mine / theirs, "<= 1.5")


if __name__ == "__main__":
    main()
