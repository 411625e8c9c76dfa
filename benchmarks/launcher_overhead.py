"""What the %%torchrun magic costs over typing `torchrun` yourself.

Runs the same small all_reduce program N times each way, alternating, on the same
number of ranks, and prints the median wall time of each and their ratio (goal <= 1.0;
the ratio is also reported for `make benchmark`, see benchmarks/_report.py):

    .venv/bin/python benchmarks/launcher_overhead.py [--nproc 2] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _report import report  # benchmarks/_report.py: one JSON line per figure for run_all.py

BODY = "t = torch.ones(1000) * rank\ndist.all_reduce(t)\nprint(f'rank {rank}: {t[0].item():g}')\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    from IPython.core.interactiveshell import InteractiveShell

    from course_lib.launch import launch, standalone_script

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "course_lib")
    script = os.path.join(tempfile.mkdtemp(), "bare.py")
    with open(script, "w") as f:  # the same program, as plain torchrun users write it
        f.write(standalone_script(BODY, backend="gloo", nproc=args.nproc))
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc))}
    bare_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", script]

    magic, bare = [], []
    quiet = lambda text, stream: None
    for i in range(args.repeats + 1):  # the first round warms the file cache and is dropped
        start = time.perf_counter()
        launch(BODY, args.nproc, backend="gloo", write=quiet)
        t_magic = time.perf_counter() - start
        start = time.perf_counter()
        subprocess.run(bare_cmd, check=True, capture_output=True, env=env)
        t_bare = time.perf_counter() - start
        if i:
            magic.append(t_magic)
            bare.append(t_bare)
    m, b = statistics.median(magic), statistics.median(bare)
    print(f"ranks: {args.nproc}, runs each: {args.repeats} (alternating)")
    print(f"%%torchrun cell : median {m:.3f} s")
    print(f"bare torchrun   : median {b:.3f} s")
    print(f"ratio           : {m / b:.3f}  (goal <= 1.0)")
    report(f"%%torchrun cell / bare torchrun, wall time, {args.nproc} ranks", m / b, "<= 1.0")


if __name__ == "__main__":
    main()
