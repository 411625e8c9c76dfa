"""Notebook 08's lab, kernel side: which slice of each weight lives on which rank."""

from __future__ import annotations

from course_lib.models import BLOCK

# Kernel side (figures only): which slice of each of the course block's weights lives on which rank.

# (rows, columns, the dimension split over the ranks) of W in y = x Wᵀ + b
LAYERS = {
    "attention.q (column)": (BLOCK.d_model, BLOCK.d_model, 0),
    "attention.o (row)": (BLOCK.d_model, BLOCK.d_model, 1),
    "feed_forward.up (column)": (BLOCK.d_ff, BLOCK.d_model, 0),
    "feed_forward.down (row)": (BLOCK.d_model, BLOCK.d_ff, 1),
}


def draw_shards(tp_size: int, layer: str) -> None:
    """The weight of `layer`, each rank's slice in its colour: column-parallel splits the rows of W (the
    outputs), row-parallel its columns (the inputs)."""
    import matplotlib.pyplot as plt

    rows, cols, split_dim = LAYERS[layer]
    size = (rows, cols)[split_dim]
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    if size % tp_size:
        ax.text(0.5, 0.5, f"{size} does not split over {tp_size} ranks", ha="center", va="center")
        ax.axis("off")
        plt.show()
        return
    part = size // tp_size
    for r in range(tp_size):
        x0, y0, w, h = (0, r * part, cols, part) if split_dim == 0 else (r * part, 0, part, rows)
        ax.add_patch(plt.Rectangle((x0, y0), w, h, color=plt.cm.tab10(r % 10), alpha=0.5))
        ax.text(x0 + w / 2, y0 + h / 2, f"rank {r}", ha="center", va="center", fontsize=8)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_xlabel("input features (columns of W)")
    ax.set_ylabel("output features (rows of W)")
    ax.set_title(f"{layer}: W is {rows}×{cols}, {rows * cols // tp_size} numbers per rank")
    plt.tight_layout()
    plt.show()
