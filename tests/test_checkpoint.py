"""course_lib.checkpoint on real gloo ranks: resharding N -> M, atomic commits, kill-and-resume, the exercise.

Each launch costs a few seconds of start-up, so each one checks many things.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from course_lib import checkpoint as ck
from course_lib.exercises import check
from course_lib.launcher import launch
from course_lib.models import MLP

QUIET = dict(write=lambda text, stream: None)

# Trains 2 steps (or loads), compares with the full snapshot, saves in both formats.
RESHARD_BODY = r"""
from pathlib import Path
import torch.distributed.checkpoint as dcp
from course_lib import checkpoint as ck
from course_lib.data import regression

root = Path(root)
model = ck.sharded_mlp(seed=7)      # a different start: loading must overwrite all of it
optimizer = ck.make_optimizer(model)
app = ck.AppState(model, optimizer)
ours, theirs = ck.AppState(ck.sharded_mlp(seed=8), None), None
if source is None:                 # the first job: train, then save the full snapshot and both sharded formats
    data = regression(n=480)
    for step in range(2):
        ck.train_step(model, optimizer, *ck.batch_for_step(data, step, 48, rank, world_size))
    app.step = 2
    ck.save_full_snapshot(root / "snapshot.pt", model, optimizer, step=2)
    files_read = {}
else:                              # a later job with another world size: load both formats
    ck.dcp_load(root / f"dcp_{source}" / "step_2", app)
    dcp_state = ck.full_state(model, optimizer)
    mine_model = ck.sharded_mlp(seed=9)
    mine_optimizer = ck.make_optimizer(mine_model)
    mine = ck.AppState(mine_model, mine_optimizer)
    files_read = ck.load_sharded(root / f"mine_{source}" / "step_2", {"app": mine})
    mine_state = ck.full_state(mine_model, mine_optimizer)
    snapshot_model = ck.sharded_mlp(seed=10)
    snapshot_optimizer = ck.make_optimizer(snapshot_model)
    assert ck.load_full_snapshot(root / "snapshot.pt", snapshot_model, snapshot_optimizer) == 2
    snapshot_state = ck.full_state(snapshot_model, snapshot_optimizer)
    if rank == 0:
        expected = torch.load(root / "snapshot.pt", weights_only=True)
        expected = ck.flat_tensors({"model": expected["model"], "optimizer": expected["optimizer"]})
        assert ck.differing(dcp_state, expected) == [], ck.differing(dcp_state, expected)
        assert ck.differing(mine_state, expected) == [], ck.differing(mine_state, expected)
        assert ck.differing(snapshot_state, expected) == [], ck.differing(snapshot_state, expected)
    assert app.step == mine.step == 2
