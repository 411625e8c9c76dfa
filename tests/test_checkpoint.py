"""course_lib.checkpoint on real gloo ranks: resharding N -> M, atomic commits, kill-and-resume, the exercise.

Each launch costs a few seconds of start-up, so each one checks many things.
"""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

import pytest
import torch

from course_lib import checkpoint as ck
from course_lib.exercises import check
from course_lib.launch import launch
from course_lib.models import MLP
from tests.rank_programs import assert_checker, run, run_source, world_sizes
from tests.rank_programs import checkpoint as rank_programs

QUIET = dict(write=lambda text, stream: None)


def test_resharding_4_to_2_to_3_and_to_one_process(tmp_path):
    for nproc, source in ((4, None), (2, 4), (3, 2)):
        results = run(rank_programs.reshard, nproc, kwargs={"root": str(tmp_path), "source": source}, timeout=120)
        if source is None:
            continue
        # rank 0 gathered every loaded state: bitwise equal to the full snapshot, tensor by tensor
        assert results[0]["compared"] == 40  # the model's 8 tensors and their Adam state (step, exp_avg, exp_avg_sq)
        assert results[0]["differing"] == {"dcp": [], "mine": [], "snapshot": []}
        for rank, got in enumerate(results):
            assert got["steps"] == {"dcp": 2, "mine": 2, "snapshot": 2}, rank
        if source == 4:  # 4 -> 2: rank 0 reads saved shards 0 and 1 of a 64-row weight, rank 1 reads 2 and 3
            assert results[0]["files_read"]["app/model/0.weight"] == ["shard_0.bin", "shard_1.bin"]
            assert results[1]["files_read"]["app/model/0.weight"] == ["shard_2.bin", "shard_3.bin"]
        else:  # 2 -> 3: the middle rank straddles the boundary of the two saved shards
            assert [r["files_read"]["app/model/0.weight"] for r in results] == [
                ["shard_0.bin"],
                ["shard_0.bin", "shard_1.bin"],
                ["shard_1.bin"],
            ]
        # each rank read its rows of every sharded tensor (S = 12 P together) and every replicated tensor: exactly
        # what bytes_to_read derives from the metadata alone
        expected = ck.bytes_to_read(tmp_path / f"mine_{source}" / "step_2", nproc)
        assert [r["row_bytes"] for r in results] == [e["rows"] + e["replicated"] for e in expected]
        replicated = expected[0]["replicated"]
        state_bytes = 12 * sum(p.numel() for p in MLP().parameters())
        assert sum(e["rows"] for e in expected) == state_bytes
        for got in results:
            # S/M up to torch.chunk's rounding: ceil(R/M) rows per rank, the last ranks fewer (7% at M = 3)
            assert abs(got["row_bytes"] - replicated - state_bytes / nproc) <= 0.1 * state_bytes / nproc
    snapshot = torch.load(tmp_path / "snapshot.pt", weights_only=True)
    assert [n for n, _ in ck.files_of(tmp_path / "mine_3" / "step_2")] == [
        "metadata.json",
        "objects.pt",
        "shard_0.bin",
        "shard_1.bin",
        "shard_2.bin",
    ]
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
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    dcp_to_torch_save(tmp_path / "dcp_3" / "step_2", tmp_path / "exported.pt")
    exported = torch.load(tmp_path / "exported.pt", weights_only=False)["app"]
    for name, tensor in snapshot["model"].items():
        assert torch.equal(exported["model"][name], tensor), name
    torch_save_to_dcp(tmp_path / "exported.pt", tmp_path / "back_to_dcp")
    reimported = FileSystemReader(tmp_path / "back_to_dcp").read_metadata()
    assert set(reimported.state_dict_metadata) >= {f"app.model.{name}" for name in snapshot["model"]}


def small_checkpoint(root: Path, step: int) -> Path:
    return ck.save_sharded(root, step, {"model": MLP(seed=step).state_dict(), "step": step})


