"""Notebook 02's lab, kernel side: ring bytes, bucket simulator, memory per rank, divide-before-sum in low precision."""

from __future__ import annotations

import torch

from course_lib.comms import sent_per_rank
from course_lib.ddp.minimal_ddp import MB
from course_lib.memory import zero_bytes_per_gpu

# Kernel-side arithmetic behind notebook 02's figures and tables: the bucket simulator, memory,
# and what dividing by N before the sum does in low precision.


def low_precision_mean(grads: list[torch.Tensor], divide_first: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The ranks' mean as a low-precision reduction rounds it, sum by sum, divided by N first (as DDP does) or last."""
    n = len(grads)
    terms = [g / n for g in grads] if divide_first else list(grads)
    partial = [terms[0]]
    for term in terms[1:]:
        partial.append(partial[-1] + term)
    return (partial[-1] if divide_first else partial[-1] / n), partial


def simulate_buckets(
    grad_bytes_in_order: list[int],
    grad_ready_s: list[float],
    bucket_cap_mb: float,
    latency_s: float,
    bandwidth_Bps: float,
    world_size: int,
) -> list[tuple[float, float]]:
    """Model of bucketed all-reduce during backward."""
    cap = bucket_cap_mb * MB
    buckets: list[tuple[int, float]] = []  # (bytes, ready time), closed as in assign_buckets
    size = 0
    for nbytes, t in zip(grad_bytes_in_order, grad_ready_s):
        size += nbytes
        if size >= cap:
            buckets.append((size, t))
            size = 0
    if size:
        buckets.append((size, grad_ready_s[-1]))
    calls, free_at = [], 0.0
    for nbytes, ready in buckets:
        start = max(ready, free_at)
        free_at = start + latency_s + sent_per_rank("all_reduce", nbytes, world_size) / bandwidth_Bps
        calls.append((start, free_at))
    return calls


def overlap_fraction(calls: list[tuple[float, float]], backward_s: float) -> float:
    """Share of the communication time that falls inside backward (hidden behind compute)."""
    total = sum(e - s for s, e in calls)
    hidden = sum(max(0.0, min(e, backward_s) - s) for s, e in calls)
    return hidden / total if total else 1.0


def ddp_bytes_per_rank(n_params: int, param_bytes: int = 4, optimizer_states: int = 2, bucket_copy: bool = True) -> int:
    """DDP memory per rank (ZeRO stage 0) plus the bucket copy unless gradient_as_bucket_view; activations excluded."""
    held = zero_bytes_per_gpu(
        n_params,
        world_size=1,
        stage=0,
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        state_bytes=optimizer_states * param_bytes,
    )["total"]
    return int(held) + (n_params * param_bytes if bucket_copy else 0)


def draw_buckets(
    bucket_cap_mb: float,
    network_speedup: float,
    *,
    grad_bytes_in_order: list[int],
    grad_ready_ms: list[float],
    backward_ms: float,
    latency_ms: float,
    bandwidth_B_per_ms: float,
    world_size: int,
) -> None:
    """Bucketed all-reduces against backward at `bucket_cap_mb` on a faster network, and a sweep of the cap."""
    import matplotlib.pyplot as plt

    speed = bandwidth_B_per_ms * network_speedup

    def calls_at(cap_mb: float) -> list[tuple[float, float]]:
        return simulate_buckets(grad_bytes_in_order, grad_ready_ms, cap_mb, latency_ms, speed, world_size)

    calls = calls_at(bucket_cap_mb)
    caps = [0.0625, 0.125, 0.25, 0.5, 1, 2, 4, 8, 16, 32]
    sweep = [calls_at(cap) for cap in caps]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3))
    left.broken_barh([(0, backward_ms)], (1, 0.8), color="lightgray")
    left.broken_barh(
        [(s, e - s) for s, e in calls], (0, 0.8), facecolors=[plt.cm.tab10(i % 10) for i in range(len(calls))]
    )
    left.set_yticks([0.4, 1.4], ["all-reduce", "backward"])
    left.set_xlabel("ms")
    left.set_title(
        f"{bucket_cap_mb} MB, network x{network_speedup}: {len(calls)} calls, "
        f"{overlap_fraction(calls, backward_ms):.0%} hidden"
    )
    right.semilogx(caps, [max(0, c[-1][1] - backward_ms) for c in sweep], marker="o", label="exposed ms after backward")
    right.semilogx(caps, [len(c) for c in sweep], marker="s", label="all-reduce calls")
    right.axvline(bucket_cap_mb, color="gray", linestyle=":")
    right.set_xlabel("bucket_cap_mb")
    right.legend(fontsize=8)
    right.set_title("sweep over bucket_cap_mb")
    plt.tight_layout()
    plt.show()


def draw_shards(order: list[int], shards: list[list[int]]) -> None:
    """The first global batch of the shuffled order, each sample coloured by the rank whose shard holds it."""
    import matplotlib.pyplot as plt

    owner = {sample: rank for rank, shard in enumerate(shards) for sample in shard}
    batch = order[: sum(len(shard) for shard in shards)]
    fig, ax = plt.subplots(figsize=(10, 1.1))
    ax.bar(range(len(batch)), 1, width=1, color=[plt.cm.tab10(owner[s]) for s in batch], edgecolor="white")
    ax.set(yticks=[], xlabel="position in the shuffled order (the first global batch)", xlim=(-0.5, len(batch) - 0.5))
    ax.set_title(f"DistributedSampler, N = {len(shards)}: rank r takes positions r, r + N, r + 2N, ... (colour = rank)")
    plt.tight_layout()
    plt.show()


