"""Notebook 00's health check and exercise checkers, on real gloo ranks."""

from __future__ import annotations

import pytest

from course_lib import process_groups
from course_lib.exercises import check
from tests.rank_programs import process_groups as programs
from tests.rank_programs import run


def rank_sum_off_by_one():
    import torch
    import torch.distributed as dist

    t = torch.tensor([dist.get_rank() + 1])  # counts ranks from 1
    dist.all_reduce(t)
    return int(t.item())


def gather_ranks_as_tensor():
    import torch
    import torch.distributed as dist

    out = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([dist.get_rank()]))
    return torch.cat(out)  # a tensor, not the list the exercise asks for


@pytest.mark.parametrize("nproc", [2, 3])
def test_reference_solutions_pass(nproc, capsys):
    assert check(process_groups.solution_rank_sum, process_groups.check_rank_sum, nproc=nproc, backend="gloo")
    assert check(process_groups.solution_gather_ranks, process_groups.check_gather_ranks, nproc=nproc, backend="gloo")
    assert capsys.readouterr().out.count(f"correct on {nproc} ranks") == 2


@pytest.mark.parametrize(
    "wrong, checker, message",
    [
        (rank_sum_off_by_one, process_groups.check_rank_sum, "expected 3, got 6"),
        (gather_ranks_as_tensor, process_groups.check_gather_ranks, "must return a list, got Tensor"),
    ],
)
def test_checkers_reject_wrong_answers(wrong, checker, message, capsys):
    assert check(wrong, checker, nproc=3, backend="gloo") is False
    out = capsys.readouterr().out
    assert "✗" in out and message in out, out


def test_health_check_sees_every_rank():
    results = run(programs.health, 3)
    assert [r["total"] for r in results] == [3.0] * 3
