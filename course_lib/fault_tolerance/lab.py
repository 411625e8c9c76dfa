"""Notebook 07's lab: the pictures, drawn from what the runs asserted (world sizes, steps, quorums), no timings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from course_lib.checkpoint import Segment


def draw_rendezvous_rounds(worlds: Sequence[int], steps: Sequence[tuple[int, int]]) -> None:
    """One column per rendezvous round: admitted agents and worker ranks, steps trained, and what closed the round."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    fig, ax = plt.subplots(figsize=(11, 3.2))
    why = [
        "node 0 alone: MIN = 1 reached,\nround closes after last_call",
        "node 1 registers: node 0's agent\nrestarts its workers (no retry)",
        "node 1's agent stops (SIGTERM):\ncollectives fail (a retry)",
    ]
    for i, (world, (first, last)) in enumerate(zip(worlds, steps)):
        x = 3.6 * i
        ax.text(x + 1.4, 2.55, f"round {i + 1}: world size {world}", ha="center", fontweight="bold", fontsize=9)
        ax.text(x + 1.4, 2.2, f"steps {first}-{last}", ha="center", fontsize=8)
        for node in (0, 1):
            y = 1.2 - 0.9 * node
            inside = node < world
            box = FancyBboxPatch(
                (x, y),
                2.8,
                0.6,
                boxstyle="round,pad=0.03",
                linestyle="-" if inside else ":",
                facecolor="tab:blue" if node == 0 else "tab:orange",
                alpha=0.8 if inside else 0.08,
            )
            ax.add_patch(box)
            label = f"node {node}: agent + rank {node}" if inside else f"node {node}: not in this round"
            ax.text(x + 1.4, y + 0.3, label, ha="center", va="center", fontsize=8)
        ax.text(x + 1.4, -0.45, why[i] if i < len(why) else "", ha="center", va="top", fontsize=7.5, color="dimgray")
        if i:
            ax.annotate("", xy=(x - 0.05, 1.0), xytext=(x - 0.75, 1.0), arrowprops={"arrowstyle": "->"})
    ax.set(xlim=(-0.2, 3.6 * len(worlds)), ylim=(-1.3, 2.8))
    ax.axis("off")
    ax.set_title(
        "the c10d rendezvous: each round admits the agents present, numbers the workers, and starts them", fontsize=9
    )
    plt.tight_layout()
    plt.show()


def draw_replica_groups(quorum: dict[int, int], killed_at: int, healed_at: int) -> None:
    """torchft's traffic (lighthouse, managers, all-reduce, healing), and the quorum's size at each step."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.2), gridspec_kw={"width_ratios": [3, 2]})
    boxes = {
        "lighthouse": (1.5, 2.3),
        "replica group 0\nManager + DDP": (0.2, 0.4),
        "replica group 1\nManager + DDP": (2.8, 0.4),
    }
    for text, (x, y) in boxes.items():
        color = "lightgray" if text == "lighthouse" else ("tab:blue" if "0" in text else "tab:orange")
        left.text(
            x,
            y,
            text,
            ha="center",
            va="center",
            fontsize=8,
            bbox={"boxstyle": "round", "facecolor": color, "alpha": 0.5},
        )
    for x in (0.2, 2.8):
        left.annotate("", xy=(1.5, 2.05), xytext=(x, 0.75), arrowprops={"arrowstyle": "<->", "color": "gray"})
    left.text(0.55, 1.55, "heartbeat every 100 ms;\nquorum request per step", fontsize=7, color="gray", ha="center")
    left.annotate("", xy=(2.1, 0.3), xytext=(0.9, 0.3), arrowprops={"arrowstyle": "<->", "color": "tab:green"})
    left.text(
        1.5, 0.05, "all-reduce of gradients\n(the quorum's process group)", ha="center", fontsize=7, color="tab:green"
    )
    left.annotate(
        "", xy=(2.1, 0.65), xytext=(0.9, 0.65), arrowprops={"arrowstyle": "->", "color": "tab:red", "linestyle": "--"}
    )
    left.text(1.5, 0.8, "heal: state from a peer", ha="center", fontsize=7, color="tab:red")
    left.set(xlim=(-0.6, 3.6), ylim=(-0.4, 2.7))
    left.axis("off")
    steps = sorted(quorum)
    right.step(steps, [quorum[s] for s in steps], where="mid", color="tab:blue")
    right.axvline(killed_at - 0.5, color="red", linestyle=":", label=f"replica 1 killed before step {killed_at}")
    right.axvline(healed_at, color="tab:green", linestyle="--", label=f"new replica 1 heals at step {healed_at}")
    right.set(
        xlabel="step",
        ylabel="replica groups in the quorum",
        yticks=[1, 2],
        ylim=(0.5, 2.5),
        title="the quorum, step by step",
    )
    right.legend(fontsize=7, loc="lower left")
    plt.tight_layout()
    plt.show()


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
