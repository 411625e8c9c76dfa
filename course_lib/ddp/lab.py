"""Notebook 02's lab, kernel side: ring bytes, the bucket simulator and its explorer, memory per rank, and
what dividing by N before the sum does in low precision.
"""

from __future__ import annotations

import torch

from course_lib.comms import sent_per_rank
from course_lib.ddp.minimal_ddp import MB
from course_lib.memory import zero_bytes_per_gpu

# Kernel-side arithmetic behind notebook 02's figures and tables: the bucket simulator, memory,
# and what dividing by N before the sum does in low precision.


def low_precision_mean(grads: list[torch.Tensor], divide_first: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The mean of the ranks' gradients as a reduction in their dtype computes it: added one rank after
    the other (every addition rounds), each divided by N before (`divide_first`, as torch DDP does) or
    the sum divided after. Returns (mean, the running partial sums)."""
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
    """Model of bucketed all-reduce during backward.

    Gradients (in the order backward produces them) become ready at `grad_ready_s`; a bucket is sent
    when its last gradient is ready and the previous all-reduce has finished (one at a time, as on
    one communicator). Each call costs latency + ring bytes / bandwidth. Returns the list of
    (start, end) per bucket.
    """
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
    """Every rank holds everything (ZeRO's stage 0): weights + gradients + optimizer states, plus the
    bucket copy of the gradients unless gradient_as_bucket_view=True. Activations come on top and scale with B/N."""
    held = zero_bytes_per_gpu(
        n_params,
        world_size=1,
        stage=0,
        param_bytes=param_bytes,
        grad_bytes=param_bytes,
        optimizer_bytes=optimizer_states * param_bytes,
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
    """Left: backward and the bucketed all-reduces simulate_buckets schedules at `bucket_cap_mb`, on a network
    `network_speedup` times faster than the measured one. Right: the time left after backward, and the number of
    calls, over a sweep of bucket_cap_mb."""
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
