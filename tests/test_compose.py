"""Notebook 13's library: the rank grid, the planner's formulas, the exercise checker on real ranks."""

from __future__ import annotations

import math
import re
import runpy
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from course_lib import compose
from course_lib.compare import max_difference
from course_lib.compose import planner, runs
from course_lib.exercises import check_prediction
from course_lib.launch import runtime
from tests.rank_programs import assert_checker

SOLUTIONS = runpy.run_path(str(Path(__file__).parents[1] / "notebooks/solutions/13_composing_parallelism.py"))


def test_rank_grid_is_the_meshs_layout_and_keeps_tp_innermost():
    grid = compose.rank_grid(8, pp=2, dp=2, tp=2)
    assert grid["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for world, shape in ((12, (3, 2, 2)), (8, (1, 4, 2)), (6, (2, 3, 1))):
        grid = compose.rank_grid(world, *shape)
        for name, groups in grid.items():
            assert sorted(r for g in groups for r in g) == list(range(world))  # a partition of the world
            for g in groups:  # members differ only in their own coordinate (the solution's arithmetic)
                coords = [SOLUTIONS["my_coordinates"](r, *shape) for r in g]
                others = [i for i, dim in enumerate(compose.DIMS) if dim != name]
                assert len({tuple(c[i] for i in others) for c in coords}) == 1


def test_rank_grid_refuses_a_shape_that_is_not_the_world():
    with pytest.raises(ValueError, match="pp x dp x tp = 2 x 2 x 2 = 8, but the world has 6 ranks"):
        compose.rank_grid(6, 2, 2, 2)


def test_model_shapes_reproduce_published_sizes_and_flops():
    """Megatron's Table 1 sizes (174.6B, 1008B), Llama 3.1 8B's 8.03B, torchtitan's FLOPs per token (5.79e10 at
    s = 8192) and Megatron's formula for a GPT: 72·L·h² + 12·L·h·s + 6·V·h per token."""
    assert planner.parameters(planner.GPT3_175B) == pytest.approx(174.6e9, rel=1e-3)
    assert planner.parameters(planner.MEGATRON_1T) == pytest.approx(1008.0e9, rel=1e-3)
    assert planner.parameters(planner.LLAMA31_8B) == pytest.approx(8.03e9, rel=1e-3)
    assert planner.parameters(planner.LLAMA_70B) == pytest.approx(70.55e9, rel=1e-3)
    assert planner.flops_per_token(planner.LLAMA31_8B) == pytest.approx(5.79e10, rel=1e-3)
    g = planner.GPT3_175B
    megatron = 72 * g.n_layers * g.d_model**2 + 12 * g.n_layers * g.d_model * g.seq + 6 * g.vocab * g.d_model
    assert planner.flops_per_token(g) == pytest.approx(megatron, rel=1e-4)  # the norms' weights only
    # torchtitan's MFU from its tokens/s: 5,762 x 5.79e10 / 989e12
    titan = next(r for r in runs.PUBLISHED if "torchtitan" in r.name)
    assert titan.published_mfu == pytest.approx(0.337, abs=5e-4)


def test_activations_generalize_korthikanti_to_gqa_and_swiglu():
    """A GPT layer gives Korthikanti's 34·s·b·h (10 + 24/t); Llama's layer: fewer K/V heads save, SwiGLU's three
    hidden tensors of d_ff cost 6·d_ff/h, and no dropout masks."""
    gpt = planner.GPT3_175B
    sbh = gpt.seq * gpt.d_model
    assert planner.activation_bytes_per_layer(gpt, 1, sequence_parallel=False) == pytest.approx(34 * sbh)
    assert planner.activation_bytes_per_layer(gpt, 8, sequence_parallel=False) == pytest.approx((10 + 24 / 8) * sbh)
    llama = planner.LLAMA_70B
    sbh = llama.seq * llama.d_model
    split = 4 + 4 * 8 / 64 + 6 * 28672 / 8192
    assert planner.activation_bytes_per_layer(llama, 8, sequence_parallel=False) == pytest.approx((8 + split / 8) * sbh)


def test_full_recomputation_reruns_the_forward_flops_and_its_tp_all_reduces():
    m = planner.GPT3_175B
    plain = compose.plan(m, 8, 8, 16, planner.A100_NODES, global_batch=1536)
    rerun = compose.plan(m, 8, 8, 16, planner.A100_NODES, global_batch=1536, recompute="full")
    assert rerun["compute_s"] == pytest.approx(plain["compute_s"] * 4 / 3)
    assert rerun["tp_comm_GB"] == pytest.approx(plain["tp_comm_GB"] * 1.5)  # the forward's 2 of 4 all-reduces again
    assert rerun["dp_comm_GB"] == pytest.approx(plain["dp_comm_GB"])


def test_step_model_is_an_upper_bound_on_the_published_runs():
    """The model spends time on matmuls, the bubble and communication only: it predicts at least the published MFU,
    and the table names each run's parts."""
    for run in runs.PUBLISHED:
        p = runs.predicted_step(run)
        parts = ("compute_s", "bubble_s", "tp_s", "pp_s", "dp_exposed_s")
        assert p["step_s"] == pytest.approx(sum(p[k] for k in parts))
        assert run.published_mfu < p["mfu"] <= run.cluster.matmul_efficiency, run.name
    assert runs.published_table().count("\n") == len(runs.PUBLISHED)


LLAMA_4K = replace(compose.LLAMA_70B, seq=4096)  # notebook 13's worked example


def test_planner_reproduces_zero3_states_and_the_layout_trade_offs():
    llama, h, vocab = LLAMA_4K, 8192, 128256
    total = planner.parameters(llama)
    layer = (total - 2 * vocab * h - h) / 80
    flat_params = (total - h) / 4 + h  # tp=4: all but the final norm split, every layer, the table and the head
    for dp, tp, pp, params in ((16, 4, 1, flat_params), (8, 4, 2, (40 * layer + vocab * h) / 4), (64, 1, 1, total)):
        r = compose.plan(llama, dp, tp, pp)  # pp=2: the first stage (the table, two micro-batches in flight)
        assert r["params_GB"] + r["grads_GB"] + r["optimizer_GB"] == pytest.approx(16 * params / dp / 1e9)
    flat, piped = compose.plan(llama, 16, 4, 1), compose.plan(llama, 8, 4, 2)
    assert flat["microbatches"] == 64 and piped["microbatches"] == 128 and piped["bubble"] > flat["bubble"] == 0
    # ZeRO-3 gathers twice (bf16, 2 B) and reduce-scatters once (fp32 gradients, 4 B) per micro-batch
    assert flat["dp_comm_GB"] == pytest.approx(64 * (2 * 2 + 4) * 15 / 16 * flat_params / 1e9)
    # pp > 1: pipelining keeps the stage gathered after a micro-batch's backward and syncs once (stage.py)
    stage = (40 * layer + vocab * h) / 4
    assert piped["dp_comm_GB"] == pytest.approx(((128 + 1) * 2 + 4) * 7 / 8 * stage / 1e9)
    titan = compose.plan(llama, 8, 4, 2, reshard_after_forward=False)  # one gather, one reduce-scatter a step
    assert titan["dp_comm_GB"] == pytest.approx((2 + 4) * 7 / 8 * stage / 1e9)
    assert titan["memory_GB"] == pytest.approx(piped["memory_GB"])  # gathered from the first backward anyway
    kept = compose.plan(
        llama, 16, 4, 1, reshard_after_forward=False, reshard_after_backward=False, defer_grad_sync=True
    )
    assert kept["dp_comm_GB"] == pytest.approx((2 + 4) * 15 / 16 * flat_params / 1e9) and kept["memory_GB"] > 80
    assert compose.step_time(flat) > flat["compute_s"] + flat["tp_s"]  # the DP traffic outlasts the compute
    sbh = 4096 * 8192
    # Korthikanti et al. as torch runs it, for Llama's layer (8 of 64 K/V heads, SwiGLU of 28672, no dropout):
    # torch's SP keeps the gathered inputs of q, k, v and up (4 sbh) whole, the rest over tp
    split = 4 + 4 * 8 / 64 + 6 * 28672 / 8192
    assert compose.activation_bytes_per_layer(llama, 4) == pytest.approx(sbh * (4 + (4 + split) / 4))
    assert flat["activations_GB"] == pytest.approx(80 * sbh * (4 + (4 + split) / 4) / 1e9)
    eager = compose.activation_bytes_per_layer(llama, 4, sequence_parallel=False, attention="eager")
    assert eager == pytest.approx(sbh * (8 + split / 4 + 5 * 64 * 4096 / (8192 * 4)))
    selective = compose.activation_bytes_per_layer(llama, 4, False, recompute="selective", attention="eager")
    assert selective == pytest.approx(sbh * (8 + split / 4))
    assert compose.activation_bytes_per_layer(llama, 4, recompute="full") == pytest.approx(2 * sbh / 4)
    with pytest.raises(ValueError, match="keep tensor parallelism inside a node"):
        compose.plan(llama, 4, 16, 1)


def test_memory_of_megatrons_gpt3_175b_run_by_hand():
    """Narayanan et al.'s 175B run (tp 8, pp 16, dp 8, micro-batch 1, s = 2048, full recomputation, no sequence
    parallelism, gradients all-reduced): the first stage holds 6 layers and the embedding table over tp, 16 micro-
    batches in flight keep 96 layer inputs, and the backward rebuilds one layer's activations on top of them."""
    m = planner.GPT3_175B
    h, s, vocab = 12288, 2048, 51200
    params = (6 * (12 * h * h + 2 * h) + vocab * h) / 8
    inputs = 96 * 2 * s * h
    one_layer = s * h * (10 + 24 / 8)  # Korthikanti's Table 2, tensor parallel, SDPA's kernels keep no scores
    r = compose.plan(
        m, 8, 8, 16, planner.A100_NODES, global_batch=1536, zero_stage=0, sequence_parallel=False, recompute="full"
    )
    assert r["memory_GB"] == pytest.approx((16 * params + inputs + one_layer) / 1e9)
    assert r["output_GB"] == 0  # the logits live on the last stage, which keeps one micro-batch's 6 inputs
    # one stage (pp = 1): the head's input (the final norm's and the head's, 2 s h each) and fp32 logits over tp
    whole = compose.plan(m, 8, 8, 1, planner.A100_NODES, sequence_parallel=False, recompute="full", zero_stage=0)
    assert whole["output_GB"] == pytest.approx(s * (2 * h + 2 * h + 4 * vocab / 8) / 1e9)
    assert whole["activations_GB"] == pytest.approx((96 * 2 * s * h + one_layer) / 1e9)


def test_context_parallel_splits_the_sequence_and_sends_the_rings_kv():
    """cp=2 in place of half the dp ranks (64 H100, Llama 3 70B at 8192 tokens): each rank computes on half of
    every sequence, FSDP shards over dp x cp as before, and every layer sends K/V around the ring (the notebook 09
    model, in bf16) and dK/dV back (fp32, torch's ring)."""
    from course_lib.context_parallel.layout import ring_bytes

    m = compose.LLAMA_70B
    plain, split = compose.plan(m, 8, 8, 1), compose.plan(m, 4, 8, 1, cp=2)
    assert split["gpus"] == plain["gpus"] == 64 and split["microbatches"] == 2 * plain["microbatches"]
    assert split["activations_GB"] == pytest.approx(plain["activations_GB"] / 2)
    assert split["params_GB"] + split["optimizer_GB"] == pytest.approx(plain["params_GB"] + plain["optimizer_GB"])
    assert split["tp_comm_GB"] == pytest.approx(plain["tp_comm_GB"])  # twice the micro-batches, half the tokens
    assert plain["cp_comm_GB"] == 0
    heads_per_tp_rank, head_dim = 8 // 8, 8192 // 64  # tp splits the 8 K/V heads
    bf16 = ring_bytes("contiguous", 8192, 2, 0, 1, heads_per_tp_rank, head_dim, 2)
    fp32 = ring_bytes("contiguous", 8192, 2, 0, 1, heads_per_tp_rank, head_dim, 4)
    per_layer = bf16["forward K/V"] + bf16["backward K/V"] + fp32["backward dK/dV"]
    assert split["cp_comm_GB"] == pytest.approx(80 * 256 * per_layer / 1e9)
    rerun = compose.plan(m, 4, 8, 1, cp=2, recompute="full")  # the recomputed forward sends K/V once more
    assert rerun["cp_comm_GB"] == pytest.approx(80 * 256 * (per_layer + bf16["forward K/V"]) / 1e9)
    assert compose.step_time(split) > compose.step_time({**split, "cp_s": 0.0})  # exposed, as TP's
    with pytest.raises(ValueError, match="SDPA"):
        compose.plan(m, 4, 8, 1, cp=2, attention="eager")
    rows = compose.plan_options(m, 64, cps=(1, 2, 4))
    assert {r["cp"] for r in rows} == {1, 2, 4} and all(r["dp"] * r["tp"] * r["pp"] * r["cp"] == 64 for r in rows)


def test_interleaving_shortens_the_bubble_and_keeps_more_activations():
    """v virtual stages per GPU: bubble (p-1)/(v m + p - 1); the first GPU keeps p (1 + (p-1)/(p v)) micro-batches
    of L/p layers (Korthikanti et al.), which is what the interleaved schedule's rank 0 holds at its peak."""
    from course_lib.pipeline.schedules import interleaved_actions, schedule_actions

    def peak_chunks(actions):  # chunks whose forward ran and backward has not, at the worst moment
        held = peak = 0
        for a in actions:
            held += 1 if a.kind == "F" else -1
            peak = max(peak, held)
        return peak

    for p, v in ((4, 2), (4, 4), (8, 2)):
        assert peak_chunks(interleaved_actions(0, p, v, 2 * p)) / v == planner.in_flight(p, v)
    assert peak_chunks(schedule_actions("1F1B", 4, 8)[0]) == planner.in_flight(4) == 4
    m = LLAMA_4K
    plain, interleaved = compose.plan(m, 4, 4, 4), compose.plan(m, 4, 4, 4, virtual_stages=2)
    assert plain["bubble"] == pytest.approx(3 / (256 + 3)) and interleaved["bubble"] == pytest.approx(3 / (512 + 3))
    assert interleaved["activations_GB"] == pytest.approx(plain["activations_GB"] * (1 + 3 / 8))
    assert interleaved["pp_comm_GB"] == pytest.approx(plain["pp_comm_GB"] * 7 / 3)  # 7 stage boundaries, not 3
    with pytest.raises(ValueError, match="pp=16 x v=2"):
        compose.plan(m, 1, 4, 16, virtual_stages=2)
    rows = compose.plan_options(m, 64, virtual=(1, 2))
    assert {(r["pp"], r["v"]) for r in rows if r["v"] == 2} == {(2, 2), (4, 2), (8, 2)}


def test_fsdp_collectives_for_each_reshard_and_defer_choice():
    f = compose.fsdp_collectives
    assert f(3) == {"all_gather": 6, "reduce_scatter": 3, "all_reduce": 0}
    assert f(3, defer_grad_sync=True)["reduce_scatter"] == 1
    assert f(3, reshard_after_forward=False)["all_gather"] == 3
    assert f(3, reshard_after_backward=False)["all_gather"] == 4  # what torch.distributed.pipelining does
    assert f(3, reshard_after_forward=False, reshard_after_backward=False)["all_gather"] == 1
    assert f(3, zero_stage=0, defer_grad_sync=True) == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 1}
    assert f(3, zero_stage=2) == {"all_gather": 1, "reduce_scatter": 3, "all_reduce": 0}


