"""Plots of schedules (kernel-only): a Gantt chart of a timeline, simulated or measured."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from course_lib.pipeline.timeline import Event


def plot_timeline(ax: Any, events: Sequence[Event], n_ranks: int, title: str = "") -> None:
    """Gantt chart: one row per rank, forwards blue, backwards orange, weight gradients (W) green, by micro-batch."""
    import matplotlib.pyplot as plt

    t0 = min(e.start for e in events)
    scale = max(e.end for e in events) - t0
    for e in events:
        chunk = e.action.stage // n_ranks  # virtual stage index on its rank (0 unless interleaved)
        color = plt.cm.tab20({"F": 0, "B": 2, "W": 4}[e.action.kind] + chunk)
        ax.barh(e.rank, e.end - e.start, left=e.start - t0, height=0.8, color=color, edgecolor="white", linewidth=0.5)
        if (e.end - e.start) / scale > 0.018:
            ax.text((e.start + e.end) / 2 - t0, e.rank, str(e.action.microbatch), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)])
    ax.set_ylim(n_ranks - 0.5, -0.5)
    ax.set_title(title, fontsize=9)
