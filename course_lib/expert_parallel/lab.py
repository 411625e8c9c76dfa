"""Notebook 11's lab: expert parallelism on paper, the kernel's figures, a run with and without the balancing loss."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import compare
from course_lib.expert_parallel.moe import ExpertParallelMoE, capacity

# Expert parallelism on paper: bytes per all-to-all, capacity, dropped tokens, load imbalance.
#
# Notation: T tokens per rank, k experts per token, E experts over N ranks (E/N each), d model width, e bytes
# per element, capacity factor c_f.
#
# * capacity C = ceil(c_f · T·k / E) assignments per expert and batch (router.capacity).
# * dispatch sends every kept assignment's token to its expert's rank. With balanced routing the share for my own
#   experts is 1/N, so each rank sends T·k·(N-1)/N rows of d·e bytes; combine sends as many back. Whatever the
#   routing, a remote expert takes at most C rows from me: at most C·E·(N-1)/N rows.
# * dropped assignments: Σ_e max(0, n_e - C), n_e the assignments routed to expert e.
# * imbalance: max_e n_e / mean_e n_e (1 is perfect; the busiest expert sets the step time).


def all_to_all_bytes_balanced(tokens: int, top_k: int, world_size: int, d_model: int, element_size: int) -> float:
    """Bytes one rank sends to the others in one dispatch when routing is balanced: T·k·(N-1)/N·d·e."""
    return tokens * top_k * (world_size - 1) / world_size * d_model * element_size


def all_to_all_bytes_bound(cap: int, n_experts: int, world_size: int, d_model: int, element_size: int) -> float:
    """The most bytes one rank can send in one dispatch: C rows to each of the E·(N-1)/N remote experts."""
    return cap * n_experts * (world_size - 1) / world_size * d_model * element_size


def dropped(routed_per_expert: torch.Tensor | Sequence[int], cap: int) -> int:
    """Σ_e max(0, n_e - C): the assignments over capacity."""
    return int(sum(max(0, int(n) - cap) for n in routed_per_expert))


def imbalance(routed_per_expert: torch.Tensor) -> float:
    """max_e n_e / mean_e n_e."""
    counts = routed_per_expert.double()
    return float(counts.max() / counts.mean())


def balanced_batch(tokens: int, n_experts: int, d_model: int) -> torch.Tensor:
    """Tokens a router whose weights are the identity sends evenly: token t to experts t and t + 1 (mod E)."""
    if d_model < n_experts:
        raise ValueError(f"balanced_batch needs d_model >= n_experts, got {d_model} < {n_experts}")
    x = torch.zeros(tokens, d_model)
    t = torch.arange(tokens)
    x[t, t % n_experts] = 2.0
    x[t, (t + 1) % n_experts] = 1.0
    return x


# Expert parallelism, kernel side only: tokens per expert, the load over training, the explorer.


def draw_tokens_per_expert(routed: Sequence[torch.Tensor], kept: Sequence[torch.Tensor], cap: int) -> None:
    """Per rank: assignments to each expert, kept (coloured by holder rank) or dropped (grey), against capacity."""
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


def draw_dispatch(send_splits: Sequence[Sequence[int]]) -> None:
    """The two all-to-alls as rank-to-rank matrices (combine: the transpose); off the diagonal is what travels."""
    import matplotlib.pyplot as plt

    rows = torch.tensor([list(s) for s in send_splits])
    n = len(rows)
    fig, axes = plt.subplots(1, 2, figsize=(2.0 * n + 3.5, 1.0 * n + 1.4))
    for ax, (title, matrix) in zip(axes, (("dispatch: tokens", rows), ("combine: outputs", rows.t()))):
        ax.imshow(matrix.numpy(), cmap="Blues", vmin=0, vmax=2 * int(rows.max()))  # light enough to read the counts
        for i in range(n):
            for j in range(n):
                stays = " (home)" if i == j else ""
                ax.text(j, i, f"{int(matrix[i, j])}{stays}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(n), [f"to {j}" for j in range(n)])
        ax.set_yticks(range(n), [f"from {i}" for i in range(n)])
        ax.set_title(f"{title}, rows rank → rank", fontsize=9)
    plt.tight_layout()
    plt.show()


def draw_ep_dp_mesh(grid: Sequence[Mapping]) -> None:
    """The (dp, ep) mesh as run: all-to-alls along a row (ep), experts' gradients summed down a column (dp)."""
    import matplotlib.pyplot as plt

    rows, cols = (1 + max(g["coordinate"][i] for g in grid) for i in (0, 1))
    fig, ax = plt.subplots(figsize=(2.4 * cols + 1.2, 1.3 * rows + 0.9))
    for r, g in enumerate(grid):
        dp, ep = g["coordinate"]
        ax.add_patch(plt.Rectangle((ep, dp), 0.9, 0.8, color=plt.cm.tab10(ep % 10), alpha=0.35))
        first, last = g["experts"]
        ax.text(ep + 0.45, dp + 0.4, f"rank {r}\nexperts {first}-{last}", ha="center", va="center", fontsize=8)
    for dp in range(rows):
        ax.annotate("", (cols - 0.1, dp + 0.9), (0, dp + 0.9), arrowprops=dict(arrowstyle="<->", color="C3"))
    for ep in range(cols):
        ax.annotate("", (ep + 0.95, rows - 0.2), (ep + 0.95, 0), arrowprops=dict(arrowstyle="<->", color="C2"))
    ax.set(xlim=(-0.1, cols + 0.1), ylim=(rows + 0.1, -0.1), xticks=[], yticks=[])
    ax.set_title("red: all-to-all inside ep (a row); green: expert gradients summed over dp (a column)", fontsize=8)
    plt.tight_layout()
    plt.show()