def test_traffic_prediction_for_the_notebooks_model_counts_every_collective():
    # 2D, dp=2 x tp=2, 3 micro-batches of 2: per block 6 all-gathers + 3 reduce-scatters of 14280 fp32 values
    # (its 28272 parameters over tp, plus the norms and row-parallel biases that tp replicates), 18 all-reduces
    # of a (2, 6, 48) activation
    got = compose.predicted_bytes_by_dimension(4, dp=2, tp=2, pp=1, n_mb=3, global_batch=12)
    assert got["tp"] == 4 * 18 * (2 * 6 * 48 * 4)
    assert got["dp"] == pytest.approx(4 * 9 * 0.5 * 14280 * 4, rel=0.02)
    error, line = compose.compare_traffic("x", got, {"tp": got["tp"], "dp": got["dp"] * 1.01, "pp": 0.0})
    assert error == pytest.approx(0.01 / 1.01) and "max error 1.0%" in line
    assert compose.compare_traffic("x", {**got, "pp": 5.0}, {**got, "pp": 0.0})[0] == 1.0


def test_prediction_exercise_accepts_the_formula_and_rejects_the_usual_mistakes(capsys):
    measured = (6 + 2) * 0.5 * 14280 * 4  # what the 3D cell counts: 2 blocks, 6 gathers + 2 reductions in all
    assert check_prediction("FSDP bytes", SOLUTIONS["predicted_dp_bytes_3d"], measured, rtol=0.03) is True
    per_call = 0.5 * 28272 * 4
    wrong = {
        "once per step (gather, gather, reduce)": 3 * per_call,
        "2 gathers + 1 reduction per micro-batch": 6 * per_call,
        "every micro-batch reduce-scatters": 5 * per_call,
        "all the stage's parameters, not 1/tp": 4 * 2 * per_call,
        "2 bytes a value (bf16), not the ranks' fp32": 4 * per_call / 2,
    }
    for name, value in wrong.items():
        assert check_prediction("FSDP bytes", value, measured, rtol=0.03) is False, name
    assert "too" in capsys.readouterr().out


