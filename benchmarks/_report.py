"""How a benchmark script reports its figures to `make benchmark` (benchmarks/run_all.py).

    from _report import report
    report("%%torchrun / bare torchrun, wall time", ratio, "<= 1.0")

Each call prints one JSON line {"figure", "goal", "measured", "met"} on stdout; run_all.py collects
those lines from every script into one table. Goals are ratios or fractions, not absolute times:
the same machine type runs 2-3x faster or slower from one day to the next.
Goals read "<= X", ">= X", "< X", "> X" or "A..B" (a range, both ends included); any other goal
text is shown as it is, with `met` left empty.
"""

from __future__ import annotations

import json
import re

_GOAL = re.compile(r"^\s*(<=|>=|<|>)\s*([-+0-9.eE]+)\s*$|^\s*([-+0-9.eE]+)\s*\.\.\s*([-+0-9.eE]+)\s*$")


def goal_met(goal: str, measured: float) -> bool | None:
    """Whether `measured` meets `goal` ("<= 1.1", ">= 2", "0.4..0.6"); None when the goal is free text."""
    match = _GOAL.match(goal)
    if not match:
        return None
    op, bound, low, high = match.groups()
    if op is None:
        return float(low) <= measured <= float(high)
    limit = float(bound)
    return {
        "<=": measured <= limit,
        ">=": measured >= limit,
        "<": measured < limit,
        ">": measured > limit,
    }[op]


def report(figure: str, measured: float, goal: str) -> dict:
    """Print one figure as a JSON line for run_all.py, and return it."""
    line = {"figure": figure, "goal": goal, "measured": round(float(measured), 4), "met": goal_met(goal, measured)}
    print(json.dumps(line), flush=True)
    return line
