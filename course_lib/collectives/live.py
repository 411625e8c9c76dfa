"""Notebook 01 on the session's live ranks: one collective by name on example data (the explorer
drives it), and the 2^r encoding that says which ranks' data a value of the stepped ring contains.

Rank side: call :func:`run_collective` on every rank (``view.apply_sync(run_collective, name, k)``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from course_lib.launch.runtime import rank_device

# The explorer's choices; the first is its default view.
COLLECTIVES = [
    "reduce_scatter_single",
    "all_gather_single",
    "all_reduce",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
]


def example_data(rank: int, world_size: int, per_rank: int) -> torch.Tensor:
    """Rank r's vector of N × per_rank whole numbers, 10r + i (100r + i past 10 elements): every
    value says which rank it came from and where it sat."""
    numel = world_size * per_rank
    return torch.arange(numel, dtype=torch.float32) + (10 if numel <= 10 else 100) * rank


def run_collective(name: str, per_rank: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Run the collective `name` (one of COLLECTIVES, SUM for reductions) on every rank's example
    data; call on all ranks. Returns this rank's (before, after) on the CPU, None where the
    collective reads or defines nothing on this rank.

    Each rank's full input has N × per_rank elements; gather and all_gather send its first per_rank.
    """
    if name not in COLLECTIVES:
        raise ValueError(f"unknown collective {name!r}: choose one of {COLLECTIVES}")
    rank, n = dist.get_rank(), dist.get_world_size()
    x = example_data(rank, n, per_rank).to(rank_device())
    share = x[:per_rank].clone()
    before: torch.Tensor | None = x
    after: torch.Tensor | None
    if name == "broadcast":
        after = x.clone()
        dist.broadcast(after, src=0)
    elif name == "reduce":
        after = x.clone()
        dist.reduce(after, dst=0)
        after = after if rank == 0 else None  # elsewhere the buffer is scratch
    elif name == "all_reduce":
        after = x.clone()
        dist.all_reduce(after)
    elif name == "gather":
        parts = [torch.empty_like(share) for _ in range(n)] if rank == 0 else None
        dist.gather(share, parts, dst=0)
        before, after = share, (torch.cat(parts) if parts is not None else None)
    elif name == "scatter":
        after = torch.empty_like(share)
        dist.scatter(after, list(x.chunk(n)) if rank == 0 else None, src=0)
        before = x if rank == 0 else None
    elif name == "all_gather_single":
        after = torch.empty_like(x)
        dist.all_gather_single(after, share)
        before = share
    elif name == "reduce_scatter_single":
        after = torch.empty_like(share)
        dist.reduce_scatter_single(after, x)
    else:  # all_to_all_single
        after = torch.empty_like(x)
        dist.all_to_all_single(after, x)
    return _on_cpu(before), _on_cpu(after)


def _on_cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.cpu()


# ---------------------------------------------------------------------------
# Rank r contributes 2^r: a sum of contributions names the ranks it contains


def contributors(value: float, world_size: int) -> frozenset[int]:
    """The ranks whose 2^r a value contains: 3 = 2^0 + 2^1 -> {0, 1}."""
    return frozenset(r for r in range(world_size) if int(value) >> r & 1)


def contribution_label(ranks: Iterable[int], world_size: int) -> str:
    """'0+2' for the ranks a chunk contains, 'Σ' once it contains all of them."""
    ranks = sorted(ranks)
    return "Σ" if len(ranks) == world_size else "+".join(str(r) for r in ranks)


def describe_chunks(values: torch.Tensor, world_size: int) -> str:
    """A 2^r-encoded buffer, one element per chunk, as the ranks each chunk contains:
    'chunk 0: Σ    chunk 1: 1+2 ...'."""
    labels = [contribution_label(contributors(v, world_size), world_size) for v in values.tolist()]
    return "  ".join(f"chunk {c}: {label:<5}" for c, label in enumerate(labels)).rstrip()
