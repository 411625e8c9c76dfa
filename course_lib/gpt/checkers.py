"""Notebook 15's exercises, checked on real ranks: the tied table's group for any stage count; a rank's batch rows."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from course_lib.compose import DIMS
from course_lib.exercises import ExerciseFailed
from course_lib.launch.runtime import rank_device


def _meshes(world: int) -> list[tuple[int, int, int]]:
    """(pp, dp, tp) shapes of `world` ranks, with at least two of each kind where the world allows."""
    shapes = [(pp, dp, world // (pp * dp)) for pp in (1, 2, 3, 4) for dp in (1, 2, 4) if world % (pp * dp) == 0]
    return [s for s in shapes if s[0] * s[1] * s[2] == world]


def check_embedding_group(fn: Callable[[DeviceMesh], dist.ProcessGroup | None]) -> None:
    """fn(mesh) -> group of this rank's first- and last-stage tied-table copies (same dp, tp), None mid-pipe."""
    world, me = dist.get_world_size(), dist.get_rank()
    device = rank_device()
    for pp, dp, tp in [s for s in _meshes(world) if s[0] >= 2]:
        mesh = DeviceMesh(device.type, torch.arange(world).view(pp, dp, tp), mesh_dim_names=DIMS)
        p, d, t = mesh.get_coordinate() or (0, 0, 0)
        group = fn(mesh)
        where = f"pp={pp} x dp={dp} x tp={tp}, rank {me} (stage {p})"
        if 0 < p < pp - 1:
            if group is not None:
                raise ExerciseFailed(f"{where}: a middle stage holds no copy of the table, expected None")
            continue
        if group is None:
            raise ExerciseFailed(f"{where}: this stage holds a copy of the table, expected a group, got None")
        expected = [(0 * dp + d) * tp + t, ((pp - 1) * dp + d) * tp + t]
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ExerciseFailed(f"{where}: returned a group this rank is not in")
        got = dist.get_process_group_ranks(group)
        if sorted(got) != expected:
            raise ExerciseFailed(f"{where}: the group holds ranks {sorted(got)}, expected the two stages' ranks")
        secret = torch.tensor([float(7 + 3 * me)], device=device)
        dist.all_reduce(secret, group=group)
        if secret.item() != sum(7 + 3 * r for r in expected):
            raise ExerciseFailed(f"{where}: an all-reduce over the group does not add the two copies")


def check_rows_on_mesh(fn: Callable) -> None:
    """fn(mesh, tokens, seq, global_batch) -> this rank's rows: same over tp, the global batch over dp."""
    world = dist.get_world_size()
    tokens = torch.arange(1000)  # every window is different
    wrong = [_wrong_rows(fn, pp, dp, tp, tokens) for pp, dp, tp in _meshes(world)]
    if first := next((w for w in wrong if w), None):
        raise ExerciseFailed(first)


def _wrong_rows(fn: Callable, pp: int, dp: int, tp: int, tokens: torch.Tensor) -> str | None:
    """What is wrong with the rows `fn` gives this rank of a pp x dp x tp mesh, or None."""
    from course_lib.gpt.text import ShardedBatches

    mesh = DeviceMesh(rank_device().type, torch.arange(dist.get_world_size()).view(pp, dp, tp), mesh_dim_names=DIMS)
    p, d, t = mesh.get_coordinate() or (0, 0, 0)
    global_batch = 3 * dp + 1  # uneven shares whenever dp > 1
    batches = fn(mesh, tokens, 8, global_batch)
    reference = ShardedBatches(tokens, 8, global_batch)
    expected = ShardedBatches(tokens, 8, global_batch, d, dp).rows()
    for step in (0, 5):
        got = batches(step)
        if not (isinstance(got, tuple) and len(got) == 2):
            return "batches(step) must return (inputs, targets), as text.ShardedBatches does"
        every, targets = reference(step)
        want = slice(expected.start, expected.stop)
        if torch.equal(got[0], every[want]) and torch.equal(got[1], targets[want]):
            continue
        rows = [next((i for i, row in enumerate(every) if torch.equal(row, x)), None) for x in got[0]]
        return (
            f"pp={pp} x dp={dp} x tp={tp}, rank {dist.get_rank()} (pp {p}, dp {d}, tp {t}), step {step}: holds rows "
            f"{rows} of the global batch of {global_batch}, expected rows {list(expected)}"
        )
    return None
