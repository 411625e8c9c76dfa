"""Notebook 15's library: the text snapshot, the loader, the GPT and its stages, the calculators, the data-parallel
layouts on 3 real gloo ranks against one process, and the exercises' checkers."""

from __future__ import annotations

import re
import runpy
import subprocess
from pathlib import Path

import pytest
import torch

from course_lib import gpt
from course_lib.exercises import check, check_prediction
from course_lib.launch import launch
from tests.rank_programs import assert_checker
from tools.course_text import REPO, SNAPSHOT_REV, course_prose

SOLUTIONS = runpy.run_path(str(Path(__file__).parents[1] / "notebooks/solutions/15_capstone_gpt.py"))
CONFIG = gpt.default_config()


def quiet(text, stream):
    """A launcher `write` that drops rank output."""


def has_revision(rev: str) -> bool:
    done = subprocess.run(["git", "cat-file", "-e", f"{rev}^{{commit}}"], cwd=REPO, capture_output=True)
    return done.returncode == 0


# ---- the data ------------------------------------------------------------------------------------------------


def test_snapshot_is_small_committed_and_reproducible():
    text = gpt.course_text()
    assert 100e3 < len(text.encode()) < 300e3
    assert "# 00 · torchrun and process groups" in text and "```" in text
    if not has_revision(SNAPSHOT_REV):
        pytest.skip(f"the history does not hold {SNAPSHOT_REV} (a shallow clone)")
    assert course_prose() == text  # the script reproduces the committed file byte for byte


def test_tokenizer_split_and_baselines():
    tokens, tokenizer = gpt.tokens_and_tokenizer()
    assert tokenizer.vocab == CONFIG.vocab == len(set(gpt.course_text()))
    assert tokenizer.decode(tokens[:300]) == gpt.course_text()[:300]
    train, val = gpt.split()
    assert torch.equal(torch.cat([train, val]), tokens) and len(val) == pytest.approx(0.1 * len(tokens), abs=1)
    b = gpt.entropy_baselines(train)
    assert b["uniform"] > b["unigram"] > b["bigram"] > 0


@pytest.mark.parametrize("dp", [1, 2, 3, 5])
def test_shards_partition_the_global_batch_whatever_the_ranks(dp):
    train, _ = gpt.split()
    whole_x, whole_y = gpt.ShardedBatches(train, 64, 16)(9)
    parts = [gpt.ShardedBatches(train, 64, 16, r, dp)(9) for r in range(dp)]
    assert torch.equal(torch.cat([x for x, _ in parts]), whole_x) and torch.equal(
        torch.cat([y for _, y in parts]), whole_y
    )
    assert max(len(x) for x, _ in parts) - min(len(x) for x, _ in parts) <= 1
    assert torch.equal(whole_x[:, 1:], whole_y[:, :-1])  # targets: the inputs shifted by one character
    assert not torch.equal(whole_x, gpt.ShardedBatches(train, 64, 16)(10)[0])  # another step, other windows
    with pytest.raises(ValueError, match="leaves some of 20 dp ranks empty"):
        gpt.ShardedBatches(train, 64, 16, 0, 20)


# ---- the model and the calculators --------------------------------------------------------------------------


def test_the_model_its_stages_and_its_flops():
    model = gpt.GPT(CONFIG)
    assert sum(p.numel() for p in model.parameters()) == gpt.count_parameters(CONFIG)["total"]
    assert model.head.output.weight is model.embed.tokens.weight
    x = torch.randint(0, CONFIG.vocab, (3, CONFIG.seq))
    first, last = gpt.pipeline_stage(CONFIG, 0, 2), gpt.pipeline_stage(CONFIG, 1, 2)
    assert torch.equal(last(first(x)), model(x))  # each piece seeded on its own: the stages are the model
    assert torch.equal(last.head.output.weight, first.embed.tokens.weight)  # the last stage's copy of the table
    counted = gpt.counted_flops(model, x, x)
    tokens = x.numel()
    assert counted["matmul"] == 6 * gpt.count_parameters(CONFIG)["matmul"] * tokens
    assert counted["matmul"] + 3 * counted["attention forward"] == gpt.flops_per_token(CONFIG) * tokens