def test_verify_names_the_file_and_the_problem(tmp_path):
    with pytest.raises(ck.CheckpointError, match=r"^step_3: no such checkpoint directory"):
        ck.verify(tmp_path / "step_3")
    good = small_checkpoint(tmp_path, 1)
    assert ck.verify(good)["step"] == 1
    truncated = small_checkpoint(tmp_path, 2)
    shard = truncated / "shard_0.bin"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ck.CheckpointError, match=r"^step_2/shard_0.bin: truncated or overwritten: 100 bytes"):
        ck.verify(truncated)
    with pytest.raises(ck.CheckpointError, match=r"^step_2/shard_0.bin: 100 bytes, metadata records"):
        ck.load_sharded(truncated, {"model": MLP().state_dict(), "step": 0})  # a stat, before any read
    flipped = small_checkpoint(tmp_path, 3)
    data = bytearray((flipped / "shard_0.bin").read_bytes())
    data[-100] ^= 0xFF  # in the last row of the last tensor (the output bias)
    (flipped / "shard_0.bin").write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match=r"^step_3/shard_0.bin: corrupt: SHA-256"):
        ck.verify(flipped)
    with pytest.raises(ck.CheckpointError, match=r"^step_3/shard_0.bin: corrupt: row \d+ fails its CRC-32"):
        ck.load_sharded(flipped, {"model": MLP().state_dict(), "step": 0})  # the loader checks what it reads
    loaded = ck.load_sharded(good, {"model": MLP().state_dict(), "step": 0})
    assert loaded.row_bytes == 4 * sum(p.numel() for p in MLP().parameters())  # one process: every row, once
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

    monkeypatch.setattr("course_lib.checkpoint.sharded._commit", die)  # the commit save_sharded calls
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


# The body of each rank: a rank that kills itself needs the launcher's restart, so the test launches it directly.
KILL_BODY = (
    "from tests.rank_programs.checkpoint import kill_and_resume\n"
    "result = kill_and_resume(rank, world_size, root=root)\n"
)


@pytest.mark.parametrize("nproc", [3])
def test_kill_and_resume_is_bitwise_equal_to_uninterrupted(tmp_path, nproc):
    result = launch(
        KILL_BODY,
        nproc,
        backend="gloo",
        max_restarts=1,
        timeout=180,
        push={"root": str(tmp_path)},
        out=["result"],
        **QUIET,
    )
    why = (result.attempts[0].failures, result.agent_log[-1500:])  # what ended attempt 0, if not the kill
    assert len(result.attempts) == 2, why
    results = result.values["result"]
    assert [r["resumed_from"] for r in results] == [4] * nproc, why  # the checkpoint of step 4, not 8 (never reached)
    assert [r["bitwise_equal"] for r in results] == [True] * nproc
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [(e["attempt"], e["step"]) for e in log] == [(0, s) for s in range(6)] + [(1, s) for s in range(4, 12)]
    # steps 4 and 5 ran twice, from the same state: the same loss bit for bit
    assert [e["loss"] for e in log[4:6]] == [e["loss"] for e in log[6:8]]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step_12", "step_4", "step_8"]


SOLUTIONS = rank_programs.solutions()


# ---- exercise 2: verify a checkpoint together, each rank its share ---------------------------------------------
# Wrong answers, each a shortcut or a slip (they run on the ranks, in this module run afresh there).


def _share_is_intact(directory, names):
    """Size and SHA-256 of each listed file in `names` (a helper of the wrong answers below)."""
    import hashlib
    import json
    from pathlib import Path

    directory = Path(directory)
    try:
        files = json.loads((directory / "metadata.json").read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    for name in names(sorted(files)):
        path = directory / name
        if name not in files or not path.is_file() or path.stat().st_size != files[name]["bytes"]:
            return False
        if hashlib.sha256(path.read_bytes()).hexdigest() != files[name]["sha256"]:
            return False
    return True


def verify_with_the_library(directory):  # the shortcut: correct, but every rank reads the whole checkpoint
    from course_lib import checkpoint

    try:
        checkpoint.verify(directory)
        return True
    except checkpoint.CheckpointError:
        return False


def every_rank_hashes_everything(directory):  # agrees, but reads N times what it needs
    import torch.distributed as dist

    ok = not str(directory).endswith(".tmp") and _share_is_intact(directory, lambda names: names)
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, ok)
    return all(verdicts)


def rank0_hashes_everything(directory):  # one reader: rank 0 reads the whole checkpoint, the others wait
    import torch.distributed as dist

    ok = [None]
    if dist.get_rank() == 0:
        ok = [not str(directory).endswith(".tmp") and _share_is_intact(directory, lambda names: names)]
    dist.broadcast_object_list(ok)
    return ok[0]


def own_shard_only(directory):  # each rank checks shard_<rank>.bin: saved by more ranks, files go unchecked
    import torch.distributed as dist

    rank = dist.get_rank()
    ok = not str(directory).endswith(".tmp") and _share_is_intact(directory, lambda names: [f"shard_{rank}.bin"])
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, ok)
    return all(verdicts)


