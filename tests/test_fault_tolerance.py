"""Notebook 07: elastic membership (section 2); torchft (sections 3 and 4): replica groups that keep training when one
dies; LocalSGD and DiLoCo.

Each replica group is a one-rank torchrun run started by the elastic run's machinery (fault_tolerance/lab.py); the
lighthouse runs in this process. Every test also checks that no process of its runs is left. The kill-and-heal run
itself is asserted in notebook 07 (section 3), step by step; its elastic counterpart (a node joins, a node leaves)
in section 2. Then the checkers of notebook 07's exercises, against their solutions and named wrong answers.
"""

from __future__ import annotations

import re
from fractions import Fraction

import pytest

from course_lib import fault_tolerance as ft
from course_lib.models import MLP
from tests.rank_programs import assert_checker, run, world_sizes
from tests.rank_programs import fault_tolerance as ft_programs

# ---- elastic membership: torchrun --nnodes 1:2, a node joins, a node leaves ------------------------------------


def test_elastic_run_ends_every_process_at_its_timeout(tmp_path):
    """6 s cannot hold the whole run. The phase it stops in depends on the machine's speed (node 0's first pause under
    load, the two nodes' pause on an idle machine); in any of them both nodes' processes end."""
    phases = r"(node 0 alone to pause|both nodes to pause) at step \d+|node 0 to finish"
    with pytest.raises(TimeoutError, match=rf"^gave up waiting for ({phases}): every process was ended") as caught:
        ft.run_elastic(tmp_path / "elastic", timeout_s=6)
    assert caught.value.__notes__[-1] == "processes left behind after ending both nodes: []"


def test_segments_split_the_log_at_each_start_that_trained():
    events = [
        {"event": "start", "world": 1, "step": 0, "saved_by": None, "restarts": 0},
        {"event": "step", "world": 1, "step": 0, "loss": 1.0},
        {"event": "pause", "world": 1, "step": 1},
        {"event": "start", "world": 1, "step": 1, "saved_by": 1, "restarts": 0},  # restarted without the change
        {"event": "start", "world": 2, "step": 1, "saved_by": 1, "restarts": 0},
        {"event": "step", "world": 2, "step": 1, "loss": 0.5},
    ]
    assert ft.segments(events) == [
        ft.Segment(1, None, None, 0, (0,), (1.0,)),
        ft.Segment(2, 1, 1, 0, (1,), (0.5,)),
    ]


# ---- torchft: replica groups, a lighthouse, LocalSGD and DiLoCo ------------------------------------------------


def test_a_torchft_run_ends_every_process_at_its_timeout(tmp_path):
    with pytest.raises(TimeoutError, match=r"^gave up waiting for replica \S+ to \w+") as caught:
        ft.run_torchft(tmp_path / "torchft", timeout_s=3)
    assert caught.value.__notes__[-1] == "processes left behind after ending every replica: []"


def test_local_sgd_and_diloco_send_one_over_h_of_ddps_bytes(tmp_path):
    sync = ft.compare_sync(tmp_path / "sync", steps=8, timeout_s=240)
    assert list(sync.runs) == list(ft.SYNC_RUNS)
    parameters = sum(p.numel() for p in MLP().parameters())
    ddp = Fraction(sum(sync.runs["DDP"]["allreduced"]), 8)
    assert ddp == 4 * parameters  # every gradient, every step
    assert len(sync.runs["DDP"]["allreduced"]) == 8  # one bucket per step for this small model
    for name, (method, h) in ft.SYNC_RUNS.items():
        record = sync.runs[name]
        assert Fraction(sum(record["allreduced"]), 8) / ddp == Fraction(1, h), name
        if method != "ddp":  # one all-reduce per parameter tensor at each synchronisation
            assert len(record["allreduced"]) == len(list(MLP().parameters())) * 8 // h, name
        assert len(record["losses"]) == 1 and record["losses"][0] > 0
    local, diloco = sync.runs["LocalSGD H=4"]["losses"][0], sync.runs["DiLoCo H=4, outer SGD lr 1"]["losses"][0]
    assert abs(local - diloco) <= 1e-5 * local  # DiLoCo with outer SGD at lr 1 is LocalSGD
    assert sync.runs["DiLoCo H=4, outer Nesterov"]["losses"] != sync.runs["LocalSGD H=4"]["losses"]
    assert sync.replicas_agree and sync.left == []


def test_step_losses_average_the_replicas_that_trained():
    log_a = [
        {"event": "start"},
        {"event": "step", "step": 0, "healed": False, "loss": 1.0},
        {"event": "step", "step": 1, "healed": False, "loss": 0.5},
    ]
    log_b = [{"event": "step", "step": 0, "healed": False, "loss": 3.0}, {"event": "pause", "step": 1}]
    log_c = [{"event": "step", "step": 1, "healed": True, "loss": None}]
    assert ft.step_losses([log_a, log_b, log_c]) == {0: 2.0, 1: 0.5}


