"""Notebook 01's lab: a collective on the live ranks, the ring simulated step by step, torch's collectives timed."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from course_lib import viz
from course_lib.collectives.ring import (
    alpha_beta_time,
    bus_factor,
    bytes_sent_per_rank,
    naive_all_reduce,
    ring_all_reduce,
    ring_step,
)
from course_lib.launch.runtime import rank_device, synchronize

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# Notebook 01 on the session's live ranks: one collective by name on example data (the explorer
# drives it), and the 2^r encoding that says which ranks' data a value of the stepped ring contains.
#
# Rank side: call :func:`run_collective` on every rank (``view.apply_sync(run_collective, name, k)``).

# The explorer's choices; the first is its default view.
EXPLORER_COLLECTIVES = [
    "reduce_scatter_single",
    "all_gather_single",
    "all_reduce",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
]


def example_data(rank: int, world_size: int, per_rank: int) -> torch.Tensor:
    """Rank r's N × per_rank values 10r + i (100r + i past 10 elements): each value shows its rank and position."""
    numel = world_size * per_rank
    return torch.arange(numel, dtype=torch.float32) + (10 if numel <= 10 else 100) * rank


def run_collective(name: str, per_rank: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """This rank's (before, after) of `name` on the example data, on the CPU; None where it reads or defines nothing."""
    if name not in EXPLORER_COLLECTIVES:
        raise ValueError(f"unknown collective {name!r}: choose one of {EXPLORER_COLLECTIVES}")
    rank, n = dist.get_rank(), dist.get_world_size()
    x = example_data(rank, n, per_rank).to(rank_device())
    share = x[:per_rank].clone()
    before: torch.Tensor | None = x
    after: torch.Tensor | None
    if name == "broadcast":
        after = x.clone()
        dist.broadcast(after, src=0)
    elif name == "reduce":
        after = x.clone()
        dist.reduce(after, dst=0)
        after = after if rank == 0 else None  # elsewhere the buffer is scratch
    elif name == "all_reduce":
        after = x.clone()
        dist.all_reduce(after)
    elif name == "gather":
        parts = [torch.empty_like(share) for _ in range(n)] if rank == 0 else None
        dist.gather(share, parts, dst=0)
        before, after = share, (torch.cat(parts) if parts is not None else None)
    elif name == "scatter":
        after = torch.empty_like(share)
        dist.scatter(after, list(x.chunk(n)) if rank == 0 else None, src=0)
        before = x if rank == 0 else None
    elif name == "all_gather_single":
        after = torch.empty_like(x)
        dist.all_gather_single(after, share)
        before = share
    elif name == "reduce_scatter_single":
        after = torch.empty_like(share)
        dist.reduce_scatter_single(after, x)
    else:  # all_to_all_single
        after = torch.empty_like(x)
        dist.all_to_all_single(after, x)
    return _on_cpu(before), _on_cpu(after)


def _on_cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.cpu()


def contributors(value: float, world_size: int) -> frozenset[int]:
    """The ranks whose 2^r a value contains: 3 = 2^0 + 2^1 -> {0, 1}."""
    return frozenset(r for r in range(world_size) if int(value) >> r & 1)


def contribution_label(ranks: Iterable[int], world_size: int) -> str:
    """'0+2' for the ranks a chunk contains, 'Σ' once it contains all of them."""
    ranks = sorted(ranks)
    return "Σ" if len(ranks) == world_size else "+".join(str(r) for r in ranks)


def describe_chunks(values: torch.Tensor, world_size: int) -> str:
    """Label each chunk of a 2^r-encoded buffer (one element per chunk) with the ranks summed into it."""
    labels = [contribution_label(contributors(v, world_size), world_size) for v in values.tolist()]
    return "  ".join(f"chunk {c}: {label:<5}" for c, label in enumerate(labels)).rstrip()


# Notebook 01, kernel side only: the ring simulated step by step, and pictures of who holds what.


def ring_all_reduce_states(world_size: int) -> list[dict]:
    """Simulate the ring all-reduce without any process: what each rank holds after each step."""
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
    """Grid of ranks × chunks after `step` (0 = start) of the ring all-reduce; arrows: what was sent."""
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


def draw_holdings(
    ax: Axes, values: Sequence, title: str, vmax: float | None = None, columns: int | None = None
) -> None:
    """One row per rank, one cell per element, the value written in it; None = nothing defined."""
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
    """Two panels, one row per rank in each: every rank's buffer before and after a collective."""
    import matplotlib.pyplot as plt

    shown = [torch.as_tensor(v).reshape(-1) for pair in held for v in pair if v is not None]
    top = max(float(v.max()) for v in shown) or 1.0
    columns = max(v.numel() for v in shown)
    fig, (ax_before, ax_after) = plt.subplots(1, 2, figsize=(2 + 0.7 * columns, 0.7 + 0.35 * len(held)))
    draw_holdings(ax_before, [before for before, _ in held], f"{title}: before", top, columns)
    draw_holdings(ax_after, [after for _, after in held], "after", top, columns)
    fig.tight_layout()
    return fig


def draw_bytes_per_rank(max_world_size: int = 64) -> None:
    """Section 1's table as curves: bytes each rank sends per byte of the tensor, against N (the formulas)."""
    import matplotlib.pyplot as plt

    ns = range(2, max_world_size + 1)
    fig, ax = plt.subplots(figsize=(6, 2.6))
    for name, label in [
        ("naive_all_reduce", "naive all-reduce, rank 0: N-1"),
        ("all_reduce", "ring all-reduce: 2(N-1)/N"),
        ("reduce_scatter", "reduce-scatter, all-gather: (N-1)/N"),
    ]:
        ax.plot(ns, [bytes_sent_per_rank(name, 1.0, n) for n in ns], label=label)
    ax.set_yscale("log")
    ax.set_xlabel("ranks N")
    ax.set_ylabel("bytes sent per rank / S")
    ax.legend(fontsize=8)
    ax.set_title("the ring's bytes per rank stay below 2S; the naive root's grow with N", fontsize=9)
    plt.show()


def draw_deadlock(world_size: int) -> None:
    """Ranks in a circle, each blocked receiving from its left: the waits-for arrows form a cycle nothing breaks."""
    import math

    import matplotlib.pyplot as plt

    n = world_size
    at = [(math.sin(2 * math.pi * r / n), math.cos(2 * math.pi * r / n)) for r in range(n)]
    fig, ax = plt.subplots(figsize=(3.2, 3.2))
    for r, (x, y) in enumerate(at):
        viz.label_box(ax, x, y, f"rank {r}\nin recv", "mistyrose", zorder=2)
        lx, ly = at[(r - 1) % n]
        ax.annotate(
            "",
            (0.8 * lx + 0.2 * x, 0.8 * ly + 0.2 * y),
            (0.8 * x + 0.2 * lx, 0.8 * y + 0.2 * ly),
            arrowprops=dict(arrowstyle="->", color="crimson", connectionstyle="arc3,rad=0.2"),
        )
    ax.set_xlim(-1.5, 1.5)
    ax.set_ylim(-1.5, 1.5)
    ax.axis("off")
    ax.set_title("every rank waits for its left neighbour", fontsize=9)
    plt.show()


def draw_all_holdings(held: Sequence[dict[str, tuple[Any, Any]]]) -> None:
    """Every collective section 3 ran, before and after, from what each rank kept: held[r][name] = (before, after)."""
    import matplotlib.pyplot as plt

    n, names = len(held), list(held[0])
    values = [v for kept in held for pair in kept.values() for v in pair if v is not None]
    top = float(max(v.max() for v in values))
    fig, axes = plt.subplots((len(names) + 1) // 2, 4, figsize=(10, 1.1 + 0.42 * n * (len(names) + 1) // 2))
    for i, name in enumerate(names):
        draw_holdings(axes.flat[2 * i], [held[r][name][0] for r in range(n)], f"{name}: before", top, n)
        draw_holdings(axes.flat[2 * i + 1], [held[r][name][1] for r in range(n)], "after", top, n)
    fig.tight_layout()
    plt.show()


def draw_bandwidth(rows: Sequence[dict], alpha: float, beta: float, world_size: int) -> None:
    """Section 6: bus bandwidth and time per collective against size, and the fitted alpha-beta all_reduce (dashed)."""
    import matplotlib.pyplot as plt
    import numpy as np

    sizes = sorted({row["bytes"] for row in rows})
    fine = np.geomspace(sizes[0], sizes[-1], 100)
    model = np.array([alpha_beta_time("all_reduce", s, world_size, alpha, beta) for s in fine])
    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name in dict.fromkeys(row["name"] for row in rows):
        series = [row for row in rows if row["name"] == name]
        ax_bw.plot([r["bytes"] for r in series], [r["busbw"] / 1e6 for r in series], marker="o", label=name)
        ax_t.plot([r["bytes"] for r in series], [r["seconds"] * 1e3 for r in series], marker="o", label=name)
    ax_bw.plot(fine, fine * bus_factor("all_reduce", world_size) / model / 1e6, "k--", label="alpha-beta model")
    ax_t.plot(fine, model * 1e3, "k--", label="alpha-beta model (all_reduce)")
    for ax, label in ((ax_bw, "bus bandwidth (MB/s)"), (ax_t, "time (ms, slowest rank, median)")):
        ax.set_xscale("log")
        ax.set_xlabel("message size S (bytes)")
        ax.set_ylabel(label)
    ax_t.set_yscale("log")
    ax_bw.set_title(f"bus bandwidth, {world_size} ranks")
    ax_t.set_title("time")
    ax_bw.legend(fontsize=7)
    fig.tight_layout()
    plt.show()


# Notebook 01: time torch's collectives and the from-scratch ring on every rank; the rows as a table.


def collective_calls(world_size: int) -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]:
    """name -> call(full, shard): full is the whole tensor (numel divisible by N), shard one N-th."""
    return {
        "all_reduce": lambda full, shard: dist.all_reduce(full),
        "ring_all_reduce": lambda full, shard: ring_all_reduce(full),
        "naive_all_reduce": lambda full, shard: naive_all_reduce(full),
        "all_gather": lambda full, shard: dist.all_gather_single(full, shard),
        "reduce_scatter": lambda full, shard: dist.reduce_scatter_single(shard, full),
        "broadcast": lambda full, shard: dist.broadcast(full, src=0),
    }


def benchmark(
    sizes_bytes: Sequence[int],
    names: Sequence[str],
    repeats: int = 5,
    device: torch.device | str = "cpu",
    warmup: int = 1,
) -> list[dict]:
    """Time each collective per size on all ranks; sizes alternate so a shared machine's slow phases hit all alike."""
    device = torch.device(device)
    n = dist.get_world_size()
    calls = collective_calls(n)
    rows = []
    for nbytes in sizes_bytes:
        numel = max(n, nbytes // 4 // n * n)  # float32, divisible by N
        full = torch.ones(numel, device=device)
        shard = torch.ones(numel // n, device=device)
        times: dict[str, list[float]] = {name: [] for name in names}
        for round_index in range(warmup + repeats):
            for name in names:
                full.fill_(1.0)
                synchronize(device)
                dist.barrier()
                start = time.perf_counter()
                calls[name](full, shard)
                synchronize(device)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the collective ends when the last rank is done
                if round_index >= warmup:
                    times[name].append(elapsed.item())
        size = numel * 4
        for name in names:
            seconds = statistics.median(times[name])
            algbw = size / seconds
            rows.append(
                {"name": name, "bytes": size, "seconds": seconds, "algbw": algbw, "busbw": algbw * bus_factor(name, n)}
            )
    return rows


def format_table(rows: Sequence[dict]) -> str:
    """Benchmark rows as a text table (time in µs, bandwidths in MB/s)."""
    lines = [f"{'collective':>17} {'size':>9} {'time':>12} {'algbw':>14} {'busbw':>14}"]
    for row in rows:
        lines.append(
            f"{row['name']:>17} {human_bytes(row['bytes']):>9} {row['seconds'] * 1e6:>9.0f} us "
            f"{row['algbw'] / 1e6:>9.1f} MB/s {row['busbw'] / 1e6:>9.1f} MB/s"
        )
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    """A byte count in B, KB, MB or GB (powers of 1024), for tables and titles."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} GB"
