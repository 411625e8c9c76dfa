"""Run every benchmark script and print one table: figure, goal, measured (`make benchmark`).

    .venv/bin/python benchmarks/run_all.py                  # every script in benchmarks/
    .venv/bin/python benchmarks/run_all.py ddp rpc          # some of them (file name prefixes)
    .venv/bin/python benchmarks/run_all.py --show-output    # also each script's own output

Scripts run one after another (they would slow each other down), each as `python SCRIPT` with a
time limit. A script reports its figures with benchmarks/_report.py: one JSON line per figure.
Exit status 1 when a script fails, times out or reports nothing; a missed goal is shown, not fatal
(times on a shared machine are noisy: rerun the script alone to confirm).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def scripts(selectors: list[str]) -> list[Path]:
    every = sorted(p for p in HERE.glob("*.py") if not p.name.startswith("_") and p.name != Path(__file__).name)
    if not selectors:
        return every
    chosen = [p for p in every if any(p.stem.startswith(s) for s in selectors)]
    if not chosen:
        raise SystemExit(f"no benchmark matches {selectors}; there are: {', '.join(p.stem for p in every)}")
    return chosen


def figures(stdout: str) -> list[dict]:
    """The JSON lines a script printed with _report.report."""
    found = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{") and '"figure"' in line:
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return found


def run(script: Path, timeout: float, show_output: bool) -> tuple[list[dict], str, float]:
    """(figures, problem or "", seconds) for one script."""
    start = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=timeout, cwd=HERE.parent
        )
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout if isinstance(expired.stdout, str) else (expired.stdout or b"").decode(errors="replace")
        return figures(out), f"timed out after {timeout:g} s", time.monotonic() - start
    seconds = time.monotonic() - start
    if show_output:
        print(done.stdout, end="")
        print(done.stderr, end="", file=sys.stderr)
    found = figures(done.stdout)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return found, f"exit {done.returncode}: {last[:100]}", seconds
    if not found:
        return found, "reported no figure (see benchmarks/_report.py)", seconds
    return found, "", seconds


def table(rows: list[tuple[str, str, str, str, str]]) -> str:
    header = ("script", "figure", "goal", "measured", "met")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scripts", nargs="*", help="benchmark file name prefixes (default: all)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds one script may run (default 1200)")
    parser.add_argument("--show-output", action="store_true", help="print each script's own output too")
    args = parser.parse_args(argv)

    chosen = scripts(args.scripts)
    rows: list[tuple[str, str, str, str, str]] = []
    failed = []
    for i, script in enumerate(chosen, 1):
        print(f"[{i}/{len(chosen)}] {script.name}", end=" ", flush=True)
        found, problem, seconds = run(script, args.timeout, args.show_output)
        print(f"{seconds:.0f} s" + (f"  FAILED: {problem}" if problem else ""), flush=True)
        for f in found:
            met = {True: "yes", False: "NO", None: ""}[f.get("met")]
            rows.append((script.stem, str(f["figure"]), str(f["goal"]), f"{f['measured']:g}", met))
        if problem:
            failed.append(script.stem)
            rows.append((script.stem, "-", "-", "-", problem))
    print()
    print(table(rows))
    missed = sum(r[4] == "NO" for r in rows)
    print(f"\n{len(rows) - len(failed)} figures, {missed} goals missed, {len(failed)} scripts failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
