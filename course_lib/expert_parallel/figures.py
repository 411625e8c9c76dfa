"""Expert parallelism, kernel side only: tokens per expert, the load over training, the explorer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from course_lib.expert_parallel.cost import all_to_all_bytes_bound, dropped
from course_lib.expert_parallel.router import capacity


def draw_tokens_per_expert(routed: Sequence[torch.Tensor], kept: Sequence[torch.Tensor], cap: int) -> None:
    """One panel per rank: the assignments its tokens route to each expert, kept (coloured by the rank
    that holds the expert) and dropped (grey), with the capacity line."""
    import matplotlib.pyplot as plt

    n, n_experts = len(routed), len(routed[0])
    per_rank = n_experts // n
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 3.0), sharey=True, squeeze=False)
    for r, ax in enumerate(axes[0]):
        experts = range(n_experts)
        colours = [plt.cm.tab10((e // per_rank) % 10) for e in experts]
        ax.bar(experts, kept[r].tolist(), color=colours)
        ax.bar(experts, (routed[r] - kept[r]).tolist(), bottom=kept[r].tolist(), color="lightgray", hatch="//")
        ax.axhline(cap, color="black", lw=0.8, ls="--")
        ax.set_title(f"rank {r}'s tokens: {int((routed[r] - kept[r]).sum())} dropped", fontsize=9)
        ax.set_xticks(list(experts))
        ax.tick_params(axis="x", labelsize=7)
        ax.set_xlabel("expert (colour: the rank holding it)")
    axes[0][0].set_ylabel(f"assignments (capacity {cap}, dashed)")
    plt.tight_layout()
    plt.show()


def draw_load_balance(histories: Mapping[str, Sequence[Mapping[str, float]]]) -> None:
    """Imbalance (busiest expert / mean) and dropped share per training step, one line per run."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
    for label, history in histories.items():
        left.plot([h["imbalance"] for h in history], label=label)
        right.plot([100 * h["dropped"] for h in history], label=label)
    left.axhline(1.0, color="gray", lw=0.8, ls=":")
    left.set(xlabel="step", ylabel="busiest expert / mean", title="load imbalance", ylim=(0, None))
    right.set(xlabel="step", ylabel="% of assignments", title="dropped (over capacity)", ylim=(0, None))
    left.legend(fontsize=8)
    plt.tight_layout()
    plt.show()


def simulated_load(n_experts: int, top_k: int, skew: float, tokens: int = 4096, seed: int = 0) -> torch.Tensor:
    """Assignments per expert when token t picks k distinct experts with popularity ∝ (e + 1)^-skew."""
    popularity = torch.arange(1, n_experts + 1, dtype=torch.float64) ** -skew
    picks = torch.multinomial(
        popularity.expand(tokens, n_experts), top_k, generator=torch.Generator().manual_seed(seed)
    )
    return torch.bincount(picks.flatten(), minlength=n_experts)


def draw_ep_explorer(n_experts: int, top_k: int, capacity_factor: float, skew: float) -> None:
    """4096 tokens per rank on 8 ranks, model width 4096 in bf16: the load per expert, drops and bytes."""
    import matplotlib.pyplot as plt

    tokens, ranks, width, e = 4096, 8, 4096, 2
    load = simulated_load(n_experts, min(top_k, n_experts), skew, tokens)
    cap = capacity(tokens, n_experts, min(top_k, n_experts), capacity_factor)
    lost = dropped(load, cap)
    kept = int(load.clamp(max=cap).sum())
    mib = 2**20
    sent = kept * (ranks - 1) / ranks * width * e / mib  # tokens spread over the ranks' experts evenly
    bound = all_to_all_bytes_bound(cap, n_experts, ranks, width, e) / mib
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.bar(range(n_experts), load.clamp(max=cap).tolist(), color="C0", label="kept")
    ax.bar(
        range(n_experts),
        (load - load.clamp(max=cap)).tolist(),
        bottom=load.clamp(max=cap).tolist(),
        color="lightgray",
        hatch="//",
        label="dropped",
    )
    ax.axhline(cap, color="black", lw=0.8, ls="--", label=f"capacity {cap}")
    ax.set(xlabel="expert", ylabel="assignments from one rank")
    ax.set_title(
        f"E={n_experts}, k={top_k}, capacity factor {capacity_factor:g}: {100 * lost / load.sum():.1f}% dropped; "
        f"dispatch sends {sent:.0f} MiB per rank (at most {bound:.0f} MiB)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