ck.dcp_save(root / f"dcp_{world_size}", 2, app)
ck.save_sharded(root / f"mine_{world_size}", 2, {"app": app})
ok = True
"""


def test_resharding_4_to_2_to_3_and_to_one_process(tmp_path):
    for nproc, source in ((4, None), (2, 4), (3, 2)):
        result = launch(
            RESHARD_BODY,
            nproc,
            backend="gloo",
            out=["ok", "files_read"],
            timeout=120,
            push={"root": str(tmp_path), "source": source},
            **QUIET,
        )
        assert result.values["ok"] == [True] * nproc
        if source == 4:  # 4 -> 2: rank 0 reads saved shards 0 and 1 of a 64-row weight, rank 1 reads 2 and 3
            assert result.values["files_read"][0]["app/model/0.weight"] == ["shard_0.pt", "shard_1.pt"]
            assert result.values["files_read"][1]["app/model/0.weight"] == ["shard_2.pt", "shard_3.pt"]
    snapshot = torch.load(tmp_path / "snapshot.pt", weights_only=True)
    assert ck.files_of(tmp_path / "mine_3" / "step_2") == sorted(ck.files_of(tmp_path / "mine_3" / "step_2"))
    assert [n for n, _ in ck.files_of(tmp_path / "dcp_3" / "step_2")] == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
    ]
    # into one process, no process group: our format directly, DCP's through format_utils
    model = MLP(seed=5)
    template = {"app": {"model": model.state_dict(), "step": 0}}
    ck.load_sharded(tmp_path / "mine_3" / "step_2", template)
    assert template["app"]["step"] == 2
    for name, tensor in snapshot["model"].items():
        assert torch.equal(model.state_dict()[name], tensor), name
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    dcp_to_torch_save(tmp_path / "dcp_3" / "step_2", tmp_path / "exported.pt")
    exported = torch.load(tmp_path / "exported.pt", weights_only=False)["app"]
    for name, tensor in snapshot["model"].items():
        assert torch.equal(exported["model"][name], tensor), name
    torch_save_to_dcp(tmp_path / "exported.pt", tmp_path / "back_to_dcp")
    assert (tmp_path / "back_to_dcp" / ".metadata").exists()


def small_checkpoint(root: Path, step: int) -> Path:
    return ck.save_sharded(root, step, {"model": MLP(seed=step).state_dict(), "step": step})


def test_verify_names_the_file_and_the_problem(tmp_path):
    with pytest.raises(ck.CheckpointError, match=r"^step_3: no such checkpoint directory"):
        ck.verify(tmp_path / "step_3")
    good = small_checkpoint(tmp_path, 1)
    assert ck.verify(good)["step"] == 1
    truncated = small_checkpoint(tmp_path, 2)
    shard = truncated / "shard_0.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ck.CheckpointError, match=r"^step_2/shard_0.pt: truncated or overwritten: 100 bytes"):
        ck.verify(truncated)
    flipped = small_checkpoint(tmp_path, 3)
    data = bytearray((flipped / "shard_0.pt").read_bytes())
    data[-100] ^= 0xFF
    (flipped / "shard_0.pt").write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match=r"^step_3/shard_0.pt: corrupt: SHA-256"):
        ck.verify(flipped)
    unfinished = small_checkpoint(tmp_path, 4)
    (unfinished / ck.METADATA).unlink()
    with pytest.raises(ck.CheckpointError, match=r"^step_4/metadata.json: missing; the save did not finish"):
        ck.verify(unfinished)
    with pytest.raises(ck.CheckpointError, match=r"already exists; a checkpoint is never overwritten"):
        small_checkpoint(tmp_path, 1)
    # a different model: wider layers, or other layer names
    with pytest.raises(
        ck.CheckpointError, match=r"'model/0.weight' was saved with shape \[64, 32\], this model has \[128, 32\]"
    ):
        ck.load_sharded(good, {"model": MLP(d_hidden=128).state_dict(), "step": 0})
    with pytest.raises(ck.CheckpointError, match=r"has no tensor 'model/10.weight'"):
        ck.load_sharded(good, {"model": MLP(n_layers=5).state_dict(), "step": 0})
    # falls back past the bad ones to step_1; nothing that was complete was touched
    (tmp_path / "step_9.tmp").mkdir()
    latest, skipped = ck.latest_complete(tmp_path)
    assert latest == good
    assert [name for name, _ in skipped] == ["step_9.tmp", "step_4", "step_3", "step_2"]
    assert ck.verify(good)["step"] == 1


def test_a_save_that_dies_before_its_commit_leaves_nothing_behind(tmp_path, monkeypatch):
    first = small_checkpoint(tmp_path, 1)

    def die(partial, final):
        raise KeyboardInterrupt("the process dies between writing and committing")

    monkeypatch.setattr(ck, "_commit", die)
    with pytest.raises(KeyboardInterrupt):
        small_checkpoint(tmp_path, 2)
    assert not (tmp_path / "step_2").exists() and (tmp_path / "step_2.tmp" / ck.METADATA).exists()
    assert ck.latest_complete(tmp_path) == (first, [("step_2.tmp", "uncommitted")])
    monkeypatch.undo()
    second = small_checkpoint(tmp_path, 2)  # the retry replaces the leftovers and commits
    assert ck.latest_complete(tmp_path) == (second, [])
    assert ck.verify(first)["step"] == 1


def test_read_plan_and_shard_rows():
    assert [ck.shard_rows(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert ck.shard_rows(2, 3, 2) == (2, 2)  # an empty shard
    assert ck.read_plan(64, 4, 2) == [[(0, 0, 16), (1, 16, 32)], [(2, 32, 48), (3, 48, 64)]]
    assert ck.read_plan(64, 2, 3)[1] == [(0, 22, 32), (1, 32, 44)]  # the middle rank straddles the boundary
    for saved in (1, 2, 3, 4):
        for loading in (1, 2, 3, 4):
            rows = [r for reads in ck.read_plan(10, saved, loading) for _, lo, hi in reads for r in range(lo, hi)]
            assert rows == list(range(10))


KILL_BODY = r"""
import os
from course_lib import checkpoint as ck
model, optimizer, resumed_from = ck.train_resumable(root + "/run", total_steps=12, every=4, kill_at=6,
                                                    log=root + "/log.jsonl")
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
reference_model, reference_optimizer, _ = ck.train_resumable(root + f"/reference_{rank}_{attempt}", total_steps=12,
                                                             every=100)
