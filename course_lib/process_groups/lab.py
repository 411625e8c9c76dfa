"""Notebook 00's lab, kernel side: the global rank of every process of a multi-node job."""

from __future__ import annotations

from course_lib import viz

# Kernel side (figures only): the global rank of every process of a multi-node job.


def draw_ranks_on_nodes(nnodes: int, nproc_per_node: int) -> None:
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


def draw_rendezvous(world_size: int) -> None:
    """Section 2: ranks swap notes through the store (left), then init_process_group connects the backend (right)."""
    import matplotlib.pyplot as plt

    n = world_size
    fig, (ax_store, ax_backend) = plt.subplots(1, 2, figsize=(9, 2.6))
    xs = [(r + 0.5) / n for r in range(n)]
    viz.label_box(ax_store, 0.5, 0.85, "store (TCPStore)\nMASTER_ADDR:MASTER_PORT", "khaki")
    for r, x in enumerate(xs):
        viz.label_box(ax_store, x, 0.12, f"rank {r}")
        ax_store.annotate("", (0.5 + (x - 0.5) * 0.4, 0.72), (x - 0.02, 0.22), arrowprops=dict(arrowstyle="->"))
        ax_store.annotate(
            "",
            (x + 0.02, 0.22),
            (0.5 + (x - 0.5) * 0.4 + 0.02, 0.72),
            arrowprops=dict(arrowstyle="->", color="tab:green"),
        )
        ax_store.text(x, 0.0, f"set note/{r}\nget note/{(r + 1) % n}", ha="center", va="top", fontsize=7)
    ax_store.set_title("1. rendezvous: the ranks meet at the store", fontsize=9)
    for r, x in enumerate(xs):  # the backend: a connection between every pair (gloo: TCP; NCCL: NVLink, IB)
        viz.label_box(ax_backend, x, 0.5 + 0.3 * (-1) ** r, f"rank {r}", zorder=2)
        for s in range(r + 1, n):
            ax_backend.plot([x, xs[s]], [0.5 + 0.3 * (-1) ** r, 0.5 + 0.3 * (-1) ** s], color="gray", zorder=1)
    ax_backend.set_title("2. init_process_group: the backend links the ranks", fontsize=9)
    for ax in (ax_store, ax_backend):
        ax.set_xlim(0, 1)
        ax.set_ylim(-0.15, 1)
        ax.axis("off")
    plt.show()


def draw_mesh(dp: int, tp: int, names: tuple[str, str] = ("dp", "tp")) -> None:
    """A dp x tp rank grid, row-major as init_device_mesh: rows are names[1] groups, columns names[0] groups."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2.4 + 1.3 * tp, 0.8 + 0.9 * dp))
    for i in range(dp):
        y = dp - 1 - i
        ax.add_patch(plt.Rectangle((-0.05, y + 0.05), tp - 0.1, 0.9, fill=False, edgecolor="tab:red", lw=1.5))
        ax.text(
            tp - 0.05,
            y + 0.5,
            f" {names[1]} group {[i * tp + j for j in range(tp)]}",
            va="center",
            fontsize=8,
            color="tab:red",
        )
        for j in range(tp):
            viz.label_box(ax, j + 0.45, y + 0.5, f"rank {i * tp + j}", fontsize=9)
    for j in range(tp):
        ax.add_patch(plt.Rectangle((j + 0.02, -0.02), 0.86, dp + 0.04, fill=False, edgecolor="tab:blue", ls="--"))
        ax.text(
            j + 0.45,
            -0.12,
            f"{names[0]} group\n{[i * tp + j for i in range(dp)]}",
            ha="center",
            va="top",
            fontsize=8,
            color="tab:blue",
        )
    ax.set_xlim(-0.1, tp + 1.4)
    ax.set_ylim(-0.7, dp + 0.1)
    ax.axis("off")
    ax.set_title(f"{names[0]} x {names[1]} = {dp} x {tp}: rank = {tp} {names[0]} + {names[1]}", fontsize=9)
    plt.show()
