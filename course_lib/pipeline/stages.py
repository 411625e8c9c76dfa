"""The model of notebook 09 and how it is cut into pipeline stages."""

from __future__ import annotations

from torch import nn

from course_lib.models import MLP


def course_model(n_units: int = 16, width: int = 64, seed: int = 0) -> MLP:
    """The shared MLP with `n_units` pieces to distribute: n_units - 1 Linear+GELU blocks and the head.

    16 pieces: enough for two virtual stages on each of up to 8 ranks (interleaved 1F1B).
    """
    return MLP(d_in=width, d_hidden=width, d_out=8, n_layers=n_units - 1, seed=seed)


def split_into_stages(model: nn.Sequential, n_stages: int) -> list[nn.Sequential]:
    """Cut an MLP into `n_stages` consecutive pieces with as equal a number of Linear layers as possible.

    A piece starts at a Linear and keeps the activation that follows it, so
    stage k's output is exactly what stage k+1's first Linear consumes.
    """
    units: list[list[nn.Module]] = []
    for module in model:
        if isinstance(module, nn.Linear) or not units:
            units.append([])
        units[-1].append(module)
    if n_stages > len(units):
        raise ValueError(f"cannot cut {len(units)} Linear layers into {n_stages} stages")
    per_stage, extra = divmod(len(units), n_stages)
    stages, start = [], 0
    for k in range(n_stages):
        stop = start + per_stage + (1 if k < extra else 0)
        stages.append(nn.Sequential(*[m for unit in units[start:stop] for m in unit]))
        start = stop
    return stages


def stage_boundaries(model: nn.Sequential, n_stages: int) -> list[int]:
    """Index in `model` of the first module of each stage of :func:`split_into_stages` (for torch's split_spec)."""
    starts, i = [], 0
    for stage in split_into_stages(model, n_stages):
        starts.append(i)
        i += len(stage)
    return starts


def local_stages(model: nn.Sequential, rank: int, n_ranks: int, n_virtual: int = 1) -> dict[int, nn.Sequential]:
    """The stages rank `rank` holds when `model` is cut into n_ranks * n_virtual stages: rank, rank + p, ..."""
    stages = split_into_stages(model, n_ranks * n_virtual)
    return {s: stages[s] for s in range(rank, n_ranks * n_virtual, n_ranks)}
