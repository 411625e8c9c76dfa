"""course_lib.fsdp: ZeRO stages 0-3 from scratch against one process and torch's fully_shard, on
real gloo ranks (N = 2, 3, 4; the model's unit sizes do not divide by any of them), the collective
counts and per-rank bytes against the formulas, and the exercise checker.

Each launch costs seconds, so one launch per world size carries every check for that size; the
rank program is tests/rank_programs/fsdp.py.
"""

from __future__ import annotations

import re

import pytest
import torch

from course_lib import fsdp
from course_lib.exercises import check
from tests.rank_programs import fsdp as rank_programs
from tests.rank_programs import run, run_source, world_sizes


@pytest.mark.parametrize("nproc", world_sizes(2, 3, 4))
def test_zero_stages_equal_single_process_and_fully_shard(nproc):
    results = run(rank_programs.equality, nproc, timeout=240)
    problems = [p for per_rank in results for p in per_rank["problems"]]
    assert not problems, "\n".join(problems)
    for rank, result in enumerate(results):
        messages = result["reduce_messages"]
        assert messages["reduce_own_chunk"].startswith(f"gradient of shape {(4 * nproc, 3)} on {nproc} ranks")
        assert messages["reduce_local_only"].startswith("gradient of shape"), messages
        assert messages["reduce_sum_not_mean"].startswith("gradient of shape"), messages
        if rank:  # rank 0's chunk is right on rank 0
            assert messages["reduce_rank0_chunk"].startswith("gradient of shape"), messages
        assert "return this rank's flat 1-D chunk" in messages["reduce_not_flat"], messages
        # right numbers, too many bytes: all-reduce or all-gather everything, or reduce everything to each rank
        for shortcut in ("reduce_all_then_slice", "reduce_gather_then_sum", "reduce_to_each_rank"):
            assert re.fullmatch(
                rf"gradient of shape {re.escape(str((4 * nproc, 3)))}: right numbers, but this rank sent [\d,]+ bytes "
                r"of a [\d,]+-byte gradient where a reduce-scatter sends [\d,]+\. .*ZeRO-2 reduce-scatters.*",
                messages[shortcut],
            ), messages[shortcut]
        assert "dist.reduce of the whole gradient to each rank" in messages["reduce_to_each_rank"]
    per_rank = [r["wrong_failed"] for r in results]
    assert set(per_rank[0]) == {
        "torch.chunk (ceil-sized chunks)",
        "rank 0's chunk everywhere",
        "not flattened",
        "states swapped",
    }
    for what in per_rank[0]:
        if what.startswith("torch.chunk") and nproc == 2:
            continue  # with 2 ranks torch.chunk and tensor_split cut every size alike: a right answer
        # a wrong answer must be caught on some rank ("rank 0's chunk everywhere" is right on rank 0)
        assert any(failed[what] for failed in per_rank), (what, per_rank)


def test_exercise_check_names_the_rank(capsys):
    def shard_with_adam_state(param, exp_avg, exp_avg_sq):
        import torch
        import torch.distributed as dist

        return tuple(torch.tensor_split(t.reshape(-1), dist.get_world_size())[0] for t in (param, exp_avg, exp_avg_sq))

    assert check(shard_with_adam_state, fsdp.check_shard_with_adam_state, nproc=3, backend="gloo") is False
    out = capsys.readouterr().out
    assert "rank 1" in out or "rank 2" in out, out
    assert "param shard" in out, out


def test_stub_is_not_attempted(capsys):
    def shard_with_adam_state(param, exp_avg, exp_avg_sq):
        raise NotImplementedError

    assert check(shard_with_adam_state, fsdp.check_shard_with_adam_state, nproc=2) is None
    assert "not attempted yet" in capsys.readouterr().out


def test_hsdp_prediction_accepts_the_formula_and_rejects_typical_mistakes(capsys):
    import runpy
    from pathlib import Path

    from course_lib.exercises import check_prediction

    P = 658_688  # the notebook's WIDE MLP in bytes (P_WIDE)
    path = Path(__file__).resolve().parents[1] / "notebooks" / "solutions" / "03_fsdp2.py"
    predicted = runpy.run_path(str(path), init_globals={"P_WIDE": P})["predicted_hsdp_bytes"]
    assert check_prediction("HSDP bytes", predicted, 2 * P, rtol=0.05) is True
    # FSDP over all 4 ranks, DDP's all-reduce, forgetting the replicate all-reduce, all-reducing the full model
    for wrong in (3 * 3 / 4 * P, 2 * 3 / 4 * P, 1.5 * P, 2.5 * P, 3 * P):
        assert check_prediction("HSDP bytes", wrong, 2 * P, rtol=0.05) is False, wrong
    capsys.readouterr()