def test_parameter_shapes_add_up_for_every_split():
    total = gpt.count_parameters(CONFIG)["total"]
    assert gpt.parameters_before_dp(gpt.Layout("one process"), CONFIG) == total
    pp = gpt.Layout("3D", dp=2, tp=2, pp=2, n_mb=2)
    stages = [gpt.parameters_before_dp(pp, CONFIG, s) for s in range(2)]
    tp_only = gpt.parameters_before_dp(gpt.Layout("TP", tp=2), CONFIG)
    assert sum(stages) == tp_only + CONFIG.vocab * CONFIG.d_model  # the stages hold two copies of the table
    for dp in (2, 3, 5, 8):
        layout = gpt.Layout("FSDP2", dp=dp)
        shards = [gpt.predicted_shard_bytes(layout, CONFIG, 0, r) for r in range(dp)]
        assert sum(shards) == 16 * total
        assert sum(shards) / dp == pytest.approx(gpt.predicted_memory(layout, CONFIG)["total"])


def test_traffic_predictions_by_hand():
    d, v, blocks = CONFIG.d_model, CONFIG.vocab, gpt.count_parameters(CONFIG)["blocks"]
    ddp = gpt.predicted_traffic(gpt.Layout("DDP", dp=2, ddp=True), CONFIG, 16)
    assert ddp == {"tp": 0.0, "dp": 2 * 0.5 * 4 * gpt.count_parameters(CONFIG)["total"], "pp": 0.0}
    fsdp = gpt.predicted_traffic(gpt.Layout("FSDP2", dp=2), CONFIG, 16)
    root = v * d + CONFIG.seq * d + 2 * d
    assert fsdp["dp"] == pytest.approx(0.5 * 4 * (3 * blocks + 2 * root))  # blocks: 2 gathers + 1 reduction
    two_d = gpt.predicted_traffic(gpt.Layout("2D", dp=2, tp=2), CONFIG, 16)
    assert two_d["tp"] == CONFIG.n_layers * 6 * (2 * 0.5) * (CONFIG.seq * 8 * d * 4)


# ---- every layout against one process, on real ranks ---------------------------------------------------------

LAYOUT_RUN = """
from course_lib import gpt
layout = gpt.Layout(**fields)
summary, _ = gpt.run_layout(layout, steps, device=device, **options)
summary["layout"] = fields
"""


def run_layout(fields: dict, steps: int = 3, **options) -> dict:
    done = launch(
        LAYOUT_RUN,
        gpt.Layout(**fields).world,
        backend="gloo",
        out=["summary"],
        push={"fields": fields, "steps": steps, "options": options},
        timeout=280,
        write=quiet,
    )
    return done.values["summary"][0]


@pytest.fixture(scope="module")
def reference():
    return run_layout({"name": "one process"}, steps=4)["losses"]


# Notebook 15 runs every layout at its NPROC (2): DDP and FSDP2 on 2 ranks, FSDP2 x TP on 2 x 2, PP x FSDP2 x TP on
# 2 x 2 x 2, compiled, and the 2 x 2 checkpoint resumed on 3 ranks, and asserts what these tests assert (its losses
# within the drift of a second one-process run). Here: the data-parallel layouts on 3 ranks (rows 6, 5, 5), within
# 1e-4 of one process over 4 steps; with the other world sizes, in `make test-ranks`.
@pytest.mark.sweep
@pytest.mark.parametrize(
    "fields",
    [
        {"name": "DDP", "dp": 3, "ddp": True},
        {"name": "FSDP2", "dp": 3},
        {"name": "FSDP2, compiled", "dp": 3, "compiled": True},
    ],
    ids=lambda f: f["name"],
)
def test_data_parallel_layouts_on_3_ranks_train_like_one_process_and_cost_what_the_calculators_say(fields, reference):
    summary = run_layout(fields, steps=4)
    layout = gpt.Layout(**fields)
    assert max(abs(a - b) for a, b in zip(summary["losses"], reference)) < 1e-4
    for held, (stage, dp_rank) in zip(summary["held"], summary["coordinates"]):
        assert held["total"] == gpt.predicted_shard_bytes(layout, CONFIG, stage, dp_rank)
    predicted = gpt.predicted_traffic(layout, CONFIG, 16)
    for dim, sent in summary["sent"].items():
        assert sent == pytest.approx(predicted[dim], rel=0.05), dim
    if layout.compiled:
        assert summary["graphs"] == (1, 1)  # both blocks run one graph, compiled in the first step; no recompile


def test_compiling_in_place_keeps_every_parameter_name():
    eager = gpt.parallelize(gpt.Layout("one process"), CONFIG, None, torch.device("cpu"))
    compiled = gpt.parallelize(gpt.compiled_layouts(1)[0], CONFIG, None, torch.device("cpu"))
    assert list(compiled.state_dict()) == list(eager.state_dict())  # a checkpoint does not see the compile
    assert all(block._compiled_call_impl is not None for block in compiled.blocks)
    assert all(block._compiled_call_impl is None for block in eager.blocks)


