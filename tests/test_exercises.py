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
    with record_calls(bound_s=2.5):
        handle = dist.irecv(torch.empty(3), src=1)
        with pytest.raises(RuntimeError, match="Timed out waiting 2500ms"):
            handle.wait()  # the learner's own wait, without a timeout
        for work in dist.batch_isend_irecv([]):
            with pytest.raises(RuntimeError):
                work.wait()
    assert posted.waited_with == [datetime.timedelta(seconds=2.5)] * 3
    with record_calls():  # no bound asked: the handle is torch's own
        assert dist.irecv(torch.empty(3), src=1) is posted


def test_record_calls_refuses_a_forbidden_call_before_it_runs_and_puts_torch_back():
    import torch
    import torch.distributed as dist

    from course_lib import comms
    from course_lib.exercises import ExerciseFailed
    from course_lib.exercises.calls import record_calls

    torch_own = dist.all_reduce
    with record_calls(forbidden=["all_reduce"], advice="write the ring") as recorder:
        assert isinstance(recorder, comms.Recorder)
        with pytest.raises(ExerciseFailed, match=r"dist\.all_reduce is not allowed here: write the ring"):
            dist.all_reduce(torch.ones(2))  # no process group: only the refusal can answer
    assert dist.all_reduce is torch_own and recorder.calls == []


def timeouts_around_run_bounded(rank, world_size):
    import torch.distributed as dist

    from course_lib.exercises.calls import run_bounded

    world = dist.group.WORLD

    def timeout_s():
        return world._get_backend(world._device_types[0]).options._timeout.total_seconds()

    before = timeout_s()
    inside, error = run_bounded(timeout_s, seconds=2.5)
    return {"before": before, "inside": inside, "error": error, "after": timeout_s()}


def test_run_bounded_lowers_the_group_timeout_and_gives_the_group_its_own_back():
    from tests.rank_programs import run_source

    (got,) = run_source(timeouts_around_run_bounded, 1)
    assert got["inside"] == 2.5 and got["error"] is None
    assert got["after"] == got["before"] != 2.5  # the launcher's (290 s), not the 300 s the checkers once set
