"""Notebook 13's lab: the planner's predicted traffic against what the ranks counted, and the figures."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from course_lib.compose.parallelize import Dims
from course_lib.compose.planner import H100_NODES, Cluster, ModelShape, collectives_per_step, plan, step_time
from course_lib.compose.simulate import Shard
from course_lib.memory import GB

# Bytes each rank sends in a step, and its collective calls: the planner's prediction for notebook 13's model, and
# its comparison with what the ranks counted (``comms.Recorder.by_dimension(mesh)``: every collective charged to the
# mesh dimension whose group it ran on, under the ring cost model the planner uses).


def course_model_shape(n_blocks: int, micro_batch: float, seq: int = 6) -> ModelShape:
    """The planner's view of notebook 13's model: `n_blocks` of the course's blocks (models.BLOCK)."""
    from course_lib.models import BLOCK, TransformerBlock

    per_block = sum(p.numel() for p in TransformerBlock().parameters())
    return replace(BLOCK, n_params=n_blocks * per_block, n_layers=n_blocks, seq=seq, micro_batch=micro_batch)


def predicted_bytes_by_dimension(
    n_blocks: int, dp: int, tp: int, pp: int, n_mb: int, global_batch: int, **choices: Any
) -> dict[str, float]:
    """The planner's bytes per GPU per step (fp32, as the ranks train) for the course's model, by dimension."""
    shape = course_model_shape(n_blocks, micro_batch=global_batch / (dp * n_mb))
    r = plan(
        shape, dp, tp, pp, Cluster(gpus_per_node=max(tp, 1)), global_batch=global_batch, bytes_per_value=4, **choices
    )
    return {dim: r[f"{dim}_comm_GB"] * GB for dim in ("tp", "dp", "pp")}


def predicted_collectives(n_blocks: int, dp: int, tp: int, pp: int, n_mb: int, **choices: Any) -> dict[str, int]:
    """The planner's collective calls per GPU per step for the course's model (micro-batch size does not matter)."""
    return collectives_per_step(course_model_shape(n_blocks, micro_batch=1), dp, tp, pp, n_mb, **choices)


def compare_traffic(layout: str, predicted: dict[str, float], measured: dict[str, float]) -> tuple[float, str]:
    """The largest relative error over the dimensions, and a line: predicted vs counted bytes per GPU."""
    errors, parts = [], []
    for dim in ("tp", "dp", "pp"):
        p, m = predicted[dim], measured[dim]
        errors.append(abs(p - m) / m if m else float(p != 0))
        parts.append(f"{dim.upper()} {p / 1e3:7.1f} vs {m / 1e3:7.1f} kB")
    return max(errors), f"{layout:<34} " + " | ".join(parts) + f"  (max error {max(errors):.1%})"


# Kernel side (figures only): what each simulated rank of a layout holds, and the planner's explorer.


def plot_held(shards: list[dict[str, Shard]], layout: Dims) -> torch.Tensor:
    """Parameters each simulated rank holds, as a tp x (pp * dp) heatmap; returns them as a (pp, dp, tp) tensor."""
    import matplotlib.pyplot as plt

    held = [sum(math.prod(shard.shape) for shard in rank.values()) for rank in shards]
    per_rank = torch.tensor(held).view(layout.pp, layout.dp, layout.tp)
    fig, ax = plt.subplots(figsize=(7, 2.4))
    image = ax.imshow(per_rank.permute(2, 0, 1).reshape(layout.tp, -1), cmap="viridis")
    ax.set_xticks(range(layout.pp * layout.dp), [str(d) for _ in range(layout.pp) for d in range(layout.dp)])
    ax.set_xlabel("dp coordinate, stage after stage")
    ax.set_yticks(range(layout.tp), [f"tp {t}" for t in range(layout.tp)])
    for stage in range(1, layout.pp):
        ax.axvline(stage * layout.dp - 0.5, color="w")
    ax.set_title(f"parameters each of the {layout.world} simulated ranks holds")
    fig.colorbar(image, ax=ax, shrink=0.8)
    plt.tight_layout()
    plt.show()
    return per_rank


def draw_plan(billions: int, nodes: int, gpus_per_node: int, tp: int, pp: int, inter_node_GBps: int) -> None:
    """The planner's memory (against an H100's 80 GB) and traffic per GPU for a Llama-like model of `billions` B."""
    import matplotlib.pyplot as plt

    n_gpus = nodes * gpus_per_node
    shape = ModelShape(billions * 1e9, n_layers=80, d_model=8192 if billions >= 30 else 4096, n_heads=64)
    if n_gpus % (tp * pp) or tp > gpus_per_node or shape.n_layers % pp:
        print(f"{n_gpus} GPUs cannot be split into tp={tp} x pp={pp} (tp inside a node, 80 layers over pp)")
        return
    r = plan(shape, n_gpus // (tp * pp), tp, pp, Cluster(gpus_per_node, inter_node_GBps=inter_node_GBps))
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 2.8))
    bottom = 0.0
    for part in ["params_GB", "grads_GB", "optimizer_GB", "activations_GB"]:
        a.bar(0, r[part], bottom=bottom, label=part.removesuffix("_GB"))
        bottom += r[part]
    a.axhline(80, color="k", linestyle="--", linewidth=1)
    a.set_xticks([])
    a.set_ylabel("GB per GPU")
    a.legend(fontsize=8)
    a.set_title(f"dp={r['dp']:.0f}, tp={tp}, pp={pp}: {r['memory_GB']:.0f} GB")
    b.barh(["TP", "DP", "PP"], [r["tp_comm_GB"], r["dp_comm_GB"], r["pp_comm_GB"]])
    b.set_xlabel("GB per GPU per step")
    b.set_title(f"step ~{step_time(r):.0f} s ({r['compute_s']:.0f} s compute), bubble {r['bubble']:.1%}")
    plt.tight_layout()
    plt.show()