# ---- the exercises -------------------------------------------------------------------------------------------


def test_prediction_accepts_the_formula_and_rejects_the_usual_mistakes(capsys):
    tokens = 16 * CONFIG.seq
    measured = 6 * gpt.count_parameters(CONFIG)["matmul"] * tokens
    assert check_prediction("flops", SOLUTIONS["predicted_matmul_flops"], measured, rtol=0.01) is True
    counts = gpt.count_parameters(CONFIG)
    wrong = {
        "forward only": 2 * counts["matmul"] * tokens,
        "every parameter": 6 * counts["total"] * tokens,
        "no head": 6 * (counts["matmul"] - CONFIG.vocab * CONFIG.d_model) * tokens,
        "with attention": gpt.flops_per_token(CONFIG) * tokens,
    }
    for name, value in wrong.items():
        assert check_prediction("flops", value, measured, rtol=0.01) is False, name
    assert check_prediction("flops", None, measured) is None


def pp_group(mesh):  # the whole stage group: with 4 stages it holds the middle ones too
    return mesh["pp"].get_group()


def ignores_dp(mesh):  # pairs the stages by tp coordinate only
    import torch.distributed as dist

    pp, dp, tp = mesh.mesh.shape
    p, d, t = mesh.get_coordinate()
    mine = None
    for t_ in range(tp):
        group = dist.new_group([t_, (pp - 1) * dp * tp + t_])
        if t_ == t:
            mine = group
    return mine if p in (0, pp - 1) else None


def every_stage(mesh):  # gives middle stages a group too
    import torch.distributed as dist

    pp, dp, tp = mesh.mesh.shape
    p, d, t = mesh.get_coordinate()
    mine = None
    for d_ in range(dp):
        for t_ in range(tp):
            group = dist.new_group([int(mesh.mesh[0, d_, t_]), int(mesh.mesh[pp - 1, d_, t_])])
            if (d_, t_) == (d, t):
                mine = group
    return mine


def test_embedding_group_checker_accepts_the_solution_and_rejects_wrong_groups(capsys):
    # these fail on every rank of the last mesh or on none, so one launch judges them
    middle = "a middle stage holds no copy of the table, expected None"
    assert_checker(
        gpt.check_embedding_group,
        SOLUTIONS["embedding_group"],
        {pp_group: "the group holds ranks [0, 1, 2, 3], expected the two stages' ranks", every_stage: middle},
        nproc=4,
    )
    # wrong on half the ranks of a mesh, while the others go on to the next: a launch of its own
    assert check(ignores_dp, gpt.check_embedding_group, nproc=4, backend="gloo", timeout=90) is False
    assert "returned a group this rank is not in" in capsys.readouterr().out


def by_global_rank(mesh, tokens, seq, global_batch):  # the notebook's broken loader
    import torch.distributed as dist

    from course_lib.gpt import ShardedBatches

    return ShardedBatches(tokens, seq, global_batch, dist.get_rank(), dist.get_world_size())


def by_tp_rank(mesh, tokens, seq, global_batch):  # the wrong mesh dimension
    from course_lib.gpt import ShardedBatches

    return ShardedBatches(tokens, seq, global_batch, mesh["tp"].get_local_rank(), mesh["tp"].size())


def rank_modulo(mesh, tokens, seq, global_batch):  # rank % dp: right only when tp is 1
    import torch.distributed as dist

    from course_lib.gpt import ShardedBatches

    dp = mesh["dp"].size()
    return ShardedBatches(tokens, seq, global_batch, dist.get_rank() % dp, dp)


def test_rows_on_mesh_checker_accepts_the_fix_and_names_the_wrong_rows():
    # the checker builds every mesh on every rank before it fails, so one launch judges them all
    wrong_rows = re.compile(r"holds rows \[.*\] of the global batch of \d+, expected rows")
    assert_checker(
        gpt.check_rows_on_mesh,
        SOLUTIONS["rows_on_mesh"],
        {by_global_rank: wrong_rows, by_tp_rank: wrong_rows, rank_modulo: wrong_rows},
        nproc=4,
    )


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),  # SXM: bf16 dense, MFU's denominator
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),  # the H100 SXM's compute
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA A10", 125e12),  # not an A100
        ("NVIDIA A10G", None),  # not an A10
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),  # not an L4
        ("NVIDIA L40", None),
        ("Tesla V100-SXM2-32GB", None),  # no bf16 tensor cores
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_flops_tell_the_variants_of_a_gpu_apart(name, peak):
    assert gpt.peak_flops_of(name) == peak
    assert gpt.device_peak_flops("cpu") is None
