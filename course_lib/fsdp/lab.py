"""Notebook 03's lab: the notebook's model, data and training run, for one process and for every rank."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from course_lib import training
from course_lib.data import regression

# Notebook 03's training run: one fixed data set, the notebook's MLP, and the course's training loop over them,
# which one process (the reference, whole global batches) and every rank (its rows of each batch) run alike.


def dataset() -> TensorDataset:
    """The notebook's data: 1024 samples of one fixed regression task, 32 -> 7 features, taken in order."""
    return regression(n=1024, d_out=7)


def make_model() -> nn.Module:
    """The notebook's MLP, 32-45-45-7: units of 1485, 2070 and 322 elements shard unevenly for N = 2, 3, 4."""
    from course_lib.models import MLP

    return MLP(d_in=32, d_hidden=45, d_out=7, n_layers=2, seed=0)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    micro_batch: int = 8,
    world_size: int = 1,
    rank: int = 0,
    clip: Callable[[], object] | None = None,
    device: torch.device | str = "cpu",
    first_step: int = 0,
) -> list[float]:
    """Rank-local losses on the notebook's data; global batch micro_batch x N, so N=1 is the reference run."""
    return training.train(
        model,
        optimizer,
        dataset(),
        steps,
        micro_batch * world_size,
        rank=rank,
        world_size=world_size,
        first_step=first_step,
        shuffle_seed=None,
        device=device,
        before_step=clip,
    )


def issue_order(model: nn.Module, units: dict[str, nn.Module], x: torch.Tensor, y: torch.Tensor) -> list[str]:
    """One FSDP2 step's issue order: "AG u"/"RS u" per collective (u told by bytes), "F u" at forward."""
    from course_lib import comms

    def gathered_bytes(unit: nn.Module) -> int:  # N padded shards of each of its parameters
        from course_lib.memory import fully_shard_numel

        n, rank = dist.get_world_size(), dist.get_rank()
        return sum(
            n * p.element_size() * fully_shard_numel(tuple(p.shape), n, rank, padded=True) for p in unit.parameters()
        )

    name_of = {gathered_bytes(unit): name for name, unit in units.items()}
    events: list[tuple[int, str]] = []  # (collectives issued so far, "F u")
    with comms.Recorder() as rec:
        hooks = [
            unit.register_forward_pre_hook(lambda m, args, name=name: events.append((len(rec.calls), f"F {name}")))
            for name, unit in units.items()
        ]
        torch.nn.functional.mse_loss(model(x), y).backward()
    for hook in hooks:
        hook.remove()
    issued = [
        f"{'AG' if c.op == 'all_gather' else 'RS'} {name_of[c.nbytes]}"
        for c in rec.calls
        if c.op in ("all_gather", "reduce_scatter")
    ]
    for at, event in reversed(events):
        issued.insert(at, event)
    return issued


# ---- the figures: drawn from the formula or from what the ranks reported, never from timings ----------------------

_PARTS = {"parameters": ("tab:blue", 3), "gradients": ("tab:orange", 2), "optimizer state": ("tab:green", 1)}


def draw_zero_stages(world_size: int = 4) -> None:
    """What each rank holds at ZeRO stages 0-3: params, grads, optimizer state, whole or 1/N once sharded."""
    import matplotlib.pyplot as plt

    n = world_size
    _, axes = plt.subplots(1, 4, figsize=(11, 2.6), sharey=True)
    for stage, ax in enumerate(axes):
        for rank in range(n):
            for k, (part, (color, sharded_from)) in enumerate(_PARTS.items()):
                y = rank * 4 + k
                start, width = (rank / n, 1 / n) if stage >= sharded_from else (0.0, 1.0)
                ax.barh(y, 1.0, color="whitesmoke", edgecolor="lightgray")
                ax.barh(y, width, left=start, color=color, label=part if rank == 0 and stage == 0 else None)
        ax.set_title(f"ZeRO-{stage}" + (" (DDP)" if stage == 0 else " (FSDP)" if stage == 3 else ""), fontsize=9)
        ax.set_xticks([0, 1], ["0", "Ψ"])
    axes[0].set_yticks([4 * r + 1 for r in range(n)], [f"rank {r}" for r in range(n)])
    axes[0].invert_yaxis()
    axes[0].figure.legend(loc="lower center", ncol=3, fontsize=8)
    plt.tight_layout(rect=(0, 0.08, 1, 1))


