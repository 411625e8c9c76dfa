"""Plots of schedules (kernel-only): a Gantt chart of a timeline, simulated or measured; the schedule explorer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from course_lib.pipeline.schedules import peak_in_flight, schedule_actions
from course_lib.pipeline.timeline import Event, bubble_fraction, simulate


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


def draw_schedule(
    schedule: str, stages: int, microbatches: int, measured: dict[tuple[str, int, int], list[Event]] | None = None
) -> None:
    """Left: the ideal timeline of `schedule` (t_f = 10, t_b = 20, t_w = 10 ms), its bubble and the micro-batches rank 0
    holds. Right: the measured timeline of the same (schedule, stages, microbatches), if `measured` has it (seconds)."""
    import matplotlib.pyplot as plt

    v = 2 if schedule == "interleaved 1F1B" else 1
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.8 + 0.45 * stages), sharey=True)
    try:
        actions = schedule_actions(schedule, stages, microbatches)
        ideal = simulate(actions, stages * v, t_forward=10, t_backward=20, t_weight=10)
        held = sum(peak_in_flight(actions[0]).values()) / v
        title = f"ideal: bubble {bubble_fraction(ideal, stages):.3f}, rank 0 holds {held:g} micro-batches"
        plot_timeline(axes[0], ideal, stages, title)
    except ValueError as error:
        axes[0].set_title(str(error), fontsize=8)
    events = (measured or {}).get((schedule, stages, microbatches))
    if events:
        in_ms = [e._replace(start=e.start * 1e3, end=e.end * 1e3) for e in events]
        plot_timeline(axes[1], in_ms, stages, f"measured: bubble {bubble_fraction(in_ms, stages):.3f}")
    else:
        axes[1].set_title("not measured in section 4", fontsize=8)
    axes[0].set_xlabel("ms")
    axes[1].set_xlabel("ms")
    plt.tight_layout()
    plt.show()
