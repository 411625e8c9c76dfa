"""Notebook 08's lab, kernel side: which slice of each weight lives on which rank."""

from __future__ import annotations

from typing import Any

from course_lib.models import BLOCK

# Kernel side (figures only): which slice of each of the course block's weights lives on which rank.

# (rows, columns, the dimension split over the ranks) of W in y = x Wᵀ + b
LAYERS = {
    "attention.q (column)": (BLOCK.d_model, BLOCK.d_model, 0),
    "attention.o (row)": (BLOCK.d_model, BLOCK.d_model, 1),
    "feed_forward.up (column)": (BLOCK.d_ff, BLOCK.d_model, 0),
    "feed_forward.down (row)": (BLOCK.d_model, BLOCK.d_ff, 1),
}


def draw_weight_shards(tp_size: int, layer: str) -> None:
    """Each rank's slice of `layer`'s weight: column-parallel splits W's rows (outputs), row-parallel its columns."""
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


def draw_fg_block(n_ranks: int = 2) -> None:
    """Megatron-LM's MLP on `n_ranks`: f, then each rank's column slice of W1, GELU, its row slice of W2, then g."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.7 * n_ranks))
    rows = [n_ranks - 1 - r - (n_ranks - 1) / 2 for r in range(n_ranks)]  # rank 0 on top, centred on 0

    def box(x: float, y: float, text: str, color: Any, width: float = 1.5) -> None:
        ax.add_patch(plt.Rectangle((x - width / 2, y - 0.28), width, 0.56, color=color, alpha=0.35))
        ax.text(x, y, text, ha="center", va="center", fontsize=8)

    box(0, 0, "X (whole)", "lightgray", 1.1)
    box(1.6, 0, "f", "tab:green", 0.6)
    box(7.4, 0, "g", "tab:red", 0.6)
    box(9, 0, "Y (whole)", "lightgray", 1.1)
    for r, y in enumerate(rows):
        box(3.2, y, f"X W1[rows of rank {r}]ᵀ", plt.cm.tab10(r % 10), 2.0)
        box(5.6, y, f"GELU · W2[cols of rank {r}]ᵀ", plt.cm.tab10(r % 10), 2.0)
        for (x0, y0), (x1, y1) in (((1.9, 0), (2.2, y)), ((4.2, y), (4.6, y)), ((6.6, y), (7.1, 0))):
            ax.annotate("", (x1, y1), (x0, y0), arrowprops=dict(arrowstyle="->", lw=0.8))
    for x0, x1 in ((0.55, 1.3), (7.7, 8.45)):
        ax.annotate("", (x1, 0), (x0, 0), arrowprops=dict(arrowstyle="->", lw=0.8))
    low = min(rows) - 0.55
    ax.text(1.6, low, "f: forward identity\nbackward all-reduce", ha="center", va="top", fontsize=8)
    ax.text(7.4, low, "g: forward all-reduce\nbackward identity", ha="center", va="top", fontsize=8)
    ax.text(
        4.4,
        low,
        "column-parallel, then row-parallel:\nno communication between them",
        ha="center",
        va="top",
        fontsize=8,
    )
    ax.set_xlim(-0.7, 9.7)
    ax.set_ylim(low - 0.8, max(rows) + 0.5)
    ax.axis("off")
    ax.set_title(f"a tensor-parallel MLP on {n_ranks} ranks (Megatron-LM's f and g)", fontsize=9)
    plt.tight_layout()
    plt.show()


def draw_async_tp(n_ranks: int = 4, t_comm: float = 3.0, t_mm: float = 4.0) -> None:
    """One rank's all-gather-then-matmul against the chunked ring, where step t's message travels during its matmul."""
    import matplotlib.pyplot as plt

    message, chunk = t_comm / (n_ranks - 1), t_mm / n_ranks
    fig, ax = plt.subplots(figsize=(8, 2.0))
    ax.barh(3, t_comm, color="tab:gray", edgecolor="white")
    ax.barh(3, t_mm, left=t_comm, color="tab:blue", edgecolor="white")
    start = 0.0
    for step in range(n_ranks):
        ax.barh(1, chunk, left=start, color="tab:blue", edgecolor="white")
        ax.text(start + chunk / 2, 1, f"rank r-{step}" if step else "mine", ha="center", va="center", fontsize=7)
        if step < n_ranks - 1:
            ax.barh(0, message, left=start, color="tab:gray", edgecolor="white")
        start += max(message, chunk) if step < n_ranks - 1 else chunk
    plain, chunked = t_comm + t_mm, max(t_comm, (n_ranks - 1) * t_mm / n_ranks) + t_mm / n_ranks
    assert abs(start - chunked) < 1e-9  # the drawing is the formula
    ax.set_yticks([0, 1, 3], ["chunked: messages", "chunked: matmuls", "plain: gather, matmul"])
    ax.set_xlabel("time (units)")
    ax.set_title(
        f"N={n_ranks}: plain {plain:g} = T_comm + T_mm; chunked {chunked:g} = max(T_comm, (N-1)T_mm/N) + T_mm/N",
        fontsize=9,
    )
    plt.tight_layout()
    plt.show()