def plain_accumulation(model, micro_batches):  # every micro-batch reduce-scatters
    import torch

    for x, y in micro_batches:
        (torch.nn.functional.mse_loss(model(x), y) / len(micro_batches)).backward()


def never_syncs(model, micro_batches):  # the sync never comes back on
    import torch

    model.set_requires_gradient_sync(False)
    for x, y in micro_batches:
        (torch.nn.functional.mse_loss(model(x), y) / len(micro_batches)).backward()


def unscaled(model, micro_batches):  # sums the micro-batches' losses instead of averaging them
    import torch

    for i, (x, y) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        torch.nn.functional.mse_loss(model(x), y).backward()


def one_big_batch(model, micro_batches):  # the micro-batches concatenated: one forward, one backward
    import torch

    x = torch.cat([m[0] for m in micro_batches])
    y = torch.cat([m[1] for m in micro_batches])
    torch.nn.functional.mse_loss(model(x), y).backward()


def test_accumulate_checker_accepts_the_solution_and_rejects_wrong_ones():
    wrong = {
        plain_accumulation: "gradients reduce-scattered 4 times, expected 2",
        never_syncs: "gradients reduce-scattered 0 times, expected 2",
        unscaled: "its norm is 2x the expected",
        one_big_batch: "parameters gathered 4 times, expected 8",
    }
    assert_checker(compose.check_accumulate, SOLUTIONS["accumulate"], wrong, nproc=2)