def sizes_only(directory):  # no file opened: a byte changed in place keeps the size
    import json
    from pathlib import Path

    import torch.distributed as dist

    directory = Path(directory)
    try:
        files = json.loads((directory / "metadata.json").read_text())["files"]
    except OSError:
        files = None
    ok = files is not None and not directory.name.endswith(".tmp")
    ok = ok and all(
        (directory / n).is_file() and (directory / n).stat().st_size == f["bytes"] for n, f in files.items()
    )
    verdicts = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, ok)
    return all(verdicts)


def no_agreement(directory):  # its share, right, but alone: the ranks answer differently
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    return not str(directory).endswith(".tmp") and _share_is_intact(directory, lambda names: names[rank::world_size])


def ignores_the_tmp_name(directory):  # every file intact, but the save was never committed
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    ok = _share_is_intact(directory, lambda names: names[rank::world_size])
    verdicts = [None] * world_size
    dist.all_gather_object(verdicts, ok)
    return all(verdicts)


def verify_together_stub(directory):
    raise NotImplementedError  # your code here


VERIFY_TOGETHER_WRONG = {
    verify_with_the_library: "your function calls checkpoint.verify (recorded), which opens and hashes every file",
    every_rank_hashes_everything: re.compile(r"complete checkpoint' \(step_\d+\): rank 0 opened (\d+) of the \1 files"),
    rank0_hashes_everything: re.compile(r"rank 0 opened (\d+) of the \1 files \([\d,]+ of [\d,]+ B\): each rank"),
    own_shard_only: re.compile(r"no rank opened (shard_\d+\.bin, )*objects\.pt.*: damage there would go unnoticed"),
    sizes_only: "no rank opened any of the",
    no_agreement: re.compile(r"has one byte changed .*: rank \d returned True \(it made no collective call\), rank \d"),
    ignores_the_tmp_name: re.compile(
        r"step_\d+\.tmp: an uncommitted save .*every rank returned True, but the checkpoint"
    ),
}


@pytest.mark.parametrize("nproc", world_sizes(2, 3))
def test_verify_together_checker_rejects_each_shortcut(nproc):
    assert_checker(ck.check_verify_together, rank_programs.verify_together, VERIFY_TOGETHER_WRONG, nproc=nproc)


def test_verify_together_check_on_ranks(capsys):
    assert check(verify_together_stub, ck.check_verify_together, nproc=2, backend="gloo") is None
    assert "verify_together_stub: not attempted yet" in capsys.readouterr().out
    assert check(SOLUTIONS["verify_together"], ck.check_verify_together, nproc=2, backend="gloo") is True
    assert check(verify_with_the_library, ck.check_verify_together, nproc=2, backend="gloo") is False
    out = capsys.readouterr().out
    assert "✓ verify_together: correct on 2 ranks" in out
    assert re.search(
        r"✗ verify_with_the_library: rank 0: case 'a complete checkpoint' \(step_\d+\): your function", out
    )


# ---- exercise 3: the newest complete checkpoint -----------------------------------------------------------------


def newest_by_name(root):  # the broken program of the exercise
    from pathlib import Path

    newest = sorted(Path(root).glob("step_*"))[-1:]
    return int(newest[0].name.removeprefix("step_")) if newest else None


def newest_with_the_library(root):  # the shortcut: the library's own answer
    from course_lib import checkpoint

    found, _ = checkpoint.latest_complete(root)
    return None if found is None else int(found.name.removeprefix("step_"))


def newest_by_number_with_tmp(root):  # numbers, but a .tmp save counts
    import re
    from pathlib import Path

    steps = [int(m.group(1)) for p in Path(root).iterdir() if (m := re.match(r"step_(\d+)", p.name))]
    return max(steps, default=None)


def newest_committed_unverified(root):  # numbers and commits, but a truncated file goes unnoticed
    import re
    from pathlib import Path

    steps = [int(m.group(1)) for p in Path(root).iterdir() if (m := re.fullmatch(r"step_(\d+)", p.name))]
    return max(steps, default=None)


def newest_complete_step_stub(root):
    raise NotImplementedError  # your code here


NEWEST_COMPLETE_WRONG = {
    newest_by_name: re.compile(r"case 'steps \[\d, \d, \d+, \d+\]: step_\d sorts last by name': returned \d,"),
    newest_with_the_library: "your function calls checkpoint.latest_complete, the library's answer",
    newest_by_number_with_tmp: re.compile(r"case 'step_(\d+)\.tmp never renamed': returned \1, the newest complete"),
    newest_committed_unverified: re.compile(r"case 'step_(\d+)/shard_1\.bin truncated': returned \1"),
}


