"""Notebook 05's lab: what autograd saved and the bytes alive, what the ranks measure, and the kernel-side figures."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from course_lib.activations.formulas import (
    course_block_bytes,
    korthikanti_bytes,
    korthikanti_terms,
    selective_block_bytes,
    stack_bytes,
)
from course_lib.compare import full_gradients, local_tensor, saved_activation_bytes
from course_lib.launch.runtime import seconds_in_turns
from course_lib.models import BLOCK
from course_lib.precision import DTYPE_NAMES

if TYPE_CHECKING:
    from matplotlib.axes import Axes


# Activation memory on any device: the tensors autograd saved (what `compare.saved_activation_bytes` counts, named),
# and the bytes alive after each op and their peak, whatever keeps a tensor alive (saved tensors, checkpoint inputs).


def _storage_key(t: torch.Tensor) -> int:
    """Storage identity shared by views; unlike data_ptr, not reused while weakly held nor shared by 0-byte storages."""
    return local_tensor(t).untyped_storage()._cdata


def saved_tensors(output: torch.Tensor, parameters: Iterable[torch.Tensor] = ()) -> list[dict[str, Any]]:
    """Every tensor saved by the graph behind `output`, parameters left out, each storage once."""
    skip = {_storage_key(p) for p in parameters}
    rows: list[dict[str, Any]] = []
    stack, visited = [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for name in sorted(n for n in dir(node) if n.startswith("_saved_")):
            values = getattr(node, name)
            for t in values if isinstance(values, (tuple, list)) else [values]:
                if not isinstance(t, torch.Tensor) or _storage_key(t) in skip:
                    continue
                skip.add(_storage_key(t))
                local = local_tensor(t)
                rows.append(
                    {
                        "node": type(node).__name__,
                        "name": name.removeprefix("_saved_"),
                        "shape": tuple(local.shape),
                        "dtype": DTYPE_NAMES.get(local.dtype, str(local.dtype)),
                        "bytes": local.untyped_storage().nbytes(),
                    }
                )
        stack.extend(next_node for next_node, _ in node.next_functions)
    return rows


def _current_nbytes(ref: StorageWeakRef, recorded: int) -> int:
    """A live storage's size now: FSDP2 frees an unsharded parameter by resizing its storage to 0 bytes."""
    try:
        return torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
    except RuntimeError:  # a storage kind that cannot be looked at this way: its size when it was made
        return recorded


class LiveBytes(TorchDispatchMode):
    """Bytes still alive of the tensors created within `with LiveBytes() as live:`, as seen at torch dispatch."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: dict[int, tuple[StorageWeakRef, int]] = {}
        self.communication: set[int] = set()  # storages handed to a c10d collective
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        if func.namespace == "c10d":
            self.communication |= inputs
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage_key(t) not in inputs:  # not a view or an in-place result
                storage = local_tensor(t).untyped_storage()
                if storage._cdata not in self.tensors:
                    self.tensors[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self.now())
        return out

    def now(self, communication: bool = True) -> int:
        """Live recorded bytes; communication=False drops collectives' buffers (freed whenever gloo's thread runs)."""
        self.tensors = {k: v for k, v in self.tensors.items() if not v[0].expired()}
        self.communication &= self.tensors.keys()  # a dead storage's key may be reused by a new one
        kept = self.tensors if communication else {k: v for k, v in self.tensors.items() if k not in self.communication}
        return sum(_current_nbytes(ref, n) for ref, n in kept.values())


def counted_matmul_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of the matmuls (linear layers, bmm, attention where torch has a formula) that fn() runs."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


# What each rank measures: bytes saved per layer, what recomputation saves and costs. Bytes and FLOPs are counted,
# so they hold under any load; time is measured too, and only compared as ratios within one run.


def attention_backend(attention: str) -> Any:
    """A context that makes scaled_dot_product_attention use the fused ("flash") or the "math" kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION if attention == "flash" else SDPBackend.MATH)


def stats_bytes(dtype: torch.dtype, device: torch.device) -> int:
    """Bytes of LayerNorm's saved mean and 1/σ: fp32 on CUDA for 16-bit inputs, the input's dtype on the CPU."""
    return 4 if device.type == "cuda" else dtype.itemsize


def head_multiple(device: torch.device) -> int:
    """CUDA's fused attention pads each head to a multiple of 8 values; the CPU's does not."""
    return 8 if device.type == "cuda" else 1


def _block_options(dtype: torch.dtype, device: torch.device) -> dict[str, int]:
    """course_block_bytes' options for a block in `dtype` on `device`."""
    return dict(
        element_bytes=dtype.itemsize, stats_bytes=stats_bytes(dtype, device), head_multiple=head_multiple(device)
    )


def layer_bytes(
    s: int, b: int, *, attention: str = "flash", dtype: torch.dtype = torch.bfloat16, device: torch.device | None = None
) -> dict[str, Any]:
    """One TransformerBlock at (s, b): bytes saved for backward, measured by saved-tensor hooks, and derived."""
    from course_lib.models import TransformerBlock

    device = device or torch.device("cpu")
    block = TransformerBlock().to(device, dtype)
    x = torch.randn(b, s, BLOCK.d_model, device=device, dtype=dtype, requires_grad=True)
    with attention_backend(attention):
        measured = saved_activation_bytes(block, x)
    derived = course_block_bytes(s, b, attention=attention, **_block_options(dtype, device))
    return {"s": s, "b": b, "measured": measured, "derived": derived}