def token_batch(tokens: int, d_model: int, rank: int, step: int = 0, shift: float = 1.0, seed: int = 0) -> torch.Tensor:
    """Rank `rank`'s tokens at `step`: Gaussian around a common direction of length ≈ shift·√d (seeded)."""
    direction = shift * torch.randn(d_model, generator=torch.Generator().manual_seed(seed))
    mine = torch.Generator().manual_seed(1_000_003 * (seed + 1) + 1009 * rank + step)
    return torch.randn(tokens, d_model, generator=mine) + direction


def train_load_balance(
    moe: ExpertParallelMoE,
    steps: int = 30,
    aux_weight: float = 0.1,
    tokens: int = 64,
    lr: float = 1e-2,
    shift: float = 1.0,
    seed: int = 0,
) -> list[dict[str, float]]:
    """Train `moe` for `steps` Adam steps; per step: imbalance and dropped share over every rank's tokens, loss."""
    group, n, rank = moe.group, dist.get_world_size(moe.group), dist.get_rank(moe.group)
    d, device = moe.router.gate.in_features, moe.router.gate.weight.device
    mix = (torch.randn(d, d, generator=torch.Generator().manual_seed(seed + 1)) / d**0.5).to(device)
    optimizer = torch.optim.Adam(moe.parameters(), lr=lr)
    history = []
    for step in range(steps):
        x = token_batch(tokens, d, rank, step + 1, shift, seed).to(device)  # every rank its own tokens
        y, routing = moe(x)
        task = F.mse_loss(y, torch.tanh(x @ mix))
        optimizer.zero_grad()
        (task + aux_weight * routing.aux_loss).backward()
        for p in moe.router.parameters():  # replicated: average its gradient over the ranks
            grad = compare.grad_of(p, "router")
            dist.all_reduce(grad, group=group)
            grad /= n
        for p in moe.experts.parameters():  # each expert saw every rank's tokens, each rank's loss a mean
            if p.grad is not None:
                p.grad /= n
        optimizer.step()
        extra = torch.tensor([routing.dropped(), task.item()], dtype=torch.float64, device=device)
        stats = torch.cat([routing.routed_per_expert().double(), extra])
        dist.all_reduce(stats, group=group)
        routed = stats[:-2]
        history.append(
            dict(
                imbalance=imbalance(routed),
                dropped=float(stats[-2] / routed.sum()),
                loss=float(stats[-1] / n),
            )
        )
    return history
