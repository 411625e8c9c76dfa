"""Kernel side (figures only): the loss curve of an elastic run against uninterrupted runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from course_lib.checkpoint.elastic import Segment

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot_elastic(segments: list[Segment], references: dict[int, list[float]]) -> Figure:
    """Each start's losses (colour = world size) over the uninterrupted runs at each world size."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3))
    styles = {1: ("tab:blue", "-"), 2: ("tab:orange", "--")}
    for world, losses in sorted(references.items()):
        color, line = styles.get(world, ("gray", ":"))
        ax.plot(range(len(losses)), losses, line, color=color, alpha=0.5, label=f"uninterrupted, {world} rank(s)")
    for i, segment in enumerate(segments):
        color, _ = styles.get(segment.world, ("gray", ":"))
        ax.plot(segment.steps, segment.losses, "o", color=color, label=f"elastic, {segment.world} rank(s)")
        if i:
            ax.axvline(segment.steps[0] - 0.5, color="gray", linestyle=":", linewidth=1)
            change = "joins" if segment.world > segments[i - 1].world else "leaves"
            ax.text(segment.steps[0] - 0.4, max(segment.losses), f"node 1 {change}", fontsize=8, va="top")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.set(xlabel="step", ylabel="loss (global batch)", title="one loss curve across two membership changes")
    fig.tight_layout()
    return fig
