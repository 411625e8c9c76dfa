"""Notebook 15's lab: a layout's run as a %%torchrun cell runs it (train, measure, evaluate, sample); kernel figures."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib.gpt.layouts import Layout, layouts
from course_lib.gpt.model import GPT, GPTConfig, flops_per_token, loss_fn, sample
from course_lib.gpt.predict import device_peak_flops, matmul_flops, predicted_memory, predicted_traffic
from course_lib.gpt.text import split, tokens_and_tokenizer, validation_windows
from course_lib.gpt.train import default_config, train_layout

if TYPE_CHECKING:
    from matplotlib.axes import Axes


# What one %%torchrun cell of the capstone runs: a layout's training run, measured, summed up on every rank.
#
# :func:`run_layout` trains, and after every 10th step measures the machine's matmul limit with the same ranks
# and threads (every rank multiplies at once), so the limit is measured under the same load as the steps. It
# returns a summary that is the same on every rank: the loss curve, the median seconds per step (of the slowest
# rank), the median limit, tokens and FLOPs per step, the bytes each rank sent in the counted step (mean over
# ranks), each rank's memory, the seconds to the end of the first step (a compiled layout compiles there) and the
# graphs Dynamo compiled by then and by the end (rank 0's). :func:`evaluate` and :func:`sample_text` use the
# trained model (one process).


def _gathered(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def run_layout(
    layout: Layout, steps: int, device: torch.device | str = "cpu", **options: Any
) -> tuple[dict[str, Any], nn.Module]:
    """Train `layout` for `steps` steps on this rank (options: global_batch, lr, save_at, checkpoint, resume)."""
    from torch._dynamo.utils import counters

    device = torch.device(device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    config = default_config()
    global_batch = options.get("global_batch", 16)
    bursts: dict[int, float] = {}
    if layout.compiled:
        torch._dynamo.reset()  # Dynamo's caches as in a fresh process: the graphs counted are this run's
    graphs = counters["stats"]
    before = graphs["unique_graphs"]
    first: dict[str, float] = {}
    start = time.perf_counter()

    def after_step(step: int) -> None:  # outside the timed spans
        if not first:  # building the model and its first step (for a compiled layout, the compile)
            first.update(seconds=time.perf_counter() - start, graphs=graphs["unique_graphs"] - before)
        if step % 10 == 0:  # the limit: every 10th step, every rank at once
            bursts[step] = matmul_flops(device, seconds=0.02)

    result = train_layout(layout, steps, config=config, device=device, after_step=after_step, **options)
    times, limits = _gathered(result["step_seconds"]), _gathered(bursts)
    # a step lasts as long as its slowest rank; the limit of a moment is the sum of what every rank got then
    seconds = statistics.median(max(t[s] for t in times) for s in times[0]) if times[0] else float("nan")
    limit = statistics.median(sum(b[s] for b in limits) for s in limits[0]) if limits[0] else float("nan")
    by_dim = [result["sent"].get(dim, 0.0) for dim in ("tp", "dp", "pp")]
    sent = torch.tensor(by_dim, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(sent)
    tokens = global_batch * config.seq
    rank = dist.get_rank() if dist.is_initialized() else 0
    where = (rank // (layout.dp * layout.tp), rank // layout.tp % layout.dp)  # (stage, dp rank): tp varies fastest
    summary = {
        "layout": layout,
        "first_step": result["first_step"],
        "losses": result["losses"],
        "seconds_per_step": seconds,
        "tokens_per_step": tokens,
        "flops_per_step": flops_per_token(config) * tokens,
        "limit_flops": limit,
        "peak_flops": (device_peak_flops(device) or 0.0) * layout.world,
        "sent": dict(zip(("tp", "dp", "pp"), (sent / layout.world).tolist())),
        "held": _gathered(result["held"]),
        "coordinates": _gathered(where),
        "fingerprint": result.get("fingerprint"),
        "first_step_seconds": max(_gathered(first.get("seconds", 0.0))),
        "graphs": (int(first.get("graphs", 0)), graphs["unique_graphs"] - before),  # after the first step, at the end
    }
    return summary, result["model"]


@torch.no_grad()
def evaluate(model: GPT) -> float:
    """Mean cross-entropy (nats per character) over the whole validation text, in windows of the context."""
    _, val = split()
    x, y = validation_windows(val, model.config.seq)
    device = next(model.parameters()).device
    return float(loss_fn(model(x.to(device)), y.to(device)))


def sample_text(model: GPT, prompts: list[str], n_new: int = 120, temperature: float = 0.8) -> list[str]:
    """Each prompt continued by `n_new` characters drawn from the model (seeded)."""
    _, tokenizer = tokens_and_tokenizer()
    device = next(model.parameters()).device
    return [
        tokenizer.decode(sample(model, tokenizer.encode(p).to(device), n_new, temperature, seed=i))
        for i, p in enumerate(prompts)
    ]


def drift_tolerance(
    reference: list[float], twin: list[float], factor: float = 20.0, floor: float = 1e-5
) -> list[float]:
    """Allowed |loss - one-process loss|: floor + factor x reorder drift so far; float32 amplifies reordering."""
    envelope, out = 0.0, []
    for a, b in zip(reference, twin):
        envelope = max(envelope, abs(a - b))
        out.append(floor + factor * envelope)
    return out


# Kernel-only tables and figures of the capstone: one row and one bar per layout, and the explorer.


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
        lines.append("MFU: no data-sheet peak here (a CPU); on a listed GPU this column divides by its bf16 dense peak")
    return "\n".join(lines)


def compiled_summary(eager: dict[str, Any], compiled: dict[str, Any]) -> str:
    """Eager vs compiled tokens/s and achieved/limit, each run against its own limit (the machine is shared)."""
    e, c = achieved(eager), achieved(compiled)
    return (
        f"{compiled['layout'].describe()}: tokens/s {e['tokens_per_s']:.0f} -> {c['tokens_per_s']:.0f}; "
        f"achieved / limit {e['of_limit']:.2f} -> {c['of_limit']:.2f} ({c['of_limit'] / e['of_limit']:.2f} x eager's)"
    )


def draw_layout_runs(summaries: list[dict[str, Any]], config: GPTConfig, global_batch: int) -> None:
    """Per layout: loss over the one-process curve, achieved vs limit, memory and bytes vs the calculators."""
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
    speed.set_xticks(range(len(summaries)), names, rotation=20, fontsize=7)
    speed.set(ylabel="achieved / matmul limit", title="FLOP/s against what the ranks can get")
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


def draw_layout_plan(config: GPTConfig, nproc: int = 2, global_batch: int = 16) -> None:
    """Calculators per layout: memory per rank, bytes per step, and FLOPs per rank (what each byte hides behind)."""
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
    """Running max |loss - one process's| per step, log scale: the twin (reordering only), layouts, tolerance."""
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
