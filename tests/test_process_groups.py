"""Notebook 00's health check and exercises on real gloo ranks: the solutions pass, wrong answers
(those that skip the communication included) are rejected with the expected message, the prediction
check takes the right number and refuses the usual wrong ones."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from course_lib import process_groups
from course_lib.exercises import check, check_prediction
from tests.rank_programs import assert_judged, judge, run, run_source, world_sizes
from tests.rank_programs import process_groups as programs

SOLUTIONS = str(Path(__file__).parents[1] / "notebooks" / "solutions" / "00_torchrun_and_process_groups.py")


def solutions(nproc: int) -> dict:
    return runpy.run_path(SOLUTIONS, init_globals={"NPROC": nproc})


# ---- wrong answers (module level: the ranks import them) --------------------------------------


def rank_sum_from_the_formula(value):
    import torch.distributed as dist

    n = dist.get_world_size()
    return n * (n - 1) // 2  # the old exercise's shortcut: no communication


def rank_sum_scaled_locally(value):
    import torch.distributed as dist

    return value * dist.get_world_size()  # as if every rank had this rank's value


def rank_sum_barrier_then_local(value):
    import torch.distributed as dist

    dist.barrier()  # communicates, but nothing of the others' values
    return value * dist.get_world_size()


def rank_sum_max(value):
    import torch.distributed as dist

    total = value.clone()
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return total


def rank_sum_as_number(value):
    import torch.distributed as dist

    total = value.clone()
    dist.all_reduce(total)
    return total.tolist()


def gather_values_range(value):
    import torch.distributed as dist

    return list(range(dist.get_world_size()))  # the old exercise's shortcut


def gather_values_of_ranks(value):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, dist.get_rank())  # gathers the ranks, not the values
    return out


def gather_values_reversed(value):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out[::-1]


def gather_values_as_tensor(value):
    import torch
    import torch.distributed as dist

    out = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([value]))
    return torch.cat(out)


def mean_loss_on_rank_0_only(loss):
    import torch.distributed as dist

    if dist.get_rank() == 0:  # the notebook's broken version
        total = loss.clone()
        dist.all_reduce(total)
        return total / dist.get_world_size()
    return loss


def mean_loss_without_dividing(loss):
    import torch.distributed as dist

    total = loss.clone()
    dist.all_reduce(total)
    return total


def mean_loss_local(loss):
    return loss


def mean_loss_printed_everywhere(loss):
    import torch.distributed as dist

    total = loss.clone()
    dist.all_reduce(total)
    mean = total / dist.get_world_size()
    print(f"mean loss {mean.item():.3f}")  # on every rank: N lines
    return mean


WRONG = [
    ("rank_sum_from_the_formula", "check_rank_sum", "called no torch.distributed function"),
    ("rank_sum_scaled_locally", "check_rank_sum", "called no torch.distributed function"),
    ("rank_sum_barrier_then_local", "check_rank_sum", "rank_sum(value) on 3 ranks, call 1 with new values: element"),
    ("rank_sum_max", "check_rank_sum", "expected"),
    ("rank_sum_as_number", "check_rank_sum", "must return a tensor, got list"),
    ("gather_values_range", "check_gather_values", "called no torch.distributed function"),
    ("gather_values_of_ranks", "check_gather_values", "gather_values(value) on 3 ranks, call 1 with new values["),
    ("gather_values_reversed", "check_gather_values", "expected"),
    ("gather_values_as_tensor", "check_gather_values", "must return a list, got Tensor"),
    ("mean_loss_without_dividing", "check_mean_loss", "mean_loss(loss) on rank"),
    ("mean_loss_local", "check_mean_loss", "called no torch.distributed function"),
    ("mean_loss_printed_everywhere", "check_mean_loss", "mean_loss printed 3 lines in all (per rank: [1, 1, 1])"),
]


def test_solutions_pass_and_wrong_answers_fail_on_3_ranks():
    """One launch judges every case; each wrong answer fails on every rank at the same call."""
    answers = solutions(3)
    assert_judged(
        [(answers[name], getattr(process_groups, checker)) for name, checker in SOLVED],
        [(globals()[wrong], getattr(process_groups, checker), says) for wrong, checker, says in WRONG],
    )


SOLVED = [("rank_sum", "check_rank_sum"), ("gather_values", "check_gather_values"), ("mean_loss", "check_mean_loss")]


@pytest.mark.parametrize("nproc", world_sizes(2, 4))
def test_solutions_pass_at_other_world_sizes(nproc):
    answers = solutions(nproc)
    verdicts = judge([(answers[name], getattr(process_groups, checker)) for name, checker in SOLVED], nproc)
    assert verdicts == [["ok"] * nproc] * len(SOLVED), verdicts


def test_desynced_mean_loss_fails_in_seconds(capsys):
    """The broken logger hangs rank 0 in its all_reduce: the checker ends that and says what differs."""
    assert check(mean_loss_on_rank_0_only, process_groups.check_mean_loss, nproc=3, backend="gloo", timeout=90) is False
    out = capsys.readouterr().out
    assert "✗ mean_loss_on_rank_0_only" in out and "the ranks made different communication calls" in out, out
    assert "rank 0: ['all_reduce']; rank 1: none" in out and "waited in vain" in out, out


@pytest.mark.parametrize("nproc", [1, 2, 3, 4, 8])
def test_prediction(nproc, capsys):
    once = sum(100.0 + r for r in range(nproc))  # what one all_reduce(SUM) of 100 + rank leaves on every rank
    measured = nproc * once  # the second all_reduce sums nproc copies of it
    assert check_prediction("t", solutions(nproc)["predicted_sum"], measured, rtol=0.01) is True
    if nproc > 1:
        wrong = {
            "one all_reduce (the second changes nothing)": once,
            "each rank keeps its own value": 100.0,
            "each rank's own value times N": 100.0 * nproc,
            "the sum squared": once**2,
            "ranks from 0 (r instead of 100 + r), twice": nproc * nproc * (nproc - 1) / 2,
        }
        for reasoning, value in wrong.items():
            assert check_prediction("t", value, measured, rtol=0.01) is False, reasoning
    capsys.readouterr()


def two_all_reduces(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor([100.0 + rank])  # the exercise's three lines
    dist.all_reduce(t)
    dist.all_reduce(t)
    return {"t": t.item()}


def test_prediction_is_what_the_ranks_hold():
    """The exercise's lines on 3 gloo ranks leave the solution's number, 909, on every rank."""
    held = [result["t"] for result in run_source(two_all_reduces, 3)]
    assert held == [float(solutions(3)["predicted_sum"])] * 3 == [909.0] * 3, held


def test_health_check_sees_every_rank():
    results = run(programs.health, 3)
    assert [r["total"] for r in results] == [3.0] * 3


def test_mean_loss_checker_hands_a_cpu_loss_to_gloo_even_on_a_gpu_rank(monkeypatch):
    """The deadlock lesson needs gloo's timeout: on a GPU rank (meta stands in) the loss stays on the CPU, which
    the default group's gloo part carries ("cpu:gloo,cuda:nccl")."""
    import torch

    from course_lib.process_groups import checkers
    from tests.device_fakes import Reached, on_meta, recorder

    on_meta(monkeypatch, checkers)
    devices: list = []
    with pytest.raises(Reached):
        checkers.check_mean_loss(recorder(devices))
    assert devices == [torch.device("cpu")]


def test_figures_draw(monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "show", lambda: None)
    process_groups.draw_rendezvous(3)
    assert "get note/0" in [t.get_text().split("\n")[-1] for t in plt.gcf().axes[0].texts]
    process_groups.draw_mesh(2, 3)
    texts = [t.get_text() for t in plt.gca().texts]
    assert " tp group [3, 4, 5]" in texts and "dp group\n[2, 5]" in texts
    plt.close("all")
