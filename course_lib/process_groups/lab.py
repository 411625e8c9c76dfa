"""Notebook 00's lab, kernel side: the global rank of every process of a multi-node job."""

from __future__ import annotations

# Kernel side (figures only): the global rank of every process of a multi-node job.


def draw_rank_grid(nnodes: int, nproc_per_node: int) -> None:
    """One row per node, one box per process: its global RANK = node * nproc_per_node + LOCAL_RANK."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1 + 0.7 * nproc_per_node, 0.5 + 0.6 * nnodes))
    for node in range(nnodes):
        for local in range(nproc_per_node):
            r = node * nproc_per_node + local
            ax.add_patch(
                plt.Rectangle((local, nnodes - 1 - node), 0.95, 0.9, color=plt.cm.tab10(node % 10), alpha=0.35)
            )
            ax.text(local + 0.47, nnodes - 0.55 - node, str(r), ha="center", va="center", fontsize=9)
    ax.set_xlim(0, nproc_per_node)
    ax.set_ylim(0, nnodes)
    ax.set_xticks([i + 0.47 for i in range(nproc_per_node)], [str(i) for i in range(nproc_per_node)])
    ax.set_yticks([nnodes - 0.55 - n for n in range(nnodes)], [f"node {n}" for n in range(nnodes)])
    ax.set_xlabel("LOCAL_RANK (GPU index)")
    ax.set_title(f"global RANK, WORLD_SIZE = {nnodes * nproc_per_node}")
    plt.show()