def test_collectives_formula():
    assert fsdp.zero_collectives(3, 5) == {"reduce_scatter": 5, "all_gather": 10}
    assert fsdp.zero_collectives(0, 2) == {"all_reduce": 2}
    assert fsdp.zero_collectives(0, 2, clip=True) == {"all_reduce": 2}  # stage 0 holds the whole gradient
    assert fsdp.zero_collectives(2, 2, clip=True) == {"all_gather": 2, "all_reduce": 1, "reduce_scatter": 2}
    with pytest.raises(ValueError):
        fsdp.ZeroModel(torch.nn.Linear(2, 2), stage=4)  # checked before any sharding (no process group)


def test_shard_layers_then_root_gives_every_unit_a_mesh_on_the_ranks_device(monkeypatch):
    """fully_shard without a mesh would take the machine's accelerator; the course shards on rank_device()."""
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.fsdp as torch_fsdp

    from course_lib import models
    from course_lib.launch import runtime

    meshes: list = []
    monkeypatch.setattr(runtime, "rank_device", lambda: torch.device("cuda", 1))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda kind, shape: ("mesh", kind, shape))
    monkeypatch.setattr(torch_fsdp, "fully_shard", lambda module, **options: meshes.append(options["mesh"]))
    assert models.world_mesh() == ("mesh", "cuda", (4,))
    models.shard_layers_then_root(models.MLP(n_layers=2))
    assert meshes == [("mesh", "cuda", (4,))] * 4  # 3 Linear units and the root, one mesh
    meshes.clear()
    models.shard_layers_then_root(models.MLP(n_layers=2), mesh="given")
    assert meshes == ["given"] * 4


# ------------------------------------------------------------------------------------------------
# torch.compile with FSDP2 (section 8)
# ------------------------------------------------------------------------------------------------


def compile_orders(rank, world_size):
    """Each order with the recording backend (no Inductor: seconds, and the same kernels as eager), 3 steps next to
    the same sharding uncompiled: the graphs' parameter bytes, the graph breaks, the losses of both."""
    import torch
    from torch._dynamo.utils import counters

    from course_lib import ddp, fsdp, models
    from course_lib.gpt.model import GPT, GPTConfig, loss_fn

    config = GPTConfig(vocab=16, d_model=48, n_heads=4, n_layers=3, seq=16)
    gpt = GPT(config)
    parts = {"embeddings": gpt.embed, "block": gpt.blocks[0], "head": gpt.head}
    result = {"part bytes": {name: models.param_bytes(m) for name, m in parts.items()}}
    tokens = torch.randint(config.vocab, (4, config.seq + 1), generator=torch.Generator().manual_seed(rank))
    x, y = tokens[:, :-1], tokens[:, 1:]
    for name, order in fsdp.COMPILE_ORDERS.items():
        graphs: list[int] = []
        breaks = sum(counters["graph_break"].values())
        models_ = {"eager": order(GPT(config), None), "compiled": order(GPT(config), ddp.recording_backend(graphs))}
        losses: dict[str, list[float]] = {kind: [] for kind in models_}
        for kind, model in models_.items():
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
            for _ in range(3):
                loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses[kind].append(loss.item())
        result[name] = {
            "graphs": graphs,
            "breaks": sum(counters["graph_break"].values()) - breaks,
            "losses": losses,
            "sharded": all(type(p).__name__ == "DTensor" for p in models_["compiled"].parameters()),
        }
        torch._dynamo.reset()
    return result


def test_compiled_per_block_reuses_one_graph_and_whole_model_breaks_at_fsdp_hooks():
    for result in run_source(compile_orders, 2):
        part = result["part bytes"]
        assert len(set(part.values())) == 3, part  # each graph is named by its parameter bytes
        per_block, whole = (result[name] for name in fsdp.COMPILE_ORDERS)
        # torchtitan's order: one graph serves the 3 identical blocks, compiled once over 3 steps; no break
        assert per_block["graphs"] == [part["block"]] and per_block["breaks"] == 0, per_block
        # the whole model: Dynamo breaks at the first block's FSDP2 hook; the blocks and the rest get graphs of
        # their own, the block's again shared
        assert whole["graphs"] == [part["embeddings"], part["block"], part["head"]], whole
        assert whole["breaks"] == 1, whole
        for order in (per_block, whole):
            assert order["sharded"], order
            assert order["losses"]["compiled"] == order["losses"]["eager"], order  # the same kernels, no Inductor
            assert order["losses"]["compiled"][0] > order["losses"]["compiled"][-1], order  # it trains