def draw_overlap(timelines: dict[str, list[tuple[int, int, float, float]]], backward_ms: dict[str, float]) -> None:
    """Each run's backward (gray) and its buckets' all-reduces (colours), in ms since backward started."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 2.8))
    for row, name in enumerate(backward_ms):
        ax.broken_barh([(0, backward_ms[name])], (2 * row + 0.9, 0.8), color="lightgray")
        for i, _nbytes, start, end in timelines.get(name, []):
            y = 2 * row + 0.05 + 0.4 * (i % 2)
            ax.broken_barh([(start, end - start)], (y, 0.38), color=plt.cm.tab10(i), alpha=0.8)
            ax.text(start, y + 0.2, f" b{i}", va="center", fontsize=7)
    ax.set_yticks([2 * row + 1 for row in range(len(backward_ms))], list(backward_ms))
    ax.set_xlabel("ms since loss.backward() started (rank 0)")
    ax.set_title("each bucket's all-reduce (colour) against backward (gray); bucket 0 holds the last layer")
    plt.tight_layout()
    plt.show()


def draw_graph_cuts(splits: dict[str, dict[str, list[int]]], module: torch.nn.Module) -> None:
    """Where Dynamo's graphs end against where DDP's buckets end: a bucket ending inside a graph waits for the graph."""
    import itertools

    import matplotlib.pyplot as plt

    own = [sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in module.modules()]
    layers = [b / 1e6 for b in reversed(own) if b]
    fig, ax = plt.subplots(figsize=(10, 0.9 * len(splits) + 0.9))
    for row, cuts in enumerate(splits.values()):
        y = -2 * row
        starts = [0.0, *itertools.accumulate(layers)][:-1]
        ax.broken_barh(list(zip(starts, layers)), (y, 1), facecolors="lightgray", edgecolor="white", linewidth=2)
        for key, color, (low, high) in (("graphs", "C3", (y + 1, y + 1.6)), ("buckets", "C0", (y - 0.6, y))):
            for cut in itertools.accumulate(b / 1e6 for b in cuts[key][:-1]):
                ax.plot([cut, cut], [low, high], color=color, linewidth=3)
    ax.set_yticks([-2 * row + 0.5 for row in range(len(splits))], list(splits))
    ax.set_xlabel("parameter MB, last layer first (gray: one Linear layer each)")
    ax.set_title("cuts between graphs (red, above) and between buckets (blue, below)")
    plt.tight_layout()
    plt.show()


def draw_hooks(hooks: dict[str, dict], measured: bool) -> None:
    """Left: the loss per step of each hook's run. Right: bytes per rank per step, formula (and `measured`)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    for name, h in hooks.items():
        axes[0].plot(h["losses"], label=f"{name} (gradient error {h['gradient_error']:.0e})")
    axes[0].set(title="loss per step, torch DDP + hook", xlabel="step", ylabel="MSE")
    names = list(hooks)
    axes[1].bar([i - 0.2 for i in range(len(names))], [hooks[n]["formula"] / 1e3 for n in names], 0.4, label="formula")
    if measured:
        axes[1].bar(
            [i + 0.2 for i in range(len(names))], [hooks[n]["bytes_sent"] / 1e3 for n in names], 0.4, label="measured"
        )
    axes[1].set_xticks(range(len(names)), names)
    axes[1].set(ylabel="kB sent per rank per step", title="bytes on the wire")
    for ax in axes:
        ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()


def draw_runs(losses: dict[str, list[float]], reference: str = "single process") -> None:
    """Left: the loss per step of each run. Right: each run's distance from the `reference` run's loss."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    for (name, curve), style in zip(losses.items(), ["-", "--", ":", "-.", (0, (1, 3))]):
        axes[0].plot(curve, linestyle=style, label=name)
        if name != reference:
            axes[1].semilogy([abs(a - b) + 1e-12 for a, b in zip(curve, losses[reference])], linestyle=style)
    axes[0].set(title=f"loss per step: {len(losses)} runs, one curve", xlabel="step", ylabel="MSE")
    axes[1].set(title=f"|loss - {reference} loss|", xlabel="step", ylim=(1e-12, 1e-3))
    axes[0].legend(fontsize=8)
    plt.tight_layout()
    plt.show()


def draw_join(batches_per_rank: list[int]) -> None:
    """Join step by step: ranks out of batches shadow the others' all-reduces with zeros until every rank is out."""
    import matplotlib.pyplot as plt

    steps = max(batches_per_rank)
    fig, ax = plt.subplots(figsize=(6, 0.45 * len(batches_per_rank) + 0.9))
    for rank, n in enumerate(batches_per_rank):
        ax.broken_barh([(s, 0.9) for s in range(n)], (rank, 0.8), color=plt.cm.tab10(rank))
        ax.broken_barh(
            [(s, 0.9) for s in range(n, steps)], (rank, 0.8), facecolor="white", edgecolor="gray", hatch="//"
        )
    ax.set_yticks([r + 0.4 for r in range(len(batches_per_rank))], [f"rank {r}" for r in range(len(batches_per_rank))])
    ax.set_xticks([s + 0.45 for s in range(steps)], [f"step {s}" for s in range(steps)])
    ax.set_title("Join: a batch and its all-reduce (colour), zeros all-reduced in its place (hatched)")
    plt.tight_layout()
    plt.show()
