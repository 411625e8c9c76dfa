"""What the persistent session (%dist + %%px) costs, through a real kernel as a notebook drives it.

On N ranks (default 4): the median round trip of a trivial %%px cell and of an all_reduce cell
(goal <= 25 ms each), and the start-up of a session next to one %%torchrun cell doing the same
all_reduce (goal: start-up <= 1.5x one %%torchrun cell):

    .venv/bin/python benchmarks/session.py [--nproc 4] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from _report import report  # benchmarks/_report.py: one JSON line per figure for run_all.py

ALL_REDUCE = "t = torch.ones(1000) * rank\ndist.all_reduce(t)\n"


def timed(kc, code: str) -> float:
    """Seconds from sending `code` to the kernel's reply; RuntimeError if the cell failed."""
    start = time.perf_counter()
    reply = kc.execute_interactive(code, timeout=600, output_hook=lambda msg: None)
    seconds = time.perf_counter() - start
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"{code!r}: {reply['content']['ename']}: {reply['content']['evalue']}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    from jupyter_client import KernelManager

    tmp = tempfile.mkdtemp()
    km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(tmp, "kernel-ipc"))
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        timed(kc, "%load_ext course_lib\nimport torch")
        torchrun = [timed(kc, f"%%torchrun -n {args.nproc} --backend gloo\n{ALL_REDUCE}") for _ in range(3)]
        start = timed(kc, f"%dist start -n {args.nproc} --backend gloo")
        timed(kc, "%%px\npass")  # the first execute warms the engines' code paths
        trivial = [timed(kc, "%%px\npass") for _ in range(args.repeats)]
        reduce = [timed(kc, f"%%px\n{ALL_REDUCE}") for _ in range(args.repeats)]
        timed(kc, "%dist stop")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)

    cell, rt, ar = statistics.median(torchrun), statistics.median(trivial), statistics.median(reduce)
    print(f"ranks: {args.nproc}, round trips each: {args.repeats}")
    print(f"%%px trivial cell   : median {rt * 1000:.1f} ms")
    print(f"%%px all_reduce cell: median {ar * 1000:.1f} ms")
    print(f"%dist start         : {start:.2f} s")
    print(f"%%torchrun cell     : median {cell:.2f} s (of 3)")
    print(f"start-up / cell     : {start / cell:.2f}  (goal <= 1.5)")
    report(f"%%px trivial cell round trip, ms, {args.nproc} ranks", rt * 1000, "<= 25")
    report(f"%%px all_reduce cell round trip, ms, {args.nproc} ranks", ar * 1000, "<= 25")
    report(f"%dist start / one %%torchrun cell, wall time, {args.nproc} ranks", start / cell, "<= 1.5")


if __name__ == "__main__":
    main()