def test_newest_complete_step_checker_rejects_each_shortcut():
    assert_checker(
        ck.check_newest_complete_step,
        rank_programs.newest_complete_step,
        NEWEST_COMPLETE_WRONG,
        nproc=2,
        stub=newest_complete_step_stub,
    )


@pytest.mark.parametrize("saved, loading", [(2, 3), (3, 2), (4, 2)])
def test_prediction_of_bytes_read_per_loading_rank(saved, loading, capsys):
    """Exercise 1: S/M passes at every NOTEBOOK layout; S/N (the saving world), 4P/M and S fail."""
    from course_lib.exercises import check_prediction

    parameters = sum(p.numel() for p in MLP().parameters())
    spans = [ck.shard_rows(p.shape[0], loading, 0) for p in MLP().parameters()]
    measured = 3 * sum((stop - start) * p[0].numel() * 4 for (start, stop), p in zip(spans, MLP().parameters()))
    notebook = {"parameters": parameters, "LOAD_NPROC": loading}  # the names above the prompt
    predicted = runpy.run_path(str(rank_programs.SOLUTIONS), init_globals=notebook)["predicted_row_bytes"]
    assert check_prediction("rows", predicted, measured, rtol=0.05) is True
    for wrong in (12 * parameters / saved, 4 * parameters / loading, 12 * parameters):
        assert check_prediction("rows", wrong, measured, rtol=0.05) is False, wrong
    assert "too" in capsys.readouterr().out


def _fake_gpu_rank(monkeypatch) -> dict:
    """AppState on a GPU rank, faked: rank_device is cuda, and the CUDA generator's state is 16 bytes in a dict."""
    from course_lib.checkpoint import dcp as dcp_module

    generator = {"state": torch.arange(16, dtype=torch.uint8), "restored": 0}

    def set_state(state, device):
        generator.update(state=state.clone(), restored=generator["restored"] + 1)

    monkeypatch.setattr(dcp_module, "rank_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: generator["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    return generator


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_app_state_keeps_a_gpu_ranks_generator_and_loads_across_devices(tmp_path, monkeypatch):
    """A GPU rank saves its CUDA generator too ("cuda_rng", a Python value); a CPU rank's checkpoint has none
    (its files are as before), and each kind loads into the other, in both formats."""
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters())
    assert sorted(ck.AppState(model, optimizer).state_dict()) == ["model", "optimizer", "rng", "step"]
    ck.dcp_save(tmp_path / "cpu_dcp", 1, ck.AppState(model, optimizer, step=1))
    ck.save_sharded(tmp_path / "cpu_mine", 1, {"app": ck.AppState(model, optimizer, step=1)})

    generator = _fake_gpu_rank(monkeypatch)
    gpu = ck.AppState(model, optimizer, step=2)
    assert gpu.state_dict()["cuda_rng"] == list(range(16))
    ck.dcp_save(tmp_path / "gpu_dcp", 2, gpu)
    ck.save_sharded(tmp_path / "gpu_mine", 2, {"app": gpu})
    generator["state"] = torch.zeros(16, dtype=torch.uint8)  # the generator moves on
    for load in (
        lambda app: ck.dcp_load(tmp_path / "gpu_dcp" / "step_2", app),
        lambda app: ck.load_sharded(tmp_path / "gpu_mine" / "step_2", {"app": app}),
    ):
        app = ck.AppState(model, optimizer)
        load(app)
        assert app.step == 2 and generator["state"].tolist() == list(range(16))  # restored
        generator["state"] = torch.zeros(16, dtype=torch.uint8)
    restored = generator["restored"]
    for load in (  # a CPU rank's checkpoint on a GPU rank: nothing to restore, no error
        lambda app: ck.dcp_load(tmp_path / "cpu_dcp" / "step_1", app),
        lambda app: ck.load_sharded(tmp_path / "cpu_mine" / "step_1", {"app": app}),
    ):
        app = ck.AppState(model, optimizer)
        load(app)
        assert app.step == 1 and generator["restored"] == restored
        assert "cuda_rng" in app.state_dict()  # the next save has it again

    monkeypatch.undo()  # a CPU rank loads the GPU rank's checkpoints and ignores the generator
    for directory in ("gpu_dcp", "gpu_mine"):
        app = ck.AppState(model, optimizer)
        if directory == "gpu_dcp":
            ck.dcp_load(tmp_path / directory / "step_2", app)
        else:
            ck.load_sharded(tmp_path / directory / "step_2", {"app": app})
        assert app.step == 2


