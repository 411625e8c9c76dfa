"""torchft (notebook 06, sections 11 and 12): replica groups that keep training when one dies; LocalSGD and DiLoCo.

Each replica group is a one-rank torchrun run started by the elastic run's machinery (checkpoint/lab.py); the
lighthouse runs in this process. Every test also checks that no process of its runs is left. The kill-and-heal run
itself is asserted in notebook 06 (section 11), step by step; its elastic counterpart (a node joins, a node leaves)
in section 10.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from course_lib import checkpoint as ck
from course_lib.models import MLP


def test_a_torchft_run_ends_every_process_at_its_timeout(tmp_path):
    with pytest.raises(TimeoutError, match=r"^gave up waiting for replica \S+ to \w+") as caught:
        ck.run_torchft(tmp_path / "torchft", timeout_s=3)
    assert caught.value.__notes__[-1] == "processes left behind after ending every replica: []"


def test_local_sgd_and_diloco_send_one_over_h_of_ddps_bytes(tmp_path):
    sync = ck.compare_sync(tmp_path / "sync", steps=8, timeout_s=240)
    assert list(sync.runs) == list(ck.SYNC_RUNS)
    parameters = sum(p.numel() for p in MLP().parameters())
    ddp = Fraction(sum(sync.runs["DDP"]["allreduced"]), 8)
    assert ddp == 4 * parameters  # every gradient, every step
    assert len(sync.runs["DDP"]["allreduced"]) == 8  # one bucket per step for this small model
    for name, (method, h) in ck.SYNC_RUNS.items():
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
    assert ck.step_losses([log_a, log_b, log_c]) == {0: 2.0, 1: 0.5}


def test_replicas_wait_for_what_the_lighthouse_has_received():
    from datetime import timedelta

    from torchft.coordination import LighthouseClient

    from course_lib.checkpoint.fault_tolerance import wait_at_lighthouse
    from course_lib.checkpoint.lab import _lighthouse

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
