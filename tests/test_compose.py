"""Notebook 09's library: the rank grid, the planner's formulas, the exercise checker on real ranks."""

from __future__ import annotations

import re

import pytest
import torch

from course_lib import compose
from course_lib.compare import max_difference
from course_lib.exercises import check


def test_rank_grid_matches_coordinates_and_keeps_tp_innermost():
    grid = compose.rank_grid(8, pp=2, dp=2, tp=2)
    assert grid["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for world, shape in ((12, (3, 2, 2)), (8, (1, 4, 2)), (6, (2, 3, 1))):
        grid = compose.rank_grid(world, *shape)
        for name, groups in grid.items():
            assert sorted(r for g in groups for r in g) == list(range(world))  # a partition of the world
            for g in groups:  # members differ only in their own coordinate
                coords = [compose.coordinates(r, *shape) for r in g]
                assert len({tuple(c[k] for k in compose.DIMS if k != name) for c in coords}) == 1


def test_rank_grid_refuses_a_shape_that_is_not_the_world():
    with pytest.raises(ValueError, match="pp x dp x tp = 2 x 2 x 2 = 8, but the world has 6 ranks"):
        compose.rank_grid(6, 2, 2, 2)


def test_planner_reproduces_zero3_states_and_the_layout_trade_offs():
    llama = compose.LLAMA_70B
    for dp, tp, pp in ((16, 4, 1), (8, 4, 2), (64, 1, 1)):
        r = compose.plan(llama, dp, tp, pp)
        assert r["params_GB"] + r["grads_GB"] + r["optimizer_GB"] == pytest.approx(70e9 * 16 / 64 / 1e9)
    flat, piped = compose.plan(llama, 16, 4, 1), compose.plan(llama, 8, 4, 2)
    assert piped["dp_comm_GB"] < flat["dp_comm_GB"] / 2 + 1e-9 and piped["bubble"] > flat["bubble"] == 0
    assert compose.plan(llama, 16, 4, 1)["activations_GB"] == pytest.approx(
        compose.plan(llama, 32, 2, 1)["activations_GB"] / 2
    )
    # Korthikanti et al.: 34 s b h / t per layer with sequence parallelism and selective recomputation
    assert compose.activation_bytes_per_layer(llama, 4) == pytest.approx(34 * 4096 * 8192 / 4)
    with pytest.raises(ValueError, match="keep tensor parallelism inside a node"):
        compose.plan(llama, 4, 16, 1)


def test_coordinates_exercise_checker_accepts_the_solution_and_names_wrong_ranks(capsys):
    def my_coordinates(rank, pp, dp, tp):  # dp and tp swapped: right only when they are equal
        return rank // (dp * tp), rank % dp, rank // dp % tp

    # 4 ranks: a full 2 x 2 grid; 5 (prime): the (1, 2, 2) mesh on the first 4 ranks still catches the swap.
    for nproc in (5, 4):
        assert check(compose.solution_my_coordinates, compose.check_my_coordinates, nproc=nproc, backend="gloo") is True
        assert check(my_coordinates, compose.check_my_coordinates, nproc=nproc, backend="gloo") is False
        said = capsys.readouterr().out.splitlines()[-1]
        # whichever wrong rank reports first (1 or 2), its coordinate and both values are named correctly
        found = re.search(r"rank (\d): my_coordinates\((\d), pp=1, dp=2, tp=2\)\[(\d)\]: expected (\d), got (\d)", said)
        assert found, said
        rank, same_rank, index, expected, got = map(int, found.groups())
        assert rank == same_rank and rank in (1, 2), said
        assert expected == compose.solution_my_coordinates(rank, 1, 2, 2)[index], said
        assert got == my_coordinates(rank, 1, 2, 2)[index] != expected, said


def test_shard_loss_makes_uneven_shares_average_to_the_global_mean():
    x, y = compose.make_batch(global_batch=12)
    out = x * 0.5
    for dp in (1, 5, 7, 8):
        shares = [
            compose.shard_loss(o, t, global_batch=12, dp=dp) for o, t in zip(out.tensor_split(dp), y.tensor_split(dp))
        ]
        assert torch.stack(shares).mean().item() == pytest.approx(compose.loss_fn(out, y).item(), rel=1e-6)


def test_planner_sends_dp_traffic_over_the_clusters_inter_node_links():
    llama = compose.LLAMA_70B
    fast, slow = compose.Cluster(inter_node_GBps=400.0), compose.Cluster(inter_node_GBps=25.0)
    inside = {c: compose.plan(llama, 2, 4, 1, c)["comm_s"] for c in (fast, slow)}  # tp x dp = 8: one node
    across = {c: compose.plan(llama, 16, 4, 1, c)["comm_s"] for c in (fast, slow)}  # dp spans nodes
    assert inside[fast] == inside[slow] and across[slow] > across[fast]
    with pytest.raises(ValueError, match=r"tp <= 4\)"):
        compose.plan(llama, 8, 8, 1, compose.Cluster(gpus_per_node=4))
    assert all(r["tp"] <= 4 for r in compose.plan_options(llama, 64, compose.Cluster(gpus_per_node=4)))


def test_unsharded_gradients_name_a_stages_blocks_as_in_the_whole_model():
    x, y = compose.make_batch(global_batch=2)
    _, reference = compose.reference_grads(4, x, y)
    model = compose.make_model(4)
    compose.loss_fn(model(x), y).backward()
    second_stage = compose.stage_blocks(model, 1, pp=2)  # blocks 2 and 3, numbered 0 and 1 in the stage
    got = compose.unsharded_gradients(second_stage, first_block=2)
    assert sorted(got) == sorted(name for name in reference if name.split(".")[0] in ("2", "3"))
    assert max_difference(got, reference) == 0.0