# ---- out to Hugging Face safetensors and back (notebook 06, section 5)


def hf_round_trip(rank, world_size, root, seed):  # sent to the ranks by run_source: imports inside
    import warnings

    from course_lib import checkpoint as ck
    from course_lib.models import MLP

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = ck.sharded_mlp(seed=seed)
        written = ck.save_safetensors(f"{root}/hf", model)
        again = ck.sharded_mlp(seed=seed + 1)  # other weights, the same layout
        ck.load_safetensors(f"{root}/hf", again)
        gathered = ck.gathered_weights(again)
    differing = ck.differing(gathered, MLP(seed=seed).state_dict()) if rank == 0 else None
    return {"written": str(written), "differing": differing, "warnings": [str(w.message) for w in caught]}


def hf_start_elsewhere(rank, world_size, root, seed):
    import warnings

    import torch

    from course_lib import checkpoint as ck
    from course_lib import compare
    from course_lib.models import MLP

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        weights = MLP(seed=seed).state_dict() if rank == 0 else {}
        loaded = ck.sharded_mlp(seed=seed + 1)
        ck.load_safetensors(f"{root}/hf", loaded)
        models = {"loaded": loaded, "seed": ck.from_seed_checkpoint(f"{root}/hf"), "broadcast": ck.from_rank0(weights)}
        gathered = {name: ck.gathered_weights(model) for name, model in models.items()}
    return {
        "differing": {name: ck.differing(g, weights) for name, g in gathered.items()} if rank == 0 else None,
        "shards": {name: compare.bytes_per_rank(model.state_dict().values()) for name, model in models.items()},
        "whole model": compare.bytes_per_rank(weights.values()),
        "untouched": all(type(t) is torch.Tensor for t in weights.values()),  # from_rank0 copied rank 0's dict
        "warnings": [str(w.message) for w in caught],
    }


def test_safetensors_round_trip_and_into_another_world_size(tmp_path):
    from safetensors.torch import load_file

    saved = run_source(hf_round_trip, 2, root=str(tmp_path), seed=3)
    assert [r["warnings"] for r in saved] == [[], []]
    assert saved[0]["differing"] == []  # saved on 2 ranks, loaded back on 2: exact
    consolidated = tmp_path / "hf" / ck.CONSOLIDATED
    assert saved[0]["written"] == saved[1]["written"] == str(consolidated)
    # one file any program reads: 8 bytes of header length, the JSON header, the weights' raw bytes
    full = MLP(seed=3).state_dict()
    tensors = load_file(consolidated)
    assert sorted(tensors) == sorted(full) and all(torch.equal(tensors[k], v) for k, v in full.items())
    header = int.from_bytes(consolidated.read_bytes()[:8], "little")
    assert consolidated.stat().st_size == 8 + header + sum(t.numel() * 4 for t in full.values())
    assert [n for n, _ in ck.files_of(tmp_path / "hf")] == [
        ck.CONSOLIDATED,
        "model.safetensors.index.json",
        "sharded/shard-00001-model-00001-of-00001.safetensors",
        "sharded/shard-00002-model-00001-of-00001.safetensors",
    ]

    started = run_source(hf_start_elsewhere, 3, root=str(tmp_path), seed=3)
    assert [r["warnings"] for r in started] == [[], [], []]
    assert started[0]["differing"] == {"loaded": [], "seed": [], "broadcast": []}  # 2 -> 3 ranks: exact
    assert all(r["untouched"] for r in started)
    whole = 4 * sum(t.numel() for t in full.values())
    assert [r["whole model"] for r in started] == [whole, 0, 0]  # broadcast: rank 0 holds everything
    for name in ("loaded", "seed", "broadcast"):  # and each rank ends with its torch.chunk rows of every weight
        expected = [
            sum(
                (stop - start) * ck.row_bytes(t.shape, t.dtype)
                for t in full.values()
                for start, stop in [ck.shard_rows(len(t), 3, r)]
            )
            for r in range(3)
        ]
        assert [r["shards"][name] for r in started] == expected, name
    assert sum(expected) == whole


def test_async_saves_reuse_one_writer(tmp_path):
    """The staging cache (pinned memory on GPUs) lives on the writer: one writer serves every save, each save names
    its directory with checkpoint_id, and both saves commit."""
    results = run(rank_programs.two_async_saves, 2, kwargs={"root": str(tmp_path / "async")})
    assert [r["writers"] for r in results] == [1, 1], results
    assert [r["committed"] for r in results] == [["step_1", "step_2"]] * 2
    assert [r["step"] for r in results] == [2, 2]
