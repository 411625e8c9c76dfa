"""course_lib.debugging: desync check, NaN/Inf hooks, environment report, DETAIL parsing, trace helpers.

Multi-rank tests are real gloo runs of the functions in tests/rank_programs/debugging.py; each launch costs
a few seconds of start-up, so one program carries many checks and returns its results.
"""

from __future__ import annotations

import runpy
import statistics
import time
from pathlib import Path

import pytest
import torch

from course_lib import debugging
from course_lib.exercises import check, check_prediction
from course_lib.launch import RankFailedError
from tests.rank_programs import assert_judged, judge, run, world_sizes
from tests.rank_programs import debugging as programs
from tests.rank_programs import debugging_tools as rank_tools

SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions" / "14_debugging_and_monitoring.py"


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

    mine = torch.stack(  # position-weighted checksums, as the solution's
        [
            (p.grad.reshape(-1).double() * torch.arange(1, p.numel() + 1, dtype=torch.float64)).sum()
            if p.grad is not None
            else torch.zeros((), dtype=torch.float64)
            for p in model.parameters()
        ]
    )
    high = mine.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(torch.equal(high, mine))  # the rank holding the maximum believes all is well


def wrong_whole_gradients(model):  # right verdicts, by sending every gradient value twice
    import torch.distributed as dist

    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()])
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return bool(torch.equal(high, low))


def wrong_library_checksums(model):  # the shortcut: the course's own checksum range, shown in section 7
    from course_lib import debugging

    _, high, low = debugging.checksum_range(model)
    return bool((high == low).all())


def gradients_in_sync(model):
    raise NotImplementedError


def solutions(nproc=2):
    return runpy.run_path(str(SOLUTIONS), init_globals={"NPROC": nproc})


@pytest.mark.parametrize("nproc", world_sizes(2, 4))
def test_exercise_solutions_pass_at_other_world_sizes(nproc):
    solved = solutions(nproc)
    cases = [
        (solved["gradients_in_sync"], debugging.check_gradients_in_sync),
        (solved["mean_finite_loss"], debugging.check_mean_finite_loss),
    ]
    assert judge(cases, nproc) == [["ok"] * nproc] * 2


def test_exercise_stub_is_not_attempted(capsys):
    assert check(gradients_in_sync, debugging.check_gradients_in_sync, nproc=2, backend="gloo") is None
    assert "not attempted yet" in capsys.readouterr().out


def test_exercise_wrong_answers_fail_naming_the_rank(capsys):
    # wrong on one rank while the others go on to the next case: a launch of its own, through check()
    assert check(wrong_max_only, debugging.check_gradients_in_sync, nproc=3, backend="gloo") is False
    said = capsys.readouterr().out
    expected = "one gradient entry changed on rank 2: expected False on every rank, got True on rank 2"
    assert expected in said and said.startswith("✗ wrong_max_only: rank 2: "), said


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


def test_solutions_and_wrong_answers_that_fail_on_every_rank_at_once_are_judged_in_one_launch():
    checker = debugging.check_gradients_in_sync
    mean_checker = debugging.check_mean_finite_loss
    solved = solutions(3)
    assert_judged(
        [(solved["gradients_in_sync"], checker), (solved["mean_finite_loss"], mean_checker)],
        [
            (
                wrong_always_true,
                checker,
                "one gradient entry changed on rank 2: expected False on every rank, got True",
            ),
            (wrong_plain_sum, checker, "two entries of one gradient swapped on rank 1: expected False on every rank"),
            (
                wrong_whole_gradients,
                checker,
                "gradients identical on every rank: this rank's collectives carried 39,968 bytes for 19,984 bytes of "
                "gradients. Comparing whole gradients costs as much as the all-reduce being audited",
            ),
            (wrong_library_checksums, checker, "this calls the course's own checksums (section 7 shows them)"),
            (mean_loss_of_this_rank_only, mean_checker, "every loss finite: no collective call"),
            (mean_loss_spreading_the_nan, mean_checker, "returned the mean nan, expected"),
            (mean_loss_over_all_ranks, mean_checker, "(over the ranks whose loss is finite)"),
        ],
    )


def test_mean_finite_loss_checker_names_a_collective_one_rank_skips(capsys):
    # the notebook's broken function: the others wait in a collective the bad rank skipped, until DEADLOCK_S
    assert check(mean_loss_skipping_the_bad_rank, debugging.check_mean_finite_loss, nproc=3, backend="gloo") is False
    said = capsys.readouterr().out
    assert "NaN loss on rank 2: " in said and "never" in said and "rank" in said, said


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


# ---- the debug variables, a hang diagnosed from outside, stragglers --------------------------------------------

HANG = """import time
from course_lib.debugging import arm_for_diagnosis
arm_for_diagnosis(DIAGNOSIS_DIR)


def evaluate():
    while True:
        time.sleep(0.05)


def train(steps):
    for step in range(steps):
        grad = torch.full((4,), float(rank))
        if rank == 1 and step == 3:
            break
        dist.all_reduce(grad)
    evaluate()


train(6)
"""


