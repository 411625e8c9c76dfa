"""Notebook 12's lab: round trips timed and the alpha-beta fit; the servers' loss curves (kernel-only)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed.rpc as rpc

from course_lib.rpc.remote_functions import echo

# What one RPC costs: round trips timed on a worker, and the alpha-beta model fitted to them.


def rpc_latency(peer: str, sizes_bytes: list[int], repeats: int = 7, warmup: int = 3) -> dict[int, float]:
    """Fastest rpc_sync(echo) round trip (s) per float32 tensor size, over alternating rounds: load only adds time."""
    tensors = {n: torch.zeros(max(1, n // 4)) for n in sizes_bytes}
    for _ in range(warmup):
        rpc.rpc_sync(peer, echo, args=(tensors[sizes_bytes[0]],))
    times: dict[int, list[float]] = {n: [] for n in sizes_bytes}
    for _ in range(repeats):
        for n in sizes_bytes:
            start_time = time.perf_counter()
            rpc.rpc_sync(peer, echo, args=(tensors[n],))
            times[n].append(time.perf_counter() - start_time)
    return {n: min(ts) for n, ts in times.items()}


def fit_latency_model(latency: dict[int, float]) -> tuple[float, float]:
    """alpha (s) and beta (s per byte) of t(n) = alpha + 2n*beta, notebook 01's notation (2n: there and back)."""
    sizes = sorted(latency)
    alpha = min(latency.values())
    largest = sizes[-1]
    beta = max(latency[largest] - alpha, 1e-12) / (2.0 * largest)
    return alpha, beta


# Kernel side (figures only): the parameter servers' loss curves against the data-parallel reference.


def draw_loss_curves(
    n_trainers: int, mode: str, *, runs: dict[tuple[str, int], dict[str, Any]], references: dict[int, list[float]]
) -> None:
    """Per-step losses of the sync and/or async server, over the data-parallel reference (which sync equals)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    for m in ("sync", "async") if mode == "both" else (mode,):
        ax.plot(runs[m, n_trainers]["losses"], linestyle="-" if m == "sync" else "--", label=m)
    ax.plot(references[n_trainers], ":", color="black", label="data-parallel reference (= sync)")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("loss")
    ax.set_ylim(0, 0.5)
    ax.set_title(f"{n_trainers} trainer(s)")
    ax.legend(fontsize=8)
    plt.show()


def draw_single_controller(n_procs: int) -> None:
    """Monarch's picture: one controller (the notebook) calling down to a stateful `Worker` actor per process."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    fig, ax = plt.subplots(figsize=(1.6 + 1.6 * n_procs, 3))
    width = 1.6 * n_procs
    ax.add_patch(FancyBboxPatch((0, 0), width, 1.3, boxstyle="round,pad=0.05", fill=False, linestyle="--"))
    ax.text(width / 2, 1.45, f"process mesh: {n_procs} processes along 'procs'", ha="center")
    ax.add_patch(FancyBboxPatch((width / 2 - 1, 2.3), 2, 0.6, boxstyle="round,pad=0.05", color="tab:orange"))
    ax.text(width / 2, 2.6, "controller (this notebook)", ha="center", va="center")
    for p in range(n_procs):
        x = 0.2 + 1.6 * p
        ax.add_patch(FancyBboxPatch((x, 0.15), 1.2, 1.0, boxstyle="round,pad=0.03", color="tab:blue", alpha=0.2))
        ax.text(x + 0.6, 0.95, f"process procs={p}", ha="center", fontsize=8)
        ax.add_patch(FancyBboxPatch((x + 0.15, 0.25), 0.9, 0.45, boxstyle="round,pad=0.02", color="tab:green"))
        ax.text(x + 0.6, 0.47, "Worker actor\n(total)", ha="center", va="center", fontsize=8)
        ax.annotate("", xy=(x + 0.6, 0.72), xytext=(width / 2, 2.25), arrowprops={"arrowstyle": "->"})
    ax.text(width + 0.1, 1.9, "call / call_one on a slice /\nbroadcast: endpoint calls", fontsize=8)
    ax.set_xlim(-0.2, width + 1.6)
    ax.set_ylim(-0.1, 3.1)
    ax.axis("off")
    plt.show()
