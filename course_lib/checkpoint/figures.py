"""Kernel side (figures only): the loss curve of an elastic run against uninterrupted runs; who reads which rows
when a checkpoint is loaded at another world size."""

from __future__ import annotations

from typing import TYPE_CHECKING

from course_lib.checkpoint.elastic import Segment
from course_lib.checkpoint.sharded import read_plan, shard_rows

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


def draw_reads(saved_world: int, loading_world: int, rows: int) -> None:
    """Left: the rows of one tensor, the saved files (top) and what each loading rank reads from which (bottom).
    Right: rows each loading rank reads from each saved shard."""
    import matplotlib.pyplot as plt
    import torch

    plan = read_plan(rows, saved_world, loading_world)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3), gridspec_kw={"width_ratios": [3, 2]})
    for saved in range(saved_world):
        start, stop = shard_rows(rows, saved_world, saved)
        left.broken_barh([(start, stop - start)], (1.1, 0.8), color=plt.cm.tab10(saved % 10), edgecolor="white")
        if stop > start:
            left.text((start + stop) / 2, 1.5, f"shard_{saved}", ha="center", va="center", fontsize=8)
    matrix = torch.zeros(loading_world, saved_world)
    for loading, reads in enumerate(plan):
        for saved, lo, hi in reads:
            left.broken_barh([(lo, hi - lo)], (0, 0.8), color=plt.cm.tab10(saved % 10), edgecolor="white")
            matrix[loading, saved] = hi - lo
        start, stop = shard_rows(rows, loading_world, loading)
        left.axvline(start, ymax=0.45, color="black", linewidth=1)
        if stop > start:
            left.text((start + stop) / 2, -0.3, f"rank {loading}", ha="center", fontsize=8)
    left.set_yticks([0.4, 1.5], [f"load ({loading_world})", f"saved ({saved_world})"])
    left.set(xlim=(0, rows), ylim=(-0.6, 2), xlabel="row of the tensor")
    left.set_title("colour = the saved file each row is read from")
    right.imshow(matrix, cmap="Blues", aspect="auto")
    for (i, j), value in zip(
        torch.cartesian_prod(torch.arange(loading_world), torch.arange(saved_world)).tolist(), matrix.flatten().tolist()
    ):
        right.text(j, i, f"{value:g}", ha="center", va="center", fontsize=8)
    right.set_xticks(range(saved_world))
    right.set_yticks(range(loading_world))
    right.set(xlabel="saved shard", ylabel="loading rank", title="rows read")
    plt.tight_layout()
    plt.show()