def prefetch_timeline(units: int, compute: float = 1.0, gather: float = 0.6) -> list[tuple[str, str, float, float]]:
    """(stream, label, start, end) of one FSDP step from fixed durations, one all-gather in flight ahead (FSDP2)."""
    bars, compute_end, gather_end, reduce_end = [], 0.0, 0.0, 0.0
    compute_start = 0.0
    order = [("F", i) for i in range(units)] + [("B", i) for i in reversed(range(units))]
    for step, (phase, i) in enumerate(order):
        # one all-gather ahead: issued as the previous compute starts (backward's first, once the forward is done)
        issued = 0.0 if step == 0 else compute_end if step == units else compute_start
        start = max(gather_end, issued)
        gather_end = start + gather
        bars.append(("all-gather stream", f"AG{i}", start, gather_end))
        cost = compute if phase == "F" else 2 * compute
        compute_start = max(compute_end, gather_end)
        compute_end = compute_start + cost
        bars.append(("compute stream", f"{phase}{i}", compute_start, compute_end))
        if phase == "B":
            reduce_start = max(reduce_end, compute_end)
            reduce_end = reduce_start + gather
            bars.append(("reduce-scatter stream", f"RS{i}", reduce_start, reduce_end))
    return bars


def draw_prefetch_timeline(units: int = 3) -> None:
    """:func:`prefetch_timeline` drawn: the compute stream on top, the two communication streams under it."""
    import matplotlib.pyplot as plt

    rows = ["compute stream", "all-gather stream", "reduce-scatter stream"]
    colors = {"F": "tab:blue", "B": "tab:purple", "A": "tab:orange", "R": "tab:green"}
    _, ax = plt.subplots(figsize=(11, 2.2))
    for stream, label, start, end in prefetch_timeline(units):
        y = rows.index(stream)
        ax.barh(y, end - start, left=start, color=colors[label[0]], edgecolor="white")
        ax.text((start + end) / 2, y, label, ha="center", va="center", color="white", fontsize=8)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("time (units of one unit's forward compute)")
    ax.set_title(f"FSDP2, {units} units: unit i+1's all-gather overlaps unit i's compute (F forward, B backward)")
    plt.tight_layout()


def draw_hsdp_mesh(groups: list[dict[str, list[int]]], rows: list[tuple[str, int, int]]) -> None:
    """The 2-D mesh as reported: shard groups boxed, replicate groups joined, each rank's rows of 0.weight."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    shard_groups = sorted({tuple(g["shard"]) for g in groups})
    where = {r: (g["shard"].index(r), shard_groups.index(tuple(g["shard"]))) for r, g in enumerate(groups)}
    _, ax = plt.subplots(figsize=(5.5, 3.4))
    for row, members in enumerate(shard_groups):
        ax.add_patch(
            FancyBboxPatch(
                (-0.45, row - 0.35),
                len(members) - 0.1,
                0.7,
                boxstyle="round,pad=0.02",
                facecolor="aliceblue",
                edgecolor="tab:blue",
            )
        )
        ax.text(
            len(members) - 0.5,
            row,
            f"shard group {list(members)}\nall-gather, reduce-scatter",
            va="center",
            fontsize=8,
            color="tab:blue",
        )
    for rank, g in enumerate(groups):
        x, y = where[rank]
        if rank == min(g["replicate"]):  # one line per replicate group
            ys = [where[r][1] for r in g["replicate"]]
            ax.plot([x, x], [min(ys), max(ys)], color="tab:orange", lw=6, alpha=0.5, zorder=0)
            ax.text(
                x,
                (min(ys) + max(ys)) / 2,
                f"replicate {g['replicate']}\nall-reduce of a shard",
                ha="center",
                va="center",
                fontsize=7,
                color="tab:orange",
            )
        ax.text(
            x,
            y,
            f"rank {rank}\nrows {rows[rank][1]}..{rows[rank][2] - 1}",
            ha="center",
            va="center",
            fontsize=9,
            bbox={"facecolor": "white", "edgecolor": "gray"},
        )
    ax.set_xlim(-0.6, 3.2)
    ax.set_ylim(len(shard_groups) - 0.4, -0.6)
    ax.axis("off")
    ax.set_title("HSDP on a 2 x 2 mesh: 0.weight's rows per rank")
    plt.tight_layout()