def derived_held(mode: str, layers: int, s: int, b: int, dtype: torch.dtype, device: torch.device) -> float:
    """Bytes `layers` blocks hold after the forward under `mode` (formulas.stack_bytes, flash attention)."""
    e, multiple = dtype.itemsize, head_multiple(device)
    per_layer = course_block_bytes(s, b, **_block_options(dtype, device))
    selective = selective_block_bytes(
        s, b, BLOCK.d_model, BLOCK.n_heads, BLOCK.d_ff, element_bytes=e, head_multiple=multiple
    )
    kept = "full" if mode == "from scratch" else mode
    return stack_bytes(per_layer, layers, e * s * b * BLOCK.d_model, kept, selective)["held"]


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.float().square().mean()


def measure_step(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """Bytes held for backward, peak and whole gradients of one step (gradients: a collective under FSDP)."""
    model.zero_grad(set_to_none=True)
    with attention_backend("flash"), LiveBytes() as live:
        out = model(x)
        held = live.now(communication=False)  # FSDP's last all-gather buffer is not kept for backward
        loss_of(out).backward()
    gradients = list(full_gradients(model).values())
    model.zero_grad(set_to_none=True)
    return {"held": held, "peak": live.peak, "gradients": gradients}


def step_flops(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Matmul FLOPs of a forward of model(x), and of a whole step (forward, recomputation, backward)."""
    with attention_backend("flash"):
        forward = counted_matmul_flops(lambda: model(x))
        step = counted_matmul_flops(lambda: loss_of(model(x)).backward())
    model.zero_grad(set_to_none=True)
    return {"forward flops": forward, "step flops": step}


def time_steps(models: dict[str, nn.Module], x: torch.Tensor, reps: int = 5) -> dict[str, float]:
    """Median seconds of one forward and backward per model, the models taking turns (load hits them alike)."""

    def step(model: nn.Module) -> None:
        with attention_backend("flash"):
            loss_of(model(x)).backward()

    steps: dict[str, Callable[[], object]] = {name: functools.partial(step, model) for name, model in models.items()}
    return seconds_in_turns(steps, repeats=reps, warmup=1, statistic=statistics.median)


def cuda_memory(fn: Callable[[], Any], device: torch.device) -> dict[str, int]:
    """torch.cuda's allocator view of fn(): bytes allocated at its peak and when it ends, above those before."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    peak, end = torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device)
    return {"peak": peak - before, "end": end - before}


def cuda_memory_report(step: Callable[[], Any], device: torch.device, snapshot_path: str) -> dict[str, Any]:
    """Allocator record of step() (peak, summary, memory_viz snapshot); expandable segments avoid fragmentation."""
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        usage = cuda_memory(step, device)
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._dump_snapshot(snapshot_path)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = sum(len(trace) for trace in snapshot["device_traces"])
    summary = torch.cuda.memory_summary(device, abbreviated=True)
    return {**usage, "events": events, "segments": len(snapshot["segments"]), "summary": summary}


# Kernel-side figures of notebook 05: bytes per layer against the formulas, what recomputation trades, the
# explorer, and the ladder of fixes. matplotlib is imported inside each function (ranks never draw).

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
    """GB of activations of `layers` blocks (bf16, flash) per mode for s up to 2·seq, and of the paper's layer."""
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
    summary = ", ".join(f"{m} {v:.1f} GB" for m, v in chosen.items())
    ax.set_title(f"{model}, {layers} layers, micro-batch {batch}, s={seq}: {summary}", fontsize=9)
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


def draw_korthikanti_terms(s: int, b: int, h: int, a: int) -> None:
    """The paper's bytes per layer, term by term (MiB), the a·s² terms in red: where a long sequence's memory goes."""
    import matplotlib.pyplot as plt

    terms = korthikanti_terms(s, b, h, a)
    fig, ax = plt.subplots(figsize=(8, 3.4))
    colours = ["C3" if "softmax" in name or "dropout output" in name else "C0" for name in terms]
    ax.barh(list(terms), [v / 2**20 for v in terms.values()], color=colours)
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=8)
    ax.set(xlabel="MiB", title=f"one GPT layer, 16-bit, s={s}, b={b}, h={h}, a={a}: red grows like s²")
    plt.tight_layout()
    plt.show()


def draw_tensor_parallel_bytes(s: int, b: int, h: int, a: int, ts: tuple[int, ...] = (1, 2, 4, 8)) -> None:
    """Bytes per rank per layer (s·b·h) against t, ± sequence parallel: paper's layer, course block (fp32 LN stats)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    for sp, style in ((False, "-o"), (True, "--s")):
        paper = [korthikanti_bytes(s, b, h, a, t, sp) / (s * b * h) for t in ts]
        course = [
            course_block_bytes(s, b, h, a, 4 * h, stats_bytes=4, t=t, sequence_parallel=sp) / (s * b * h) for t in ts
        ]
        suffix = " + SP" if sp else ""
        ax.plot(ts, paper, style, color="C3", label=f"paper's layer, TP{suffix}")
        ax.plot(ts, course, style, color="C0", label=f"course block (fused attention), TP{suffix}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(ts), [str(t) for t in ts])
    ax.set(xlabel="tensor-parallel size t", ylabel="bytes per rank / (s·b·h)", title=f"one layer, s={s}, h={h}, a={a}")
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
