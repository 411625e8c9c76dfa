"""Kernel-side figures of notebook 05: bytes per layer against the formulas, what recomputation trades, the
explorer, and the ladder of fixes. matplotlib is imported inside each function (ranks never draw)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from course_lib.activations.formulas import course_block_bytes, korthikanti_bytes, selective_block_bytes, stack_bytes
from course_lib.models import BLOCK

if TYPE_CHECKING:
    from matplotlib.axes import Axes

MODELS = {  # name: (hidden, heads): d_ff = 4 * hidden, as in the course's block
    f"course block (h={BLOCK.d_model})": (BLOCK.d_model, BLOCK.n_heads),
    "GPT-3 XL-like (h=2048)": (2048, 16),
    "7B-like (h=4096)": (4096, 32),
    "GPT-3 175B-like (h=12288)": (12288, 96),
}
COLORS = {"none": "tab:red", "selective": "tab:orange", "full": "tab:green", "from scratch": "tab:olive"}


def draw_layer_bytes(rows: list[dict[str, Any]], b: int, ax: Axes | None = None) -> Axes:
    """Bytes one block saves, measured on the ranks (points) and derived (lines), against the sequence length."""
    import matplotlib.pyplot as plt

    ax = ax or plt.gca()
    s_max = max(r["s"] for r in rows)
    grid = list(range(8, s_max + 9, 8))
    lines = {
        "course block, flash (derived)": [course_block_bytes(s, b) for s in grid],
        "course block, math (derived)": [course_block_bytes(s, b, attention="math") for s in grid],
        "Korthikanti s·b·h·(34 + 5as/h)": [korthikanti_bytes(s, b, BLOCK.d_model, BLOCK.n_heads) for s in grid],
    }
    for (name, values), style in zip(lines.items(), ("-", "-", "--")):
        ax.plot(grid, [v / 1e3 for v in values], style, label=name)
    for attention, marker in (("flash", "o"), ("math", "s")):
        ax.plot([r["s"] for r in rows], [r[attention] / 1e3 for r in rows], marker, color="black", ms=6, mfc="none")
    ax.plot([], [], "o", color="black", mfc="none", label="measured on the ranks (hooks)")
    ax.set(xlabel="sequence length s", ylabel="kB saved per layer", title=f"one TransformerBlock, bf16, b={b}")
    ax.legend(fontsize=8)
    return ax


def draw_recompute(results: dict[str, dict[str, float]], axes: Any = None) -> Any:
    """Left: bytes held after the forward and at the peak, per mode. Right: matmul FLOPs and time, per mode."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.2))
    left, right = axes
    modes = list(results)
    x = range(len(modes))
    left.bar([i - 0.2 for i in x], [results[m]["held"] / 1e6 for m in modes], 0.4, label="held after forward")
    left.bar([i + 0.2 for i in x], [results[m]["peak"] / 1e6 for m in modes], 0.4, label="peak in backward")
    left.set_xticks(list(x), modes)
    left.set(ylabel="MB (activations and gradients)", title="memory")
    left.legend(fontsize=8)
    right.bar([i - 0.2 for i in x], [results[m]["flops ratio"] for m in modes], 0.4, label="matmul FLOPs (counted)")
    right.bar([i + 0.2 for i in x], [results[m]["time ratio"] for m in modes], 0.4, label="time (measured)")
    right.axhline(1.0, color="black", lw=0.8)
    right.set_xticks(list(x), modes)
    right.set(ylabel="x the step without recomputation", title="compute")
    right.legend(fontsize=8)
    return axes


def explorer_curves(seq: int, batch: int, layers: int, model: str, points: int = 48) -> dict[str, Any]:
    """GB of activations of `layers` blocks of `model` (bf16, flash attention) for s up to 2·seq, per mode; and
    of the paper's layer without recomputation ("paper")."""
    hidden, heads = MODELS[model]
    grid = [max(1, round(2 * seq * (i + 1) / points)) for i in range(points)]
    curves: dict[str, list[float]] = {mode: [] for mode in ("none", "selective", "full", "paper")}
    for s in grid:
        curves["paper"].append(layers * korthikanti_bytes(s, batch, hidden, heads) / 1e9)
        per_layer = course_block_bytes(s, batch, hidden, heads, 4 * hidden, stats_bytes=4)
        selective = selective_block_bytes(s, batch, hidden, heads, 4 * hidden)
        for mode in ("none", "selective", "full"):
            peak = stack_bytes(per_layer, layers, 2 * s * batch * hidden, mode, selective)["peak"]
            curves[mode].append(peak / 1e9)
    return {"s": grid, **curves}


def draw_explorer(seq: int = 4096, batch: int = 1, layers: int = 32, model: str = "7B-like (h=4096)") -> None:
    """Activation memory against sequence length, with and without recomputation; the chosen s marked."""
    import matplotlib.pyplot as plt

    curves = explorer_curves(seq, batch, layers, model)
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    chosen = {}
    for mode in ("none", "selective", "full"):
        ax.plot(curves["s"], curves[mode], color=COLORS[mode], label=f"recompute: {mode}")
        chosen[mode] = curves[mode][len(curves["s"]) // 2 - 1]  # the grid's middle point is s = seq
        ax.plot([seq], [chosen[mode]], "o", color=COLORS[mode])
    ax.plot(curves["s"], curves["paper"], "--", color=COLORS["none"], label="paper's layer, no recomputation")
    ax.axhline(80, color="black", ls=":", label="80 GB GPU")
    ax.set_ylim(0, 1.15 * max(80.0, max(curves["none"])))
    ax.set(xlabel="sequence length s", ylabel="GB of activations (peak)")
    ax.set_title(
        f"{model}, {layers} layers, micro-batch {batch}, s={seq}: "
        + ", ".join(f"{m} {v:.1f} GB" for m, v in chosen.items()),
        fontsize=9,
    )
    ax.legend(fontsize=8)
    plt.show()


def draw_ladder(rows: list[dict[str, Any]], gpu_gb: float = 80, ax: Axes | None = None) -> Axes:
    """Stacked bars of GB per GPU for each rung of the ladder, with the GPU's memory as a line."""
    import matplotlib.pyplot as plt

    ax = ax or plt.gca()
    bottoms = [0.0] * len(rows)
    parts = {"params": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green", "activations": "tab:red"}
    for part, color in parts.items():
        values = [row[part] / 1e9 for row in rows]
        ax.barh(range(len(rows)), values, left=bottoms, color=color, label=part)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.axvline(gpu_gb, color="black", ls=":", label=f"{gpu_gb:g} GB GPU")
    ax.set_yticks(range(len(rows)), [row["rung"] for row in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="GB per GPU")
    ax.legend(fontsize=8, loc="lower right")
    return ax
