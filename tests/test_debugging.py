"""course_lib.debugging: desync check, NaN/Inf hooks, environment report, DETAIL parsing, trace helpers.

Multi-rank tests are real gloo runs of the functions in tests/rank_programs/debugging.py; each launch costs
a few seconds of start-up, so one program carries many checks and returns its results.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

from course_lib import debugging
from course_lib.exercises import check, check_prediction
from course_lib.launch import RankFailedError
from tests.rank_programs import debugging as programs
from tests.rank_programs import run

SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions" / "12_debugging_and_monitoring.py"


def test_debugger_scenarios_on_three_ranks():
    ranks = run(programs.scenarios, 3)
    results, events = [r["results"] for r in ranks], [r["events"] for r in ranks]
    assert all(r == results[0] for r in results), "every rank must reach the same verdict"
    r = results[0]
    assert r["healthy"] == ("ok", 10)
    assert r["bypass"][0] == "GradientDesyncError" and "in 10 of 10 parameter tensors" in r["bypass"][1]
    assert r["nudge rank 1"] == (
        "GradientDesyncError",
        "gradients differ between ranks in 1 of 10 parameter "
        "tensors, first '0.weight': rank(s) [1] differ from the majority",
    )
    assert r["swap last rank"][0] == "GradientDesyncError" and "'2.weight': rank(s) [2]" in r["swap last rank"][1]
    assert r["grad None everywhere"] == ("ok", 10)
    assert r["nan rank 0"][0] == "NonFiniteError" and "'2.bias'" in r["nan rank 0"][1]

    e = events[0]
    assert e["input"] == "rank 0: 1 non-finite value(s) in the forward input of '0'"
    assert e["backward"] == "rank 0: 12 non-finite value(s) in the backward of '1'"
    assert e["loss"] == "rank 0: 6 non-finite value(s) in the loss gradient of 'model output'"
    assert e["gradient"] == "rank 0: 8 non-finite value(s) in the gradient of '2.weight'"
    assert e["output"] == "rank 0: 3 non-finite value(s) in the forward output of '2'"
    assert e["clean after remove"] is None
    assert e["raised"] == "rank 0: 1 non-finite value(s) in the forward input of '0'"
    assert e["gathered"] == [None, None, "rank 2: 1 non-finite value(s) in the gradient of 'w'"]
    assert all(ev["gathered"] == e["gathered"] for ev in events)

    has_allreduce, sizes, n_params = ranks[0]["profiled"]
    assert has_allreduce and len(sizes) > 1 and sum(sizes) == n_params

    reports = [r["report"] for r in ranks]
    assert [rep["rank"] for rep in reports] == ["0", "1", "2"] and debugging.differing_keys(reports) == []
    for m in [r["monitor"] for r in ranks]:
        assert len(m["seconds"]) == len(m["memory_mb"]) == 4 and min(m["memory_mb"]) > 0
        assert all(abs(rate * t - 8) < 1e-6 for rate, t in zip(m["samples_per_s"], m["seconds"]))


def test_differing_keys_names_the_odd_key():
    reports = [
        {"rank": "0", "pid": "11", "torch": "2.13.0", "NCCL_DEBUG": "<unset>"},
        {"rank": "1", "pid": "12", "torch": "2.13.0", "NCCL_DEBUG": "INFO"},
    ]
    assert debugging.differing_keys(reports) == ["NCCL_DEBUG"]
    reports[1]["NCCL_DEBUG"] = "<unset>"
    assert debugging.differing_keys(reports) == []


def test_detail_names_each_ranks_collective_on_four_ranks():
    with pytest.raises(RankFailedError) as caught:
        run(programs.detail_mismatch, 4, timeout=120, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    seen = {}
    for failure in caught.value.failures:
        for rank, sequence, op, shape in debugging.mismatch_fingerprints(failure.summary):
            seen[rank] = (sequence, op, shape)
    assert seen.get(2) == (0, "ALLREDUCE", (5,)), seen
    assert len(seen) >= 2 and all(v == (0, "ALLREDUCE", (4,)) for r, v in seen.items() if r != 2), seen


def test_mismatch_fingerprints_parses_shapes_and_ops():
    message = (
        "Detected mismatch between collectives on ranks. Rank 1 is running collective: "
        "CollectiveFingerPrint(SequenceNumber=7, OpType=BROADCAST, TensorShape=[2, 3], TensorDtypes=Float), "
        "but Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=7, OpType=ALLREDUCE, "
        "TensorShape=[], TensorDtypes=Float)."
    )
    assert debugging.mismatch_fingerprints(message) == [(1, 7, "BROADCAST", (2, 3)), (0, 7, "ALLREDUCE", ())]


def test_gradient_checksums_see_swaps_and_missing_gradients():
    a = torch.nn.Linear(3, 2)
    a.weight.grad = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    before = debugging.gradient_checksums(a)
    assert before.dtype == torch.float64 and before.shape == (2,) and before[1] == 0  # bias has no grad
    a.weight.grad = torch.tensor([[2.0, 1.0, 3.0], [4.0, 5.0, 6.0]])
    assert debugging.gradient_checksums(a)[0] != before[0]


# ---- the exercise --------------------------------------------------------------------------------


def wrong_always_true(model):
    return True


def wrong_plain_sum(model):
    import torch.distributed as dist

    sums = torch.stack(
        [
            p.grad.double().sum() if p.grad is not None else torch.zeros((), dtype=torch.float64)
            for p in model.parameters()
        ]
    )
    high, low = sums.clone(), sums.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return bool(torch.equal(high, low))


def wrong_max_only(model):
    import torch.distributed as dist

    from course_lib.debugging import gradient_checksums

    mine = gradient_checksums(model)
    high = mine.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(torch.equal(high, mine))  # the rank holding the maximum believes all is well


def gradients_in_sync(model):
    raise NotImplementedError


def solutions(nproc=2):
    return runpy.run_path(str(SOLUTIONS), init_globals={"NPROC": nproc})


@pytest.mark.parametrize("nproc", [2, 4])
def test_exercise_solutions_pass(nproc, capsys):
    solved = solutions(nproc)
    assert check(solved["gradients_in_sync"], debugging.check_gradients_in_sync, nproc=nproc, backend="gloo")
    assert check(solved["mean_finite_loss"], debugging.check_mean_finite_loss, nproc=nproc, backend="gloo")
    assert capsys.readouterr().out.count(f"correct on {nproc} ranks") == 2


def test_exercise_stub_is_not_attempted(capsys):
    assert check(gradients_in_sync, debugging.check_gradients_in_sync, nproc=2, backend="gloo") is None
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, expected",
    [
        (wrong_always_true, "one gradient entry changed on rank 2: expected False on every rank, got True on rank "),
        (
            wrong_plain_sum,
            "two entries of one gradient swapped on rank 1: expected False on every rank, got True on rank ",
        ),
        (wrong_max_only, "one gradient entry changed on rank 2: expected False on every rank, got True on rank 2"),
    ],
)
def test_exercise_wrong_answers_fail_naming_the_rank(wrong, expected, capsys):
    assert check(wrong, debugging.check_gradients_in_sync, nproc=3, backend="gloo") is False
    said = capsys.readouterr().out
    assert expected in said and "rank" in said.split(":")[1], said


def mean_loss_skipping_the_bad_rank(loss):  # the broken function the notebook shows
    import torch
    import torch.distributed as dist

    if not torch.isfinite(loss):
        return float("nan"), 1  # this rank skips the all-reduce the others wait in
    totals = torch.stack([loss.detach(), torch.tensor(1.0)])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item(), dist.get_world_size() - int(totals[1].item())


def mean_loss_of_this_rank_only(loss):
    import torch

    finite = bool(torch.isfinite(loss))
    return (loss.item() if finite else 0.0), int(not finite)


def mean_loss_spreading_the_nan(loss):
    import torch.distributed as dist

    total = loss.detach().clone()
    dist.all_reduce(total)  # a NaN on one rank is now on every rank
    return total.item() / dist.get_world_size(), 0


def mean_loss_over_all_ranks(loss):
    import torch
    import torch.distributed as dist

    finite = bool(torch.isfinite(loss))
    totals = torch.stack([loss.detach() if finite else torch.zeros(()), torch.tensor(float(not finite))])
    dist.all_reduce(totals)
    return totals[0].item() / dist.get_world_size(), int(totals[1].item())  # divides by N, not the finite count


@pytest.mark.parametrize(
    "wrong, expected",
    [
        (mean_loss_skipping_the_bad_rank, "NaN loss on rank 2: "),
        (mean_loss_of_this_rank_only, "every loss finite: no collective call"),
        (mean_loss_spreading_the_nan, "returned the mean nan, expected"),
        (mean_loss_over_all_ranks, "(over the ranks whose loss is finite)"),
    ],
)
def test_mean_finite_loss_checker_rejects_wrong_answers(wrong, expected, capsys):
    assert check(wrong, debugging.check_mean_finite_loss, nproc=3, backend="gloo", timeout=90) is False
    said = capsys.readouterr().out
    assert expected in said, said
    if wrong is mean_loss_skipping_the_bad_rank:
        assert "never" in said and "rank" in said, said


def test_mean_finite_loss_stub_is_not_attempted(capsys):
    def mean_finite_loss(loss):
        raise NotImplementedError  # your code here

    assert check(mean_finite_loss, debugging.check_mean_finite_loss, nproc=2, backend="gloo") is None
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_ring_bytes_prediction(nproc, capsys):
    from course_lib.models import MLP

    P = sum(p.numel() for p in MLP().parameters())
    measured = 2 * (nproc - 1) / nproc * 4 * P  # the notebook's value: the profiler's elements (= P) x formula
    assert check_prediction("bytes", solutions(nproc)["predicted_ring_bytes"], measured, rtol=0.01)
    wrong = {
        "elements, not bytes": 2 * (nproc - 1) / nproc * P,
        "2 x the buffer, without (N-1)/N": 2 * 4 * P,
        "N instead of N - 1": 2 * nproc / nproc * 4 * P,
        "the checksum check's 2 x 8 T": 2 * 8 * 10,
    }
    for why, value in wrong.items():
        assert check_prediction("bytes", value, measured, rtol=0.01) is False, why
    assert capsys.readouterr().out.count("✗") == len(wrong)
