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


class _NeverArrives:
    """A posted irecv whose message never comes: wait(timeout) reports the timeout, as gloo's does."""

    def __init__(self) -> None:
        self.waited_with: list[object] = []

    def wait(self, timeout=None):
        self.waited_with.append(timeout)
        if timeout is None:
            raise AssertionError("an unbounded wait: it would hang")
        raise RuntimeError(f"Timed out waiting {timeout.total_seconds() * 1000:.0f}ms for recv operation to complete")


def test_record_calls_bounds_the_wait_of_an_irecv_and_a_batch(monkeypatch):
    import datetime

    import torch
    import torch.distributed as dist

    from course_lib.exercises.calls import record_calls

    posted = _NeverArrives()
    monkeypatch.setattr(dist, "irecv", lambda tensor, src=None, group=None, tag=0: posted)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [posted, posted])
    with record_calls(bound_s=2.5) as calls:
        handle = dist.irecv(torch.empty(3), src=1)
        with pytest.raises(RuntimeError, match="Timed out waiting 2500ms"):
            handle.wait()  # the learner's own wait, without a timeout
        for work in dist.batch_isend_irecv([]):
            with pytest.raises(RuntimeError):
                work.wait()
    assert posted.waited_with == [datetime.timedelta(seconds=2.5)] * 3
    assert [(c.name, c.peer) for c in calls] == [("irecv", 1), ("batch_isend_irecv", None)]
    with record_calls() as calls:  # no bound asked: the handle is torch's own
        assert dist.irecv(torch.empty(3), src=1) is posted