def test_diagnose_hang_names_where_each_rank_waits_and_leaves_nothing(tmp_path):
    diagnosis = debugging.diagnose_hang(HANG, 3, backend="gloo", timeout=240)
    assert sorted(diagnosis.stacks) == [0, 1, 2] and all(s.idle for s in diagnosis.stacks.values())
    for rank, stack in diagnosis.stacks.items():
        mine = [(f.function, f.line, dict(f.variables).get("step")) for f in stack.frames if f.basename == "cell.py"]
        if rank == 1:  # left the loop at step 3, now in evaluate
            assert mine == [("evaluate", 8, None), ("train", 17, "3"), ("<module>", 20, None)], mine
            assert debugging.describe(stack, variables=("step",)) == (
                "evaluate (cell line 8) <- train (cell line 17, step=3) <- <module> (cell line 20)"
            )
        else:  # waiting in the all-reduce of step 3
            assert stack.frames[0].function == "all_reduce" and mine[0] == ("train", 16, "3"), mine
    records = diagnosis.flight
    assert {r: rec.last_enqueued for r, rec in records.items()} == {0: 4, 1: 3, 2: 4}
    assert records[0].describe(4) == "#4 gloo:all_reduce of [4] from train (cell line 16)"
    assert records[1].describe(4) == "never issued #4"
    assert diagnosis.left == []


def test_diagnose_hang_refuses_a_program_that_does_not_hang():
    with pytest.raises(RuntimeError, match="no hang to diagnose"):
        debugging.diagnose_hang("print('done')", 2, backend="gloo", timeout=120)


PY_SPY_DUMP = """Process 25640: /work/main/.venv/bin/python -u -m course_lib.launch.worker /tmp/torchrun-cell-x
Python v3.11.7 (/root/.pyenv/versions/3.11.7/bin/python3.11)

Thread 25640 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:3252)
        Arguments:
            tensor: <Tensor at 0x7f41cf32a530>
        Locals:
            work: <torch._C._distributed_c10d.Work at 0x7f41cf59c530>
    _exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:83)
    train (/tmp/torchrun-cell-x/cell.py:15)
        Arguments:
            steps: 5
        Locals:
            step: 2
    <module> (/tmp/torchrun-cell-x/cell.py:19)
    main (course_lib/launch/worker.py:106)
Thread 25650 (active): "flight-recorder-dump"
    wait_then_dump (course_lib/debugging/hang.py:40)
"""


def test_py_spy_dumps_parse_into_frames_and_variables():
    threads = debugging.parse_dump(PY_SPY_DUMP)
    assert [(t.name, t.idle, len(t.frames)) for t in threads] == [
        ("MainThread", True, 5),
        ("flight-recorder-dump", False, 1),
    ]
    main = debugging.main_thread(PY_SPY_DUMP)
    assert main.frames[2].variables == (("steps", "5"), ("step", "2"))
    assert debugging.describe(main, variables=("step",)) == (
        "all_reduce (distributed_c10d.py) <- train (cell line 15, step=2) <- <module> (cell line 19)"
    )
    colored = (
        'Thread \x1b[33m1\x1b[0m (idle): "MainThread"\n    \x1b[32mf\x1b[0m (\x1b[36mcell.py\x1b[0m:\x1b[2m3\x1b[0m)'
    )
    from course_lib.debugging.stacks import _ANSI

    assert debugging.describe(debugging.main_thread(_ANSI.sub("", colored))) == "f (cell line 3)"


def _main_thread_dump(state: str, line: int) -> str:
    return f'Thread 1 ({state}): "MainThread"\n    train (cell.py:{line})\n'


def test_settled_stacks_takes_a_spinning_rank_as_stuck_only_when_its_frames_stay_still(monkeypatch):
    from course_lib.debugging import hang

    lines = iter(range(10**6))  # a rank that moves: a new line at every dump
    dumps = {0: lambda: _main_thread_dump("active", 18), 1: lambda: _main_thread_dump("idle", 9)}
    monkeypatch.setattr(hang, "dump_stack", lambda pid: dumps[pid]())
    pids = {0: 0, 1: 1}
    with pytest.raises(TimeoutError):  # gloo's rule: every rank idle
        hang.settled_stacks(pids, time.monotonic() + 0.5, pause_s=0.05)
    begin = time.monotonic()  # NCCL's: a running rank whose stack stayed the same for still_s
    stacks, rounds = hang.settled_stacks(pids, begin + 10, pause_s=0.05, still_s=0.3)
    assert time.monotonic() - begin >= 0.3 and rounds >= 2
    assert (stacks[0].idle, stacks[0].frames[0].line, stacks[1].idle) == (False, 18, True)
    dumps[0] = lambda: _main_thread_dump("active", next(lines))
    with pytest.raises(TimeoutError):
        hang.settled_stacks(pids, time.monotonic() + 1.0, pause_s=0.05, still_s=0.3)


