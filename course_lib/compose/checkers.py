"""The exercise of notebook 09: a rank's (pp, dp, tp) coordinates, checked against the DeviceMesh's."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from course_lib.compose.mesh import DIMS
from course_lib.exercises import ExerciseFailed, expect_equal


def solution_my_coordinates(rank: int, pp: int, dp: int, tp: int) -> tuple[int, int, int]:
    return rank // (dp * tp), rank // tp % dp, rank % tp


def check_my_coordinates(fn: Callable[[int, int, int, int], object]) -> None:
    """fn(rank, pp, dp, tp) -> (pp, dp, tp) coordinates must match the DeviceMesh's for every shape.

    Shapes (pp, dp, tp) with pp, dp in (1, 2, 4) and tp = world // (pp * dp); when the product is less
    than the world (5 ranks: (1, 2, 2)), the mesh takes the first pp * dp * tp ranks and the others sit
    it out, so a prime world size still tests shapes where dp and tp differ.
    """
    world = dist.get_world_size()
    me = dist.get_rank()
    shapes = [(pp, dp, world // (pp * dp)) for pp in (1, 2, 4) for dp in (1, 2, 4) if world >= pp * dp]
    for pp, dp, tp in shapes:
        size = pp * dp * tp
        mesh = DeviceMesh("cpu", torch.arange(size).view(pp, dp, tp), mesh_dim_names=DIMS)
        coordinate = mesh.get_coordinate()
        if coordinate is None:  # this rank is not in the mesh
            continue
        expected = tuple(coordinate)
        got = fn(me, pp, dp, tp)
        if not isinstance(got, tuple):
            raise ExerciseFailed(f"my_coordinates must return a tuple (pp, dp, tp), got {type(got).__name__}")
        expect_equal(f"my_coordinates({me}, pp={pp}, dp={dp}, tp={tp})", got, expected)
