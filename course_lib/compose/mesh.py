"""The rank grid of notebook 13: a (pp, dp, tp) grid by hand, with dist.new_group, and as one DeviceMesh."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

DIMS = ("pp", "dp", "tp")  # outermost to innermost: tp varies fastest, so a TP group sits inside one node


def rank_grid(world_size: int, pp: int, dp: int, tp: int) -> dict[str, list[list[int]]]:
    """Every group of every dimension, as DeviceMesh finds them: the ranks laid out row-major in a (pp, dp, tp)
    array; a group of one dimension is a line of that array along it (the ranks that differ only there)."""
    if pp * dp * tp != world_size:
        raise ValueError(
            f"pp x dp x tp = {pp} x {dp} x {tp} = {pp * dp * tp}, but the world has {world_size} "
            f"ranks: choose sizes whose product is the world size"
        )
    grid = torch.arange(world_size).view(pp, dp, tp)
    return {
        name: sorted(grid.movedim(axis, -1).reshape(-1, size).tolist())
        for axis, (name, size) in enumerate(zip(DIMS, (pp, dp, tp)))
    }


def new_groups_by_hand(world_size: int, pp: int, dp: int, tp: int) -> dict[str, dist.ProcessGroup]:
    """The pre-DeviceMesh way: dist.new_group for every group, called by EVERY rank in the same order.

    new_group is itself a collective: a rank that skips the groups it is not in (the classic bug)
    leaves the others waiting, or silently pairs up the wrong groups.
    """
    mine = {}
    for name, groups in rank_grid(world_size, pp, dp, tp).items():
        for ranks in groups:
            group = dist.new_group(ranks)  # every rank makes every call
            if dist.get_rank() in ranks:
                mine[name] = group
    return mine


@dataclass(frozen=True, kw_only=True)
class Dims:
    """How many ranks along each parallel dimension (torchtitan's ParallelDims); the one place a mesh is built."""

    pp: int = 1
    dp: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    def __str__(self) -> str:
        return f"pp={self.pp} x dp={self.dp} x tp={self.tp} ({self.world} ranks)"

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The grid in one call: a 3-D DeviceMesh with named dimensions, tp innermost."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=DIMS)