bitwise_equal = torch.equal(ck.local_state(model, optimizer), ck.local_state(reference_model, reference_optimizer))
"""


@pytest.mark.parametrize("nproc", [3])
def test_kill_and_resume_is_bitwise_equal_to_uninterrupted(tmp_path, nproc):
    result = launch(
        KILL_BODY,
        nproc,
        backend="gloo",
        max_restarts=1,
        timeout=180,
        push={"root": str(tmp_path)},
        out=["bitwise_equal", "resumed_from"],
        **QUIET,
    )
    assert len(result.attempts) == 2
    assert result.values["resumed_from"] == [4] * nproc  # the checkpoint of step 4, not 8 (never reached)
    assert result.values["bitwise_equal"] == [True] * nproc
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [(e["attempt"], e["step"]) for e in log] == [(0, s) for s in range(6)] + [(1, s) for s in range(4, 12)]
    # steps 4 and 5 ran twice, from the same state: the same loss bit for bit
    assert [e["loss"] for e in log[4:6]] == [e["loss"] for e in log[6:8]]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step_12", "step_4", "step_8"]


def wrong_string_order(root):
    import os

    from course_lib import checkpoint

    if not os.path.isdir(root):
        return None
    for name in sorted(os.listdir(root), reverse=True):  # "step_9" > "step_10" as strings
        if name.startswith("step_") and not name.endswith(".tmp"):
            try:
                checkpoint.verify(os.path.join(root, name))
                return os.path.join(root, name)
            except checkpoint.CheckpointError:
                pass
    return None


def wrong_no_verification(root):
    import os

    if not os.path.isdir(root):
        return None
    steps = [int(n.split("_")[1]) for n in os.listdir(root) if n.startswith("step_") and not n.endswith(".tmp")]
    return os.path.join(root, f"step_{max(steps)}") if steps else None


def wrong_crashes_on_missing_root(root):
    import os

    from course_lib import checkpoint

    names = [n for n in os.listdir(root) if n.startswith("step_") and n[5:].isdigit()]  # os.listdir raises if absent
    for step in sorted((int(n[5:]) for n in names), reverse=True):
        try:
            return checkpoint.verify(os.path.join(root, f"step_{step}")) and os.path.join(root, f"step_{step}")
        except checkpoint.CheckpointError:
            pass
    return None


def find_latest_complete(root):
    import os
    import re

    from course_lib import checkpoint

    if not os.path.isdir(root):
        return None
    steps = sorted((int(m.group(1)) for n in os.listdir(root) if (m := re.fullmatch(r"step_(\d+)", n))), reverse=True)
    for step in steps:
        try:
            checkpoint.verify(os.path.join(root, f"step_{step}"))
            return os.path.join(root, f"step_{step}")
        except checkpoint.CheckpointError:
            continue
    return None


def test_exercise_checker_in_process():
    ck.check_find_latest_complete(ck.reference_find_latest_complete)
    ck.check_find_latest_complete(find_latest_complete)
    for wrong, message in (
        (wrong_string_order, "step_10 is newer than step_9: expected 'step_10', got 'step_9'"),
        (wrong_no_verification, "the newest is truncated, newer ones are partial: expected 'step_9', got 'step_12'"),
        (wrong_crashes_on_missing_root, "the directory does not exist yet: raised FileNotFoundError"),
    ):
        with pytest.raises(AssertionError, match=message):
            ck.check_find_latest_complete(wrong)


def test_exercise_check_on_ranks(capsys):
    assert (
        check(find_latest_complete, "course_lib.checkpoint:check_find_latest_complete", nproc=2, backend="gloo") is True
    )
    assert (
        check(wrong_string_order, "course_lib.checkpoint:check_find_latest_complete", nproc=2, backend="gloo") is False
    )
    out = capsys.readouterr().out
    assert "✓ find_latest_complete: correct on 2 ranks" in out
    assert re.search(
        r"✗ wrong_string_order: rank [01]: step_10 is newer than step_9: expected 'step_10', got 'step_9'", out
    )
