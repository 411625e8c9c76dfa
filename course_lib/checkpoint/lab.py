"""Kernel side of notebook 06: the read-plan figure (notebook 07's runs and figures are in fault_tolerance/lab.py)."""

from __future__ import annotations

import torch

from course_lib.checkpoint.sharded import read_plan, shard_rows


def draw_reads(saved_world: int, loading_world: int, rows: int) -> None:
    """Which rows each loading rank reads from which saved shard file: as a row layout (left) and as counts (right)."""
    import matplotlib.pyplot as plt

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
    for i, row in enumerate(matrix.tolist()):
        for j, value in enumerate(row):
            right.text(j, i, f"{value:g}", ha="center", va="center", fontsize=8)
    right.set_xticks(range(saved_world))
    right.set_yticks(range(loading_world))
    right.set(xlabel="saved shard", ylabel="loading rank", title="rows read")
    plt.tight_layout()
    plt.show()