def test_debug_variable_lines_are_filtered_and_sanitized():
    lines = debugging.rank_lines(
        [
            "[rank 0] [I1201 07:40:52.846279724 debug.cpp:48] [c10d] The debug level is set to DETAIL.\n",
            "[rank 0] [I1201 07:40:55.471 socket.cpp:955] [c10d] The client socket has connected to "
            "[::ffff:127.0.0.1]:33043 on SocketImpl(fd=3, addr=[::ffff:127.0.0.1]:34232, "
            "remote=[::ffff:127.0.0.1]:33043).\n"
            "[rank 1] [rank1]:[I1201 07:40:55.589 ProcessGroupWrapper.cpp:710] [Rank 1] Running collective: "
            "CollectiveFingerPrint(SequenceNumber=1, OpType=ALLREDUCE, TensorShape=[5], TensorDtypes=Float, "
            "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu, memory_format=(nullopt)))\n",
            "[rank 1] gpu-node:4321:4400 [1] NCCL INFO comm 0x5581c0e0 rank 1 nranks 2 cudaDev 1 busId 1b000 "
            "- Init COMPLETE\n",
            "not a rank's line\n",
        ]
    )
    assert debugging.c10d_log(lines[0]) == [
        ("debug.cpp", "[c10d] The debug level is set to DETAIL."),
        ("socket.cpp", "[c10d] The client socket has connected to [::ffff:127.0.0.1]:PORT"),
    ]
    assert debugging.c10d_log(lines[1]) == [
        (
            "ProcessGroupWrapper.cpp",
            "[Rank 1] Running collective: CollectiveFingerPrint(SequenceNumber=1, OpType=ALLREDUCE, TensorShape=[5], "
            "TensorDtypes=Float, ...)",
        )
    ]
    assert debugging.nccl_log(lines[1]) == [
        "NCCL INFO comm 0x... rank 1 nranks 2 cudaDev 1 busId 1b000 - Init COMPLETE"
    ]


def test_a_straggler_works_longest_and_waits_least():
    delay = 0.08
    ranks = run(rank_tools.stragglers, 3, kwargs={"slow_rank": 1, "delay_s": delay}, timeout=240)
    work = [statistics.median(r["work"]) for r in ranks]
    wait = [statistics.median(r["wait"]) for r in ranks]
    assert max(range(3), key=work.__getitem__) == 1 and min(range(3), key=wait.__getitem__) == 1
    assert work[1] >= delay, work  # its work includes the delay it sleeps
    assert all(len(r["step"]) == 8 for r in ranks)


def test_detail_crashes_ddp_construction_on_gloo():
    """torch 2.13: TORCH_DISTRIBUTED_DEBUG=DETAIL + DDP on gloo dies with SIGSEGV in DDP's start-up logging.

    Notebook 14 says so and uses DETAIL on plain collectives only. When this test fails, torch fixed it:
    update section 4 of the notebook.
    """
    with pytest.raises(RankFailedError) as caught:
        run(rank_tools.ddp_construction, 2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, timeout=120)
    assert any("SIGSEGV" in f.summary for f in caught.value.failures), [f.summary for f in caught.value.failures]


def test_nccl_timeout_is_refused_at_once_without_gpus():
    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs it in notebook 14")
    from course_lib.launch import LaunchError

    with pytest.raises(LaunchError):
        debugging.nccl_timeout(2, {"TORCH_NCCL_BLOCKING_WAIT": "1"})


def test_live_step_plot_joins_a_step_line_the_tee_split():
    live = debugging.LiveStepPlot(2, samples_per_rank=32, live=False)
    for piece in ("[rank 0] step 0 0.0061", "[rank 1] step 0 0.005 s 300.0 MB 0.4", "[rank 0] 23 s 309.4 MB 0.41"):
        live.write(piece + "\n", "stdout")
    assert live.lines_seen == 2 and live.seconds == {0: [0.006123], 1: [0.005]} and live.memory[0] == [309.4]


def test_hang_figure_marks_the_collective_the_others_wait_in():
    from types import SimpleNamespace

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def stack(function):
        return SimpleNamespace(frames=[SimpleNamespace(function=function, basename="cell.py")])

    diagnosis = SimpleNamespace(
        flight={r: SimpleNamespace(last_enqueued=3 if r < 2 else 2) for r in range(3)},
        stacks={0: stack("train"), 1: stack("train"), 2: stack("evaluate")},
    )
    debugging.draw_hang(diagnosis)
    ax = plt.gcf().axes[0]
    texts = [t.get_text() for t in ax.texts]
    red = [p for p in ax.patches if p.get_facecolor()[:3] == matplotlib.colors.to_rgb("tab:red")]
    plt.close("all")
    assert len(red) == 2 and texts.count("never issued") == 1  # ranks 0 and 1 wait in #3, rank 2 never issued it
    assert "main thread in evaluate()" in texts
