"""The exercise machinery itself: stubs, checker lookup, predictions."""

from __future__ import annotations

import pytest

from course_lib.exercises import check, check_prediction, is_stub


def stub():
    """Docstring only, then the stub."""
    raise NotImplementedError  # your code here


def attempted():
    return 1


def test_stub_is_recognised():
    assert is_stub(stub) and not is_stub(attempted)


def rank_sum_by_broadcast(value):  # right on one rank, where every rank's sum is its own value
    import torch.distributed as dist

    dist.broadcast(value, src=0)
    return value


def test_a_check_at_nproc_1_runs_on_2_ranks(capsys):
    from course_lib import process_groups

    assert check(rank_sum_by_broadcast, process_groups.check_rank_sum, nproc=1, backend="gloo") is False
    assert "rank_sum(value) on 2 ranks" in capsys.readouterr().out


def test_checker_must_be_importable_by_the_ranks():
    def local_checker(fn):
        fn()

    with pytest.raises(TypeError, match="module-level function"):
        check(attempted, local_checker)


@pytest.mark.parametrize(
    "predicted, expected, says",
    [
        (None, None, "not attempted yet"),
        (1000, True, "is right"),
        (1040, True, "is right"),
        (1100, False, "10% too high"),
        (500, False, "50% too low"),
        ("1000", False, "give a number"),
        (True, False, "give a number"),
    ],
)
def test_prediction(predicted, expected, says, capsys):
    assert check_prediction("bytes", predicted, 1000) is expected
    out = capsys.readouterr().out
    assert says in out and ("measured" in out) == bool(expected)