def split_by_size(x, y, micro_batch_size):  # the notebook's broken version
    return list(zip(x.split(micro_batch_size), y.split(micro_batch_size)))


def one_row_each(x, y, micro_batch_size):  # agreed, but as many micro-batches as rows: wasteful
    import torch
    import torch.distributed as dist

    rows = torch.tensor([len(x)])
    dist.all_reduce(rows, op=dist.ReduceOp.MAX)
    return list(zip(x.tensor_split(int(rows)), y.tensor_split(int(rows))))


def local_count(x, y, micro_batch_size):  # its own count, with tensor_split: still desynced
    n = -(-len(x) // micro_batch_size)
    return list(zip(x.tensor_split(n), y.tensor_split(n)))


def shuffled(x, y, micro_batch_size):  # agreed count, but the rows reversed
    import torch
    import torch.distributed as dist

    rows = torch.tensor([len(x)])
    dist.all_reduce(rows, op=dist.ReduceOp.MAX)
    n = -(-int(rows) // micro_batch_size)
    return list(zip(x.flip(0).tensor_split(n), y.flip(0).tensor_split(n)))


def test_micro_batches_checker_accepts_the_fix_and_catches_the_desync():
    # every rank fails in the same round (the counts are compared on all of them): one launch judges all four
    wrong = {
        split_by_size: "micro-batches, rank",
        local_count: "and FSDP hangs",
        one_row_each: "2 are enough",
        shuffled: "concatenated",
    }
    assert_checker(compose.check_micro_batches, SOLUTIONS["make_micro_batches"], wrong, nproc=3)


def dp_tp_swapped(rank, pp, dp, tp):  # right only where dp and tp are equal
    return rank // (dp * tp), rank % dp, rank // dp % tp


def own_rank_only(rank, pp, dp, tp):  # the shortcut: the calling rank's coordinates, as a mesh would give them
    import torch.distributed as dist

    me = dist.get_rank()
    return me // (dp * tp), me // tp % dp, me % tp


def communicates(rank, pp, dp, tp):  # right, but agrees with the other ranks first
    import torch
    import torch.distributed as dist

    agreed = torch.zeros(1)
    dist.all_reduce(agreed)
    return rank // (dp * tp) + int(agreed), rank // tp % dp, rank % tp


def test_coordinates_checker_accepts_the_solution_and_rejects_wrong_ones():
    wrong = {
        dp_tp_swapped: re.compile(r"my_coordinates\(\d+, pp=\d, dp=\d, tp=\d\)\[\d\]: expected \d, got \d"),
        own_rank_only: "pp=2, dp=3, tp=4)",  # right on the meshes the world holds; the first larger one fails
        communicates: "my_coordinates communicated (all_reduce)",
    }
    assert_checker(compose.check_my_coordinates, SOLUTIONS["my_coordinates"], wrong, nproc=4)
    # 5 ranks (prime): the (1, 2, 2) mesh on the first 4 still tells dp from tp
    assert_checker(compose.check_my_coordinates, SOLUTIONS["my_coordinates"], {dp_tp_swapped: "dp=2, tp=2"}, nproc=5)


def test_shard_loss_makes_uneven_shares_average_to_the_global_mean():
    x, y = compose.make_batch(global_batch=12)
    out = x * 0.5
    for dp in (1, 5, 7, 8):
        shares = [
            compose.shard_loss(o, t, global_batch=12, dp=dp) for o, t in zip(out.tensor_split(dp), y.tensor_split(dp))
        ]
        assert torch.stack(shares).mean().item() == pytest.approx(compose.loss_fn(out, y).item(), rel=1e-6)


def test_planner_sends_dp_traffic_over_the_clusters_inter_node_links():
    llama = compose.LLAMA_70B
    fast, slow = compose.Cluster(inter_node_GBps=400.0), compose.Cluster(inter_node_GBps=25.0)
    inside = {c: compose.plan(llama, 2, 4, 1, c)["dp_s"] for c in (fast, slow)}  # tp x dp = 8: one node
    across = {c: compose.plan(llama, 16, 4, 1, c)["dp_s"] for c in (fast, slow)}  # dp spans nodes
    assert inside[fast] == inside[slow] and across[slow] > across[fast]
    with pytest.raises(ValueError, match=r"tp <= 4\)"):
        compose.plan(llama, 8, 8, 1, compose.Cluster(gpus_per_node=4))
    assert all(r["tp"] <= 4 for r in compose.plan_options(llama, 64, compose.Cluster(gpus_per_node=4)))


def test_unsharded_gradients_name_a_stages_blocks_as_in_the_whole_model():
    x, y = compose.make_batch(global_batch=2)
    _, reference = compose.reference_grads(4, x, y)
    model = compose.make_model(4)
    compose.loss_fn(model(x), y).backward()
    second_stage = compose.stage_blocks(model, 1, pp=2)  # blocks 2 and 3, numbered 0 and 1 in the stage
    got = compose.unsharded_gradients(second_stage, first_block=2)
    assert sorted(got) == sorted(name for name in reference if name.split(".")[0] in ("2", "3"))
    assert max_difference(got, reference) == 0.0


def test_micro_batches_checker_builds_the_rows_on_the_ranks_device(monkeypatch):
    """On a GPU rank the rows live on its GPU (meta stands in for it): the count the ranks agree on is reduced there."""
    from course_lib.compose import checkers
    from tests.device_fakes import META, Reached, on_meta, recorder

    on_meta(monkeypatch, checkers)
    devices: list = []
    with pytest.raises(Reached):
        checkers.check_micro_batches(recorder(devices))
    assert devices == [META, META]


def test_planner_counts_collectives_per_layer_and_none_on_a_dimension_of_one_rank():
    llama = compose.LLAMA_70B
    assert compose.collectives_per_step(llama, 16, 4, 1, n_mb=64) == {
        "dp all_gather": 80 * 128,
        "dp reduce_scatter": 80 * 64,
        "tp all_reduce": 80 * 4 * 64,
    }
    piped = compose.collectives_per_step(llama, 4, 4, 4, n_mb=256)  # pipelining's choices: m + 1 gathers, 1 sync
    assert piped["dp all_gather"] == 20 * 257 and piped["dp reduce_scatter"] == 20
    assert compose.collectives_per_step(llama, 1, 8, 1, n_mb=2) == {"tp all_reduce": 80 * 4 * 2}
    assert compose.collectives_per_step(llama, 8, 1, 1, n_mb=2, zero_stage=0) == {"dp all_reduce": 80 * 2}


def shards_add_up(shards: list[dict[str, compose.Shard]], n_blocks: int) -> bool:
    held: dict[str, int] = {}
    copies: dict[str, int] = {}
    for rank in shards:
        for name, shard in rank.items():
            held[name] = held.get(name, 0) + math.prod(shard.shape)
            copies[name] = shard.copies
    full = {name: p.numel() for name, p in compose.make_model(n_blocks).named_parameters()}
    return held.keys() == full.keys() and all(held[n] == full[n] * copies[n] for n in full)


def test_simulated_ranks_count_the_planners_collectives_and_hold_every_element():
    two_d, three_d = compose.Dims(pp=1, dp=8, tp=2), compose.Dims(pp=2, dp=2, tp=2)
    steps = compose.step_collectives(two_d, n_mb=2, global_batch=48)
    assert [s.calls for s in steps] == [compose.predicted_collectives(4, 8, 2, 1, 2)]
    assert steps[0].calls == {"dp all_gather": 16, "dp reduce_scatter": 8, "tp all_reduce": 48}
    piped = compose.step_collectives(three_d, n_mb=2, global_batch=12)
    assert [s.calls for s in piped] == [compose.predicted_collectives(4, 2, 2, 2, 2)] * 2
    # the bytes notebook 13's 3D cell counts on 8 real ranks (pp sends are not simulated)
    assert piped[0].sent == {"pp": 0.0, "dp": 228480.0, "tp": 82944.0}
    shards = compose.shard_shapes(two_d)
    assert len(shards) == 16 and shards_add_up(shards, 4)
    # 48 rows of q over tp=2 then dp=8: 3 rows each; a LayerNorm (whole under TP) over dp=8 only, twice over
    assert shards[15]["3.attention.q.weight"] == compose.Shard((3, 48), 1)
    assert shards[15]["3.norm1.weight"] == compose.Shard((6,), 2)


def test_fake_rank_refuses_a_process_that_has_a_group_and_tears_its_own_down():
    import torch.distributed as dist

    with runtime.fake_rank(0, 4):
        inside = runtime.fake_rank(1, 4)
        with pytest.raises(RuntimeError, match="already belongs to a process group"):
            inside.__enter__()
    assert not dist.is_initialized()


def test_local_tensor_mode_gives_every_rank_rank_0s_fsdp_shard():
    """Why notebook 13 simulates with the fake backend: FSDP2 picks the shard by its process group's rank, one
    integer in one process, so under LocalTensorMode every simulated rank holds rank 0's (48 rows over 5 ranks:
    10, 10, 10, 10, 8), and a forward fails where FSDP2 frees the gathered parameters by resizing their storage."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    with runtime.fake_rank(0, 5):
        mesh = init_device_mesh("cpu", (5,))
        with LocalTensorMode(5):
            block = compose.apply_fsdp(compose.make_model(1), mesh)[0]
            local = block.norm1.weight.to_local()
            rows = {rank: tuple(t.shape) for rank, t in local._local_tensors.items()}
            with pytest.raises(RuntimeError, match="resize_"):  # freeing the gathered parameters after forward
                block(torch.zeros(1, 6, 48))
    assert rows == dict.fromkeys(range(5), (10,))
    assert [s["0.norm1.weight"].shape for s in compose.shard_shapes(compose.Dims(dp=5), 1)] == [(10,)] * 4 + [(8,)]


def test_rank_grid_figure_puts_each_tp_group_inside_a_node():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compose.draw_rank_grid(pp=2, dp=2, tp=2, gpus_per_node=4)
    ax = plt.gcf().axes[0]
    texts = [t.get_text() for t in ax.texts]
    tp_boxes = [p for p in ax.patches if p.get_facecolor()[:3] == matplotlib.colors.to_rgb("tab:green")]
    plt.close("all")
    assert [t for t in texts if t.startswith("node")] == ["node 0", "node 1"]
    assert "7\n(1,1,1)" in texts and "2\n(0,1,0)" in texts  # rank = (p * dp + d) * tp + t
    assert len(tp_boxes) == 4 and all(box.get_x() + box.get_width() <= 3.6 for box in tp_boxes)  # within a node