def counted_accumulation(
    model: torch.nn.Module,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    every_micro_batch: bool,
    global_batch: int,
    dp: int,
    mesh: Any,
    device: torch.device,
) -> tuple[float, dict[str, float]]:
    """One accumulated step's loss share and bytes per mesh dimension, syncing each micro-batch or only the last."""
    from course_lib import comms
    from course_lib.compose.parallelize import shard_loss

    loss = 0.0
    with comms.Recorder() as recorder:
        for i, (x, y) in enumerate(micro_batches):
            model.set_requires_gradient_sync(every_micro_batch or i == len(micro_batches) - 1)  # type: ignore[operator]
            share = shard_loss(model(x.to(device)), y.to(device), global_batch=global_batch, dp=dp)
            share.backward()
            loss += share.item()
    return loss, recorder.by_dimension(mesh)


def draw_rank_grid(pp: int, dp: int, tp: int, gpus_per_node: int) -> None:
    """A (pp, dp, tp) mesh's ranks on nodes: tp groups boxed (in a node when tp divides it), dp/pp partners joined."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    world = pp * dp * tp
    nodes = -(-world // gpus_per_node)
    fig, ax = plt.subplots(figsize=(1.1 * gpus_per_node + 1.5, 1.2 * nodes + 0.6))
    where = {r: (r % gpus_per_node, -(r // gpus_per_node)) for r in range(world)}  # (column, row) of each rank
    for n in range(nodes):
        ax.add_patch(Rectangle((-0.5, -n - 0.45), gpus_per_node, 0.9, fill=False, linestyle="--"))
        ax.text(-0.7, -n, f"node {n}", ha="right", va="center")
    for r, (x, y) in where.items():
        p, d, t = r // (dp * tp), r // tp % dp, r % tp
        ax.text(x, y, f"{r}\n({p},{d},{t})", ha="center", va="center", fontsize=8)
        if t == 0:
            ax.add_patch(Rectangle((x - 0.4, y - 0.3), tp - 0.2, 0.6, color="tab:green", alpha=0.3))
        for partner, color in ((r + tp, "tab:blue"), (r + dp * tp, "tab:red")):
            same_group = partner < world and (color == "tab:red" or partner // (dp * tp) == p)
            if same_group and (color == "tab:red" or d + 1 < dp):
                (x2, y2), (dx, dy) = where[partner], (0.3, 0) if color == "tab:red" else (0, -0.25)
                ax.annotate("", (x2 + dx, y2 + dy), (x + dx, y + dy), arrowprops={"arrowstyle": "-", "color": color})
    ax.set_title("green: a tp group   blue: dp partners   red: pp partners   (p, d, t) under each rank", fontsize=9)
    ax.set_xlim(-1.6, gpus_per_node)
    ax.set_ylim(-nodes + 0.4, 0.6)
    ax.axis("off")
    plt.show()


def plan_options(
    m: ModelShape,
    n_gpus: int,
    cluster: Cluster = H100_NODES,
    *,
    cps: tuple[int, ...] = (1,),
    virtual: tuple[int, ...] = (1,),
    **choices: Any,
) -> list[dict[str, float]]:
    """Every (cp, dp, tp, pp, v) layout the model and cluster allow (tp inside a node), planned, sorted by memory."""
    rows = []
    powers = [2**k for k in range(n_gpus.bit_length())]
    for cp in cps:
        for tp in powers:
            for pp in powers:
                for v in virtual:
                    if (
                        tp > cluster.gpus_per_node
                        or n_gpus % (tp * pp * cp)
                        or m.n_layers % (pp * v)
                        or m.n_heads % tp
                        or m.seq % cp
                        or (v > 1 and pp == 1)
                    ):
                        continue
                    rows.append(plan(m, n_gpus // (tp * pp * cp), tp, pp, cluster, cp=cp, virtual_stages=v, **choices))
    return sorted(rows, key=lambda r: r["memory_GB"])


def format_plan(rows: list[dict[str, float]]) -> str:
    """The rows of :func:`plan_options` as a table: memory per GPU, bytes per GPU per step, time per step."""
    head = (
        f"{'dp':>3} {'tp':>2} {'pp':>2} {'cp':>2} {'v':>1} {'mb':>4} {'states':>6} {'kept':>5} {'activ':>6}"
        f" {'memory':>6} {'TP':>6} {'CP':>5} {'DP':>6} {'PP':>5} {'compute':>7} {'TP+CP s':>7} {'DP s':>5}"
        f" {'bubble':>6} {'step s':>6}"
    )
    lines = [head, " " * 23 + "(GB per GPU)" + " " * 14 + "(GB sent per GPU per step)  (seconds per step)"]
    for r in rows:
        states = r["params_GB"] + r["grads_GB"] + r["optimizer_GB"]
        lines.append(
            f"{r['dp']:>3} {r['tp']:>2} {r['pp']:>2} {r['cp']:>2} {r['v']:>1} {r['microbatches']:>4} {states:>6.1f}"
            f" {r['kept_GB']:>5.1f} {r['activations_GB'] + r['output_GB']:>6.1f} {r['memory_GB']:>6.1f}"
            f" {r['tp_comm_GB']:>6.0f} {r['cp_comm_GB']:>5.0f} {r['dp_comm_GB']:>6.0f} {r['pp_comm_GB']:>5.1f}"
            f" {r['compute_s']:>7.1f} {r['tp_s'] + r['cp_s']:>7.1f} {r['dp_s']:>5.1f} {r['bubble']:>6.1%}"
            f" {step_time(r):>6.1f}"
        )
    return "\n".join(lines)
