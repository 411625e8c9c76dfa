"""Notebook 13's exercise checkers on real ranks (solutions: notebooks/solutions/13_composing_parallelism.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from course_lib.compose.parallelize import DIMS
from course_lib.exercises import ExerciseFailed, expect_equal
from course_lib.launch.runtime import rank_device


def check_my_coordinates(fn: Callable[[int, int, int, int], object]) -> None:
    """Checks fn(rank, pp, dp, tp) -> (p, d, t), also on meshes too big to launch: it must compute, not communicate."""
    from course_lib import comms

    world = dist.get_world_size()
    me = dist.get_rank()
    shapes = [(pp, dp, world // (pp * dp)) for pp in (1, 2, 4) for dp in (1, 2, 4) if world >= pp * dp]
    # every mesh first (building one is a collective), so that a wrong answer cannot leave a rank behind
    meshes = {
        shape: DeviceMesh(
            rank_device().type, torch.arange(shape[0] * shape[1] * shape[2]).view(shape), mesh_dim_names=DIMS
        )
        for shape in shapes
    }
    for shape, mesh in meshes.items():
        coordinate = mesh.get_coordinate()
        if coordinate is not None:  # None: this rank is not in the mesh
            _expect_coordinates(fn, me, shape, tuple(coordinate))
    with comms.Recorder() as recorder:
        for shape in ((2, 3, 4), (4, 8, 2), (3, 1, 5), (1, 16, 8)):
            grid = torch.arange(shape[0] * shape[1] * shape[2]).view(shape)
            for rank in range(grid.numel()):
                _expect_coordinates(fn, rank, shape, tuple(int(i) for i in (grid == rank).nonzero()[0]))
    if recorder.calls:
        raise ExerciseFailed(
            f"my_coordinates communicated ({recorder.calls[0].op}): a rank's coordinates follow from the layout "
            "alone, and must be known for any rank, not only this one"
        )


def _expect_coordinates(fn: Callable, rank: int, shape: tuple[int, int, int], expected: tuple) -> None:
    pp, dp, tp = shape
    got = fn(rank, pp, dp, tp)
    if not isinstance(got, tuple):
        raise ExerciseFailed(f"my_coordinates must return a tuple (pp, dp, tp), got {type(got).__name__}")
    expect_equal(f"my_coordinates({rank}, pp={pp}, dp={dp}, tp={tp})", got, expected)


def check_accumulate(fn: Callable) -> None:
    """Checks FSDP2 accumulation: global-batch mean grads, 2 all-gathers per micro-batch, 1 reduce-scatter per step."""
    from torch.distributed.device_mesh import init_device_mesh

    from course_lib import comms
    from course_lib.compare import max_difference
    from course_lib.compose.parallelize import apply_fsdp, make_batch, make_model, reference_grads, unsharded_gradients

    world, me = dist.get_world_size(), dist.get_rank()
    device = rank_device()
    mesh = init_device_mesh(device.type, (world,))
    for n_mb in (2, 3):
        x, y = make_batch(global_batch=2 * n_mb * world, seed=n_mb)
        _, reference = reference_grads(2, x, y)
        model = apply_fsdp(make_model(2).to(device), mesh)
        mine = x.chunk(world)[me].to(device), y.chunk(world)[me].to(device)  # this rank's rows only
        micro_batches = list(zip(mine[0].chunk(n_mb), mine[1].chunk(n_mb)))
        with comms.Recorder() as sent:
            fn(model, micro_batches)
        counts = sent.counts()
        gathers, reductions = counts.get("all_gather", 0), counts.get("reduce_scatter", 0)
        if gathers != 2 * n_mb * 2:
            raise ExerciseFailed(
                f"{n_mb} micro-batches of 2 blocks: parameters gathered {gathers} times, expected {4 * n_mb} "
                "(each micro-batch runs its own forward and backward)"
            )
        if reductions != 2:
            raise ExerciseFailed(
                f"{n_mb} micro-batches of 2 blocks: gradients reduce-scattered {reductions} times, expected 2 "
                "(once per block and step, in the last micro-batch's backward)"
            )
        got = unsharded_gradients(model)
        for name, expected in reference.items():
            if name not in got or got[name] is None:
                raise ExerciseFailed(f"{n_mb} micro-batches: no gradient for {name}")
            error = max_difference(got[name], expected)
            if error > 1e-5:
                ratio = (got[name].norm() / expected.norm()).item()
                raise ExerciseFailed(
                    f"{n_mb} micro-batches: gradient of {name} differs from the global-batch mean by {error:.2e} "
                    f"(its norm is {ratio:.3g}x the expected)"
                )


def check_micro_batches(fn: Callable) -> None:
    """Checks fn(x, y, size) gives every rank as many micro-batches (FSDP ranks run forwards in lockstep)."""
    world, me = dist.get_world_size(), dist.get_rank()
    device = rank_device()
    rounds = [(2, 3, world - 1), (4, 5, 0), (4, 4, 0), (3, 4, world // 2)]  # (rows, rows of the big rank, big rank)
    side = dist.new_group(backend="gloo")  # the reports travel apart from the learner's collectives
    for rows, big_rows, big in rounds:
        n = big_rows if me == big else rows
        x = (torch.arange(n * 3, dtype=torch.float32).view(n, 3) + 1000 * me).to(device)
        y = -x[:, 0]
        got = fn(x, y, 2)
        if not isinstance(got, (list, tuple)) or not all(isinstance(m, (list, tuple)) and len(m) == 2 for m in got):
            raise ExerciseFailed("return a list of (x, y) pairs, one per micro-batch")
        counts: list[int] = [0] * world
        dist.all_gather_object(counts, len(got), group=side)
        needed = -(-max(big_rows, rows) // 2)
        if len(set(counts)) > 1:
            few = counts.index(min(counts))
            raise ExerciseFailed(
                f"ranks hold {rows} or {big_rows} rows: rank {counts.index(max(counts))} made {max(counts)} "
                f"micro-batches, rank {few} made {min(counts)}: the extra forwards gather parameters that rank "
                f"{few} never gathers, and FSDP hangs"
            )
        if counts[me] != needed:
            raise ExerciseFailed(
                f"ranks hold {rows} or {big_rows} rows, micro_batch_size 2: {counts[me]} micro-batches, "
                f"{needed} are enough"
            )
        sizes = [len(m[0]) for m in got]
        if min(sizes) == 0 or max(sizes) > 2:
            raise ExerciseFailed(f"{n} rows: micro-batch sizes {sizes} (each must hold 1 to 2 rows)")
        expect_equal(f"{n} rows: the micro-batches' x, concatenated", torch.cat([m[0] for m in got]), x)
        expect_equal(f"{n} rows: the micro-batches' y, concatenated", torch.cat([m[1] for m in got]), y)
