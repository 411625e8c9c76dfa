"""Kernel-only tables and figures of the capstone: one row and one bar per layout, and the explorer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from course_lib.gpt.layouts import layouts
from course_lib.gpt.model import GPTConfig, flops_per_token
from course_lib.gpt.predict import predicted_memory, predicted_traffic

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def achieved(summary: dict[str, Any]) -> dict[str, float]:
    """tokens/s, achieved FLOP/s, their ratio to the measured matmul limit, and MFU (0 without a data-sheet peak)."""
    seconds = summary["seconds_per_step"]
    flops = summary["flops_per_step"] / seconds
    peak = summary["peak_flops"]
    return {
        "tokens_per_s": summary["tokens_per_step"] / seconds,
        "flops_per_s": flops,
        "of_limit": flops / summary["limit_flops"],
        "mfu": flops / peak if peak else 0.0,
    }


def speed_table(summaries: list[dict[str, Any]]) -> str:
    """One line per layout: tokens/s, achieved FLOP/s, the measured limit, their ratio, and MFU on a GPU."""
    lines = [f"{'layout':<46} {'tokens/s':>9} {'GFLOP/s':>8} {'limit':>8} {'of limit':>9} {'MFU':>6}"]
    for s in summaries:
        a = achieved(s)
        mfu = f"{a['mfu']:6.1%}" if a["mfu"] else "     -"
        lines.append(
            f"{s['layout'].describe():<46} {a['tokens_per_s']:>9.0f} {a['flops_per_s'] / 1e9:>8.2f} "
            f"{s['limit_flops'] / 1e9:>8.2f} {a['of_limit']:>9.2f} {mfu}"
        )
    if not any(s["peak_flops"] for s in summaries):
        lines.append("MFU: no data-sheet peak here (a CPU); on a listed GPU this column divides by its fp32 peak")
    return "\n".join(lines)


def compiled_against_eager(eager: dict[str, Any], compiled: dict[str, Any]) -> str:
    """One line: tokens/s and achieved / limit of an eager run and of its compiled twin, and the ratio of the latter.

    Each run is held against the limit measured during it: on a shared machine two runs see different loads, and
    achieved / limit compares them where their tokens/s alone would not."""
    e, c = achieved(eager), achieved(compiled)
    return (
        f"{compiled['layout'].describe()}: tokens/s {e['tokens_per_s']:.0f} -> {c['tokens_per_s']:.0f}; "
        f"achieved / limit {e['of_limit']:.2f} -> {c['of_limit']:.2f} ({c['of_limit'] / e['of_limit']:.2f} x eager's)"
    )


def draw_runs(summaries: list[dict[str, Any]], config: GPTConfig, global_batch: int) -> None:
    """Three panels: the loss curves (every layout on the one-process curve), achieved against the limit, and
    memory per rank and bytes per step, measured (bars) against the calculators (ticks)."""
    import matplotlib.pyplot as plt

    fig, (curves, speed, cost) = plt.subplots(1, 3, figsize=(13, 3.4))
    names = [s["layout"].name for s in summaries]
    for i, s in enumerate(summaries):
        steps = range(s["first_step"], s["first_step"] + len(s["losses"]))
        curves.plot(steps, s["losses"], lw=3 if i == 0 else 1, ls="-" if i == 0 else "--", label=names[i])
    curves.set(xlabel="step", ylabel="training loss (nats/char)", title="the same run in every layout")
    curves.legend(fontsize=7)
    ratios = [achieved(s)["of_limit"] for s in summaries]
    speed.bar(range(len(summaries)), ratios, color="tab:blue")
    speed.axhline(0.5, color="k", ls="--", lw=1, label="goal for one process")
    speed.set_xticks(range(len(summaries)), names, rotation=20, fontsize=7)
    speed.set(ylabel="achieved / matmul limit", title="FLOP/s against what the ranks can get")
    speed.legend(fontsize=7)
    _draw_costs(cost, summaries, config, global_batch)
    plt.tight_layout()
    plt.show()


def _draw_costs(ax: Axes, summaries: list[dict[str, Any]], config: GPTConfig, global_batch: int) -> None:
    x = range(len(summaries))
    held = [max(h["total"] for h in s["held"]) / 1e6 for s in summaries]
    sent = [sum(s["sent"].values()) / 1e6 for s in summaries]
    formula = [max(predicted_memory(s["layout"], config, st)["total"] for st in range(s["layout"].pp)) / 1e6
               for s in summaries]  # fmt: skip
    planned = [sum(predicted_traffic(s["layout"], config, global_batch).values()) / 1e6 for s in summaries]
    ax.bar([i - 0.2 for i in x], held, 0.4, label="memory per rank (max)", color="tab:green")
    ax.bar([i + 0.2 for i in x], sent, 0.4, label="bytes sent per rank per step", color="tab:orange")
    ax.scatter([i - 0.2 for i in x], formula, marker="_", s=300, color="k", label="calculator / planner")
    ax.scatter([i + 0.2 for i in x], planned, marker="_", s=300, color="k")
    ax.set_xticks(list(x), [s["layout"].name for s in summaries], rotation=20, fontsize=7)
    ax.set(ylabel="MB", title="memory and communication")
    ax.legend(fontsize=7)


def draw_plan(config: GPTConfig, nproc: int = 2, global_batch: int = 16) -> None:
    """The calculators for every layout of a model of `config`: memory per rank, bytes per rank and step,
    and the step's FLOPs per rank (how many FLOPs each byte sent has to hide behind)."""
    import matplotlib.pyplot as plt

    fig, (memory, traffic) = plt.subplots(1, 2, figsize=(10, 3))
    chosen = layouts(nproc)
    names = [layout.name for layout in chosen]
    held = [max(predicted_memory(la, config, s)["total"] for s in range(la.pp)) / 1e6 for la in chosen]
    memory.barh(names, held, color="tab:green")
    memory.set(xlabel="MB per rank (fp32 Adam)", title=f"{config.n_layers} blocks x {config.d_model} wide")
    flops = flops_per_token(config) * global_batch * config.seq
    per_byte = []
    for layout in chosen:
        bytes_sent = sum(predicted_traffic(layout, config, global_batch).values())
        per_byte.append(flops / layout.world / bytes_sent if bytes_sent else 0.0)
    traffic.barh(names, per_byte, color="tab:orange")
    traffic.set(xlabel="FLOPs per rank per byte sent (more hides communication better)", xscale="symlog")
    plt.tight_layout()
    plt.show()


