"""Notebook 01, kernel side only: the ring simulated step by step, and pictures of who holds what."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from course_lib.collectives.live import contribution_label
from course_lib.collectives.ring import ring_step

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


# ---------------------------------------------------------------------------
# The ring, step by step (the notebook's explorer draws this)


def ring_all_reduce_states(world_size: int) -> list[dict]:
    """Simulate the ring all-reduce without any process: what each rank holds after each step.

    Returns one entry per step (2(N-1) steps, plus the start): `holds[r][c]` is the set of ranks
    whose contribution chunk c on rank r contains, and `sends[r]` the chunk rank r sends at this
    step (None at the start). Uses :func:`ring_step`, the schedule the real code runs.
    """
    n = world_size
    holds = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    states: list[dict[str, Any]] = [{"phase": "start", "step": None, "sends": [None] * n, "holds": holds}]
    for phase in ("reduce_scatter", "all_gather"):
        for step in range(n - 1):
            moves = [ring_step(r, n, step, phase) for r in range(n)]
            new = [row[:] for row in holds]
            for r in range(n):
                send_chunk = moves[r][0]
                receiver = (r + 1) % n
                assert moves[receiver][1] == send_chunk  # the schedule pairs every send with a receive
                incoming = holds[r][send_chunk]
                new[receiver][send_chunk] = (
                    holds[receiver][send_chunk] | incoming if phase == "reduce_scatter" else incoming
                )
            holds = new
            states.append({"phase": phase, "step": step, "sends": [m[0] for m in moves], "holds": holds})
    return states


def draw_ring_step(world_size: int, step: int, ax: Axes | None = None) -> Axes:
    """Grid of ranks × chunks after `step` (0 = start) of the ring all-reduce; arrows: what was sent.

    A cell's shade is how many ranks' contributions it holds (dark = all N: fully reduced).
    """
    import matplotlib.pyplot as plt

    states = ring_all_reduce_states(world_size)
    step = max(0, min(step, len(states) - 1))
    state = states[step]
    n = world_size
    if ax is None:
        _, ax = plt.subplots(figsize=(1.2 + 0.9 * n, 0.8 + 0.7 * n))
    cmap = plt.cm.Blues
    for r in range(n):
        for c in range(n):
            count = len(state["holds"][r][c])
            ax.add_patch(plt.Rectangle((c, n - 1 - r), 0.94, 0.9, color=cmap(0.15 + 0.8 * count / n)))
            label = contribution_label(state["holds"][r][c], n)
            ax.text(
                c + 0.47,
                n - 0.45 - r,
                label,
                ha="center",
                va="center",
                fontsize=8,
                color="white" if count == n else "black",
            )
        sent = state["sends"][r]
        if sent is not None:  # framed in red, with its destination: what rank r sent at this step
            ax.add_patch(plt.Rectangle((sent, n - 1 - r), 0.94, 0.9, fill=False, edgecolor="crimson", lw=2))
            ax.text(
                sent + 0.47,
                n - 0.8 - r,
                f"sent → r{(r + 1) % n}",
                ha="center",
                va="center",
                fontsize=7,
                color="crimson",
                bbox=dict(facecolor="white", edgecolor="none", pad=1),
            )
    ax.set_xlim(0, n)
    ax.set_ylim(0, n)
    ax.set_xticks([c + 0.47 for c in range(n)], [f"chunk {c}" for c in range(n)], fontsize=8)
    ax.set_yticks([n - 0.55 - r for r in range(n)], [f"rank {r}" for r in range(n)], fontsize=8)
    what = (
        "start: rank r holds only its own data"
        if state["step"] is None
        else (f"{state['phase'].replace('_', '-')} step {state['step'] + 1} of {n - 1}")
    )
    ax.set_title(f"ring all-reduce, N = {n}: {what}", fontsize=9)
    return ax


# ---------------------------------------------------------------------------
# Pictures of who holds what


def draw_holdings(
    ax: Axes, values: Sequence, title: str, vmax: float | None = None, columns: int | None = None
) -> None:
    """One row per rank, one cell per element, the value written in it; None = nothing defined.

    `columns` fixes the width (in cells) so panels of different lengths share one scale.
    """
    import matplotlib.pyplot as plt

    rows = [None if v is None else [float(x) for x in torch.as_tensor(v).reshape(-1)] for v in values]
    width = max([len(r) for r in rows if r is not None] + [columns or 1])
    top = vmax or max((max(r) for r in rows if r), default=1.0) or 1.0
    for i, row in enumerate(rows):
        y = len(rows) - 1 - i
        if row is None:
            ax.text(width / 2, y + 0.45, "(unspecified)", ha="center", va="center", fontsize=7, color="gray")
            continue
        for j, value in enumerate(row):
            ax.add_patch(plt.Rectangle((j, y), 0.94, 0.9, color=plt.cm.YlGn(0.1 + 0.7 * value / top)))
            ax.text(j + 0.47, y + 0.45, f"{value:g}", ha="center", va="center", fontsize=7)
    ax.set_xlim(0, width)
    ax.set_ylim(0, len(rows))
    ax.set_yticks([len(rows) - 0.55 - i for i in range(len(rows))], [f"r{i}" for i in range(len(rows))], fontsize=7)
    ax.set_xticks([])
    ax.set_title(title, fontsize=8)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)


def draw_before_after(held: Sequence[tuple[Any, Any]], title: str) -> Figure:
    """Two panels, one row per rank in each: every rank's buffer before and after a collective.

    `held[r]` is rank r's (before, after), None where the collective reads or defines nothing there.
    """
    import matplotlib.pyplot as plt

    shown = [torch.as_tensor(v).reshape(-1) for pair in held for v in pair if v is not None]
    top = max(float(v.max()) for v in shown) or 1.0
    columns = max(v.numel() for v in shown)
    fig, (ax_before, ax_after) = plt.subplots(1, 2, figsize=(2 + 0.7 * columns, 0.7 + 0.35 * len(held)))
    draw_holdings(ax_before, [before for before, _ in held], f"{title}: before", top, columns)
    draw_holdings(ax_after, [after for _, after in held], "after", top, columns)
    fig.tight_layout()
    return fig
