"""Notebook 01's exercises: a reduce-scatter and an all-gather from send/recv, their checkers and
reference solutions. The checkers run on every rank, with torch's collectives switched off."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import torch
import torch.distributed as dist

from course_lib.collectives.ring import chunk_sizes
from course_lib.exercises import ExerciseFailed, expect_equal
from course_lib.launch.runtime import rank_device

# The solutions import inside their body: check() sends a function's source alone to the ranks.


def solution_reduce_scatter(tensor: torch.Tensor) -> torch.Tensor:
    """Reference solution of the exercise: this rank's chunk of the sum, from send/recv."""
    from course_lib.collectives import ring_reduce_scatter

    return ring_reduce_scatter(tensor)


def solution_all_gather(chunk: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Reference solution of the exercise: every rank's chunk in rank order, from send/recv."""
    from course_lib.collectives import ring_all_gather

    return ring_all_gather(chunk, sizes)


_FORBIDDEN = (
    "all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "broadcast",
    "all_to_all",
    "all_to_all_single",
    "all_gather_object",
)


class _OnlyPointToPoint:
    """While active, torch's collectives raise: the exercise is to build one from send/recv."""

    def __enter__(self) -> _OnlyPointToPoint:
        self.saved = {name: getattr(dist, name) for name in _FORBIDDEN if hasattr(dist, name)}
        for name in self.saved:

            def refuse(*args: object, _name: str = name, **kwargs: object) -> None:
                raise ExerciseFailed(
                    f"dist.{_name} is not allowed here: use dist.send/recv, isend/irecv or batch_isend_irecv"
                )

            setattr(dist, name, refuse)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


# Sizes the checks try: divisible, not divisible, fewer elements than ranks are added per N.
def _check_sizes(n: int) -> list[int]:
    return [4 * n, 4 * n + 1, 2 * n + n - 1, 1, 37]


def _rank_data(numel: int, rank: int) -> torch.Tensor:
    # Whole numbers: the sum is exact in any order, so any correct algorithm matches exactly.
    gen = torch.Generator().manual_seed(1000 * numel + rank)
    data = torch.randint(-9, 10, (numel,), generator=gen).float()
    return data.to(rank_device())  # NCCL moves only GPU tensors


def check_reduce_scatter(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """fn(tensor) on every rank must return chunk `rank` of the sum, cut as torch.tensor_split does."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for numel in _check_sizes(n):
        data = _rank_data(numel, rank)
        total = data.clone()
        dist.all_reduce(total)
        expected = torch.tensor_split(total, n)[rank]
        with _OnlyPointToPoint():
            got = fn(data.clone())
        expect_equal(
            f"reduce_scatter of {numel} elements on {n} ranks (chunk {rank})",
            got.reshape(-1) if isinstance(got, torch.Tensor) else got,
            expected,
        )


def check_all_gather(fn: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> None:
    """fn(chunk, sizes) on every rank must return all chunks concatenated in rank order."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for numel in _check_sizes(n):
        full = _rank_data(numel, 0)  # the same on every rank: the expected answer
        sizes = chunk_sizes(numel, n)
        chunk = torch.tensor_split(full, n)[rank].clone()
        with _OnlyPointToPoint():
            got = fn(chunk, sizes)
        expect_equal(
            f"all_gather of {numel} elements on {n} ranks (chunk sizes {sizes})",
            got.reshape(-1) if isinstance(got, torch.Tensor) else got,
            full,
        )