def test_replicas_wait_for_what_the_lighthouse_has_received():
    from datetime import timedelta

    from torchft.coordination import LighthouseClient

    from course_lib.fault_tolerance.lab import _lighthouse
    from course_lib.fault_tolerance.replicas import wait_at_lighthouse

    server, address = _lighthouse()
    try:
        client = LighthouseClient(address, timedelta(seconds=5))
        client.heartbeat("a")
        client.heartbeat("b")
        wait_at_lighthouse(address, "2 replicas", lambda _, beating: beating >= 2, 5)  # returns: both heartbeat
        with pytest.raises(TimeoutError, match=r"a replica asking to join; it says \[0/0 participants healthy\]"):
            wait_at_lighthouse(address, "a replica asking to join", lambda asking, _: asking >= 1, 0.3)
    finally:
        server.shutdown()


# ---- the exercises of notebook 07 ------------------------------------------------------------------------------


def test_prediction_of_localsgd_bytes_per_step(capsys):
    """Exercise 1: 4P/8 per step for LocalSGD with H = 8; DDP's 4P, H = 4's, Adam's 12P/8 and a ring's 2(R-1)/R fail."""
    import runpy

    from course_lib.exercises import check_prediction

    parameters = sum(p.numel() for p in MLP().parameters())
    measured = 4 * parameters / 8  # what compare_sync counts (test above: exactly 1/H of DDP's 4P)
    predicted = runpy.run_path(str(ft_programs.SOLUTIONS), init_globals={"parameters": parameters})
    assert check_prediction("bytes", predicted["predicted_sync_bytes"], measured) is True
    for wrong in (4 * parameters, 4 * parameters / 4, 12 * parameters / 8, 2 * (2 - 1) / 2 * 4 * parameters):
        assert check_prediction("bytes", wrong, measured) is False, wrong
    assert "too high" in capsys.readouterr().out


def averages_the_weights(model, anchor, outer_optimizer):  # LocalSGD: right only with outer SGD at lr 1
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for p, a in zip(model.parameters(), anchor):
            dist.all_reduce(p)
            p /= dist.get_world_size()
            a.copy_(p)


def gathers_every_replica(model, anchor, outer_optimizer):  # the right numbers, W times the bytes
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    for p, a in zip(model.parameters(), anchor):
        replicas = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(replicas, p.detach().contiguous())
        a.grad = a.detach() - sum(replicas) / world
    outer_optimizer.step()
    with torch.no_grad():
        for p, a in zip(model.parameters(), anchor):
            p.copy_(a)


def own_pseudo_gradient(model, anchor, outer_optimizer):  # no average: each replica steps alone
    import torch

    for p, a in zip(model.parameters(), anchor):
        a.grad = a.detach() - p.detach()
    outer_optimizer.step()
    with torch.no_grad():
        for p, a in zip(model.parameters(), anchor):
            p.copy_(a)


def summed_pseudo_gradient(model, anchor, outer_optimizer):  # all-reduced, but not divided by W
    import torch
    import torch.distributed as dist

    for p, a in zip(model.parameters(), anchor):
        delta = a.detach() - p.detach()
        dist.all_reduce(delta)
        a.grad = delta
    outer_optimizer.step()
    with torch.no_grad():
        for p, a in zip(model.parameters(), anchor):
            p.copy_(a)


def forgets_the_model(model, anchor, outer_optimizer):  # the anchor steps, the model keeps its drifted weights
    import torch.distributed as dist

    for p, a in zip(model.parameters(), anchor):
        delta = a.detach() - p.detach()
        dist.all_reduce(delta)
        a.grad = delta / dist.get_world_size()
    outer_optimizer.step()


def diloco_outer_step_stub(model, anchor, outer_optimizer):
    raise NotImplementedError  # your code here


DILOCO_WRONG = {
    averages_the_weights: "the anchor is the replicas' average weights: that is LocalSGD",
    gathers_every_replica: re.compile(r"round 1: your function sent [\d,]+ B in all_gather \(10 calls\); DiLoCo sends"),
    own_pseudo_gradient: "made no collective call: each replica stepped on its own pseudo-gradient",
    summed_pseudo_gradient: "round 1: the anchor differs from the outer optimizer's step on the mean pseudo-gradient",
    forgets_the_model: "round 1: the anchor is right, but the model's weights are not",
}


@pytest.mark.parametrize("nproc", world_sizes(2, 3))
def test_diloco_outer_step_checker_rejects_each_shortcut(nproc):
    assert_checker(
        ft.check_diloco_outer_step,
        ft_programs.diloco_outer_step,
        DILOCO_WRONG,
        nproc=nproc,
        stub=diloco_outer_step_stub,
    )


def test_resume_exercise_checker_on_ranks():
    verdicts = run(ft_programs.resume_verdicts, 3, timeout=240)
    for rank, got in enumerate(verdicts):
        assert got["resume_step"] == "passed", (rank, got)
    anywhere = {name: [v[name] for v in verdicts if v[name] != "passed"] for name in verdicts[0]}
    # each wrong answer is rejected on at least one rank, with the case that exposes it
    assert re.fullmatch(
        r"case 'rank 0 sees step_\d+ committed, the others do not yet': returned step 4, rank 0 resumes from step \d+",
        anywhere["resume_alone"][0],
    ), anywhere
    assert anywhere["resume_newest_anyone_has"][0].startswith("case 'rank 0's step_"), anywhere
    assert "rank 0 resumes from step 2" in anywhere["resume_newest_anyone_has"][0]
    assert anywhere["resume_oldest_everyone_has"][0].startswith("case 'rank 0 sees step_"), anywhere
