"""Notebook 09's library: the rank grid, the planner's formulas, the exercise checker on real ranks."""

from __future__ import annotations

import pytest

from course_lib import compose
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
    assert (
        check(compose.solution_my_coordinates, "course_lib.compose:check_my_coordinates", nproc=4, backend="gloo")
        is True
    )

    def my_coordinates(rank, pp, dp, tp):  # dp and tp swapped: right only when they are equal
        return rank // (dp * tp), rank % dp, rank // dp % tp

    assert check(my_coordinates, "course_lib.compose:check_my_coordinates", nproc=4, backend="gloo") is False
    assert "rank" in capsys.readouterr().out.splitlines()[-1]
