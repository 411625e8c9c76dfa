"""Memory per rank: counted from the tensors a rank holds, and predicted by the ZeRO paper's model."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from course_lib.compare import bytes_per_rank, local_tensor

if TYPE_CHECKING:  # matplotlib is imported only when a figure is drawn
    from matplotlib.axes import Axes

GB = 1e9  # decimal gigabytes, as in the ZeRO paper and GPU data sheets

# (bytes per parameter, per gradient, of optimizer state per parameter)
PRECISIONS = {
    # fp16/bf16 weights and gradients for compute, an fp32 master copy inside the optimizer state
    "mixed (16-bit + fp32 master)": {"Adam": (2, 2, 12), "SGD+momentum": (2, 2, 8), "SGD": (2, 2, 4)},
    "fp32": {"Adam": (4, 4, 8), "SGD+momentum": (4, 4, 4), "SGD": (4, 4, 0)},
}


def zero_bytes_per_gpu(
    n_params: float, world_size: int, stage: int, param_bytes: float = 2, grad_bytes: float = 2, state_bytes: float = 12
) -> dict[str, float]:
    """Bytes per GPU of parameters, gradients and optimizer state for ZeRO `stage` (0 = DDP)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0-3, got {stage}")
    n = world_size
    out = {
        "params": n_params * param_bytes / (n if stage >= 3 else 1),
        "grads": n_params * grad_bytes / (n if stage >= 2 else 1),
        "optimizer": n_params * state_bytes / (n if stage >= 1 else 1),
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def calculator_table(
    n_params: float, world_size: int, precision: str = "mixed (16-bit + fp32 master)", optimizer: str = "Adam"
) -> list[dict]:
    """One row per stage: GB per GPU of each part and in total."""
    p, g, k = PRECISIONS[precision][optimizer]
    rows = []
    for stage in range(4):
        b = zero_bytes_per_gpu(n_params, world_size, stage, p, g, k)
        rows.append({"stage": stage, **{key: value / GB for key, value in b.items()}})
    return rows


# ---- counting what a rank holds -------------------------------------------------------------------


def allocated_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of storage behind the local tensors: more than bytes_per_rank where fully_shard pads to ceil(rows / N)."""
    return sum(local_tensor(t).untyped_storage().nbytes() for t in tensors)


def held_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, padded: bool = False
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds between steps."""
    size = allocated_bytes if padded else bytes_per_rank
    extra_held = getattr(model, "extra_held", None)  # ZeroModel's full copies
    extra = extra_held() if extra_held is not None else {}
    params = list(model.parameters())

    def count(full_copies: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> int:
        """Bytes of the wrapper's full copies, plus those of the tensors that are not views into them."""
        inside = {t.untyped_storage().data_ptr() for t in full_copies}
        return size(full_copies) + size(
            t for t in tensors if local_tensor(t).untyped_storage().data_ptr() not in inside
        )

    held = {
        "params": count(extra.get("params", []), params),
        "grads": count(extra.get("grads", []), [p.grad for p in params if p.grad is not None]),
        "optimizer": 0,
    }
    if optimizer is not None:
        held["optimizer"] = bytes_per_rank(
            v
            for state in optimizer.state.values()
            for k, v in state.items()
            if isinstance(v, torch.Tensor) and k != "step"
        )
    held["total"] = held["params"] + held["grads"] + held["optimizer"]
    return held


def fully_shard_numel(shape: tuple[int, ...], world_size: int, rank: int, padded: bool = False) -> int:
    """Elements of `shape` that fully_shard gives `rank`: ceil(rows / N) rows each (torch.chunk), fewer for the last."""
    rows, per_row = shape[0], math.prod(shape[1:])
    chunk = -(-rows // world_size)
    mine = chunk if padded else max(0, min(chunk, rows - rank * chunk))
    return mine * per_row


def zero_numel(unit_numels: list[int], world_size: int, rank: int) -> int:
    """Elements of the from-scratch flat shards on `rank`: tensor_split, one more on the first ranks."""
    return sum(n // world_size + (1 if rank < n % world_size else 0) for n in unit_numels)


# ---- figures ------------------------------------------------------------------------------------------


def draw_per_rank(
    measured: dict[str, list[dict]], predicted: dict[str, dict], ax: Axes | None = None, unit: float = 1e3
) -> Axes:
    """Stacked bars: for each setup, each rank's params / grads / optimizer; a tick for the formula."""
    import matplotlib.pyplot as plt

    ax = ax or plt.gca()
    colors = {"params": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green"}
    x, labels = 0.0, []
    for setup, per_rank in measured.items():
        for rank, held in enumerate(per_rank):
            bottom = 0.0
            for part, color in colors.items():
                ax.bar(x, held[part] / unit, bottom=bottom, color=color, label=part if x == 0 else None)
                bottom += held[part] / unit
            ax.plot(
                [x - 0.4, x + 0.4],
                [predicted[setup]["total"] / unit] * 2,
                color="black",
                lw=2,
                label="formula" if x == 0 else None,
            )
            labels.append(f"{setup}\nr{rank}" if rank == 0 else f"r{rank}")
            x += 1
        x += 0.6
    ticks, x = [], 0.0
    for per_rank in measured.values():
        ticks += [x + r for r in range(len(per_rank))]
        x += len(per_rank) + 0.6
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set_ylabel("kB held between steps")
    ax.legend(fontsize=8)
    return ax


def draw_calculator(
    model_billions: float = 70,
    world_size: int = 64,
    stage: int = 3,
    precision: str = "mixed (16-bit + fp32 master)",
    optimizer: str = "Adam",
    gpu_gb: float = 80,
    ax: Axes | None = None,
) -> Axes:
    """GB per GPU for stages 0-3 at the chosen setting; the chosen stage outlined; a line at gpu_gb."""
    import matplotlib.pyplot as plt

    ax = ax or plt.gca()
    rows = calculator_table(model_billions * 1e9, world_size, precision, optimizer)
    bottoms = [0.0] * 4
    for part, color in (("params", "tab:blue"), ("grads", "tab:orange"), ("optimizer", "tab:green")):
        values = [row[part] for row in rows]
        ax.bar(range(4), values, bottom=bottoms, color=color, label=part)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.bar(stage, rows[stage]["total"], fill=False, edgecolor="black", lw=2.5)
    for s, row in enumerate(rows):
        ax.text(s, row["total"], f"{row['total']:.1f} GB", ha="center", va="bottom", fontsize=8)
    ax.axhline(gpu_gb, color="red", ls="--", label=f"{gpu_gb:g} GB GPU")
    ax.set_xticks(range(4), ["0 (DDP)", "1", "2", "3"])
    ax.set(
        xlabel="ZeRO stage",
        ylabel="GB per GPU",
        title=f"{model_billions:g}B params, N={world_size}, {precision}, {optimizer}",
    )
    ax.legend(fontsize=8, loc="upper right")
    return ax