def draw_drift(reference: list[float], twin: list[float], runs: dict[str, dict[str, Any]],
               tolerance: list[float]) -> None:  # fmt: skip
    """The largest |loss - one process's| so far, per step, log scale: the twin (reordered sums only), every
    layout, and the tolerance."""
    import matplotlib.pyplot as plt

    def envelope(steps: range, losses: list[float]) -> list[float]:
        out, top = [], 0.0
        for step, loss in zip(steps, losses):
            top = max(top, abs(loss - reference[step]))
            out.append(max(top, 1e-8))  # 1e-8: equal to the last bit
        return out

    fig, ax = plt.subplots(figsize=(8, 3))
    ax.plot(envelope(range(len(twin)), twin), "k", lw=3, label="one process, 2 micro-batches")
    for name, summary in runs.items():
        steps = range(summary["first_step"], summary["first_step"] + len(summary["losses"]))
        ax.plot(steps, envelope(steps, summary["losses"]), lw=1, label=name)
    ax.plot(tolerance, "r--", label="tolerance")
    ax.set(yscale="log", ylim=(5e-9, None), xlabel="step", ylabel="largest |loss - one process's| so far")
    ax.set_title("float32 drift, every layout")
    ax.legend(fontsize=7, ncol=2)
    plt.tight_layout()
    plt.show()
