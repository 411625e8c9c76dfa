"""The rank grid of notebook 11: a (pp, dp, tp) grid by hand, with dist.new_group, and as one DeviceMesh."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

DIMS = ("pp", "dp", "tp")  # outermost to innermost: tp varies fastest, so a TP group sits inside one node


def coordinates(rank: int, pp: int, dp: int, tp: int) -> dict[str, int]:
    """Where `rank` sits in a (pp, dp, tp) grid laid out row-major: rank = (p * dp + d) * tp + t."""
    return {"pp": rank // (dp * tp), "dp": rank // tp % dp, "tp": rank % tp}


def rank_grid(world_size: int, pp: int, dp: int, tp: int) -> dict[str, list[list[int]]]:
    """Every group of every dimension, by hand: the ranks that differ only in that coordinate."""
    if pp * dp * tp != world_size:
        raise ValueError(
            f"pp x dp x tp = {pp} x {dp} x {tp} = {pp * dp * tp}, but the world has {world_size} "
            f"ranks: choose sizes whose product is the world size"
        )
    groups: dict[str, dict[tuple, list[int]]] = {name: {} for name in DIMS}
    for rank in range(world_size):
        c = coordinates(rank, pp, dp, tp)
        for name in DIMS:
            key = tuple(c[other] for other in DIMS if other != name)
            groups[name].setdefault(key, []).append(rank)
    return {name: sorted(by_key.values()) for name, by_key in groups.items()}


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


def build_mesh(pp: int, dp: int, tp: int, device_type: str = "cpu") -> DeviceMesh:
    """The same grid in one call: a 3-D DeviceMesh with named dimensions."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=DIMS)
