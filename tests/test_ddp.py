"""course_lib.ddp: the from-scratch DDP against torch's DDP and single-process training, on real gloo ranks.

Each multi-rank test is one launch (about 3 s of start-up), so many checks share a rank program
(tests/rank_programs/ddp.py).
"""

from __future__ import annotations

import itertools
import os
import re
import tempfile

import pytest
import torch
import torch.distributed as dist

from course_lib import comms, compare, ddp
from course_lib.exercises import check, check_prediction
from course_lib.models import MLP, param_bytes
from tests.rank_programs import ddp as rank_programs
from tests.rank_programs import run, run_source, world_sizes


@pytest.mark.parametrize("nproc", world_sizes(2, 3, 4))
def test_minimal_ddp_equals_torch_ddp_and_single_process(nproc):
    values = run(rank_programs.equality, nproc)
    for rank in range(nproc):
        results = values[rank]["results"]
        assert (25.0, 1) in results and (0.01, 2) in results
        assert results[(25.0, 1)][2] == 1 and results[(0.01, 1)][2] > 1
        for (cap_mb, accumulation), (vs_single, vs_torch, n_buckets) in results.items():
            where = f"rank {rank}, bucket_cap_mb={cap_mb}, accumulation={accumulation}"
            assert vs_single < 1e-6, (where, vs_single)  # 3 SGD steps: only float rounding apart
            assert vs_torch < 1e-6, (where, vs_torch)
            assert n_buckets == len(ddp.assign_buckets(list(MLP().parameters()), int(cap_mb * ddp.MB))), where
        assert values[rank]["timeline_ok"]
        assert values[rank]["in_sync"] == 0.0
        message = values[rank]["out_of_sync"]
        assert message is not None and message.startswith(f"gradients out of sync: rank(s) {list(range(1, nproc))}")
        if rank:
            assert f"here on rank {rank} first in 0.weight" in message
        assert "find_unused_parameters" in values[rank]["unused_error"]


def test_hooks_snapshot_and_exercise_checkers():
    nproc = 3
    snapshot_path = os.path.join(tempfile.mkdtemp(), "snapshot.pt")
    values = run(rank_programs.hooks_snapshot_and_exercises, nproc, kwargs={"snapshot_path": snapshot_path})
    hooks = values[0]["hooks"]
    errors = {name: h[2] for name, h in hooks.items()}
    assert errors["none"] == 0.0 and 1e-5 < errors["fp16"] < 1e-3 < errors["bf16"] < 1e-2 < errors["powersgd"], errors
    for name in ("none", "fp16", "bf16"):
        sent, formula = hooks[name][:2]
        assert abs(sent / formula - 1) < 0.05, (name, sent, formula)  # 2(N-1)/N x payload, + headers
    assert hooks["powersgd"][0] < 0.2 * hooks["none"][0]
    for name in ("fp16", "bf16"):
        assert abs(hooks[name][3] - hooks["none"][3]) < 0.01 * hooks["none"][3], name
    assert [v["snapshot_step"] for v in values] == [7] * nproc
    assert [v["snapshot_gap"] for v in values] == [0.0] * nproc
    assert values[0]["snapshot_keys"] == sorted(MLP().state_dict())  # no "module." prefix
    for rank, verdicts in enumerate(v["verdicts"] for v in values):
        for solution in ("average_gradient", "mean_allreduce_hook", "accumulate_step"):
            assert verdicts[solution] == "passed", (rank, solution, verdicts[solution])
        for wrong in ("sum_without_average", "local_only", "hook_sum_only", "hook_local_only"):
            assert verdicts[wrong].startswith("step 0: gradient of"), (rank, wrong, verdicts[wrong])
        expected = {
            "accumulate_never_syncs": "step 0: no all-reduce ran",
            "accumulate_syncs_every_micro_batch": "step 0: DDP all-reduced 2 times",
            "accumulate_no_sync_around_backward_only": "step 0: DDP all-reduced 2 times",
            "accumulate_sums_losses": "step 0: 0.weight after your step",
            "hook_torchs_allreduce": "this calls a ready-made all-reduce hook",
            "hook_torchs_allreduce_fut": "this calls a ready-made all-reduce hook",
            "accumulate_one_backward_on_the_joined_batch": "step 0: 1 backward pass(es) for 2 micro-batches",
        }
        for wrong, message in expected.items():
            assert verdicts[wrong].startswith(message), (rank, wrong, verdicts[wrong])


def wrong_average_gradient(param):
    dist.all_reduce(param.grad)  # sums, forgets to divide


def test_check_reports_wrong_answer_with_its_rank(capsys):
    assert check(wrong_average_gradient, ddp.check_average_gradient, nproc=2, backend="gloo") is False
    said = capsys.readouterr().out
    # every rank gets it wrong; whichever reported first is named
    assert re.match(r"✗ wrong_average_gradient: rank [01]: step 0: gradient of 0\.weight", said), said


def test_prediction_accepts_the_formula_and_rejects_typical_mistakes(capsys):
    """Exercise 3: bytes per rank per step. The notebook measures the formula + under 1% of headers."""
    import runpy

    big = dict(d_in=256, d_hidden=1024, d_out=256, n_layers=4)  # the notebook's BIG
    big_bytes = 14_697_472
    assert param_bytes(MLP(**big)) == big_bytes
    for n in (2, 3, 4):
        measured = 1.005 * comms.sent_per_rank("all_reduce", big_bytes, n)
        path = os.path.join(os.path.dirname(__file__), "..", "notebooks", "solutions", "02_ddp.py")
        notebook = {"NPEERS": n, "BIG": big, "MLP": MLP, "param_bytes": param_bytes}  # the names above the prompt
        predicted = runpy.run_path(path, init_globals=notebook)["predicted_bytes_per_step"]
        assert check_prediction("bytes", predicted, measured, rtol=0.03) is True
        wrong = [2 * big_bytes, (n - 1) / n * big_bytes, n * big_bytes, 2 * n * big_bytes]  # no /N, half, x N
        if n > 2:
            wrong.append(big_bytes)  # "the model once": right only at N = 2
        for guess in wrong:
            assert check_prediction("bytes", guess, measured, rtol=0.03) is False, (n, guess)
    assert "too high" in capsys.readouterr().out


def test_dividing_first_bounds_the_partial_sums_but_not_an_overflowed_rank_nor_underflow():
    for n in (2, 3, 4, 8):
        big = [torch.tensor([60000.0 - 1000 * r], dtype=torch.float16) for r in range(n)]
        mean, partial = ddp.low_precision_mean(big, divide_first=True)
        assert all(p.abs().max() <= 60000 for p in partial) and mean.isfinite().all()
        assert ddp.low_precision_mean(big, divide_first=False)[0].isinf().all()
        inf = [torch.tensor([float("inf")], dtype=torch.float16), *big[1:]]
        assert ddp.low_precision_mean(inf, divide_first=True)[0].isinf().all()
        tiny = [torch.tensor([6e-8], dtype=torch.float16)] * n
        assert ddp.low_precision_mean(tiny, divide_first=True)[0].item() == 0
        assert ddp.low_precision_mean(tiny, divide_first=False)[0].item() > 0


def test_assign_buckets_matches_torch_reducer():
    for shape in ({}, dict(d_in=256, d_hidden=1024, d_out=256, n_layers=4), dict(n_layers=7)):
        params = list(MLP(**shape).parameters())
        position = {id(p): i for i, p in enumerate(reversed(params))}
        for cap in (1, 4096, 20_000, 2 * ddp.MB, 25 * ddp.MB):
            mine = [[position[id(p)] for p in bucket] for bucket in ddp.assign_buckets(params, cap)]
            theirs, _ = dist._compute_bucket_assignment_by_size(
                list(reversed(params)), [cap], [False] * len(params), list(range(len(params)))
            )
            assert mine == theirs, (shape, cap)


def test_simulated_buckets_and_formulas():
    grads = [100, 300, 200, 400]
    calls = ddp.simulate_buckets(
        grads, [1.0, 2.0, 3.0, 4.0], bucket_cap_mb=350 / ddp.MB, latency_s=0.5, bandwidth_Bps=100.0, world_size=2
    )
    # buckets close at >= 350 bytes: [100, 300] ready at 2, [200, 400] ready at 4; each costs 0.5 + bytes / 100
    assert calls == [(2.0, 6.5), (6.5, 13.0)]
    assert ddp.overlap_fraction(calls, backward_s=4.0) == pytest.approx(2.0 / 11.0)
    assert ddp.ddp_bytes_per_rank(10, bucket_copy=False) == 10 * 4 * 4
    model = MLP()
    n = sum(p.numel() for p in model.parameters())
    assert ddp.payload_bytes(model, "none") == 4 * n and ddp.payload_bytes(model, "fp16") == 2 * n
    assert ddp.payload_bytes(model, "powersgd") < ddp.payload_bytes(model, "fp16") / 4
    order = ddp.shuffled_order(torch.utils.data.TensorDataset(torch.zeros(10)), epoch=3, seed=1)
    sampler = torch.utils.data.DistributedSampler(range(10), num_replicas=2, rank=1, shuffle=True, seed=1)
    sampler.set_epoch(3)
    assert list(sampler) == order[1::2]


# ---- the persistent-rank walk-through (recording hook), unused parameters, uneven inputs --------------------
# Rank programs defined here travel as source (run_source): each imports what it uses (torch and dist are there).


def buckets_step_by_step(rank: int, world_size: int) -> dict:
    """recording_hook: one bucket in the first step, then the rebuilt buckets; gradients as without the hook."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib import ddp
    from course_lib.compare import max_difference
    from course_lib.models import MLP

    x, y = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank)), torch.zeros(8, 8)
    recorded, per_step = {}, []
    hooked = DDP(MLP(seed=rank), bucket_cap_mb=0.01)
    hooked.register_comm_hook(None, ddp.recording_hook(hooked, recorded))
    plain = DDP(MLP(seed=rank), bucket_cap_mb=0.01)
    gaps = []
    for _ in range(3):
        recorded.clear()
        for model in (hooked, plain):
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
        per_step.append([recorded[i] for i in sorted(recorded)])
        gaps.append(max_difference([p.grad for p in hooked.parameters()], [p.grad for p in plain.parameters()]))
    return {"per_step": per_step, "gaps": gaps}


def test_recording_hook_shows_one_bucket_then_the_rebuilt_ones():
    model = MLP()
    names = [name for name, _ in model.named_parameters()]
    by_id = {id(p): name for name, p in model.named_parameters()}
    params = list(model.parameters())
    expected = [sorted(by_id[id(p)] for p in bucket) for bucket in ddp.assign_buckets(params, int(0.01 * ddp.MB))]
    for rank, values in enumerate(run_source(buckets_step_by_step, 3)):
        first, *later = values["per_step"]
        assert first == [names], (rank, first)  # step 0: everything in one bucket, in declaration order
        for buckets in later:
            assert [sorted(b) for b in buckets] == expected, (rank, buckets)
        assert max(values["gaps"]) < 1e-6, (rank, values["gaps"])  # the hook averages as DDP's all-reduce does


def unused_parameters(rank: int, world_size: int) -> dict:
    """The error without find_unused_parameters; the fix with a branch per task; collectives per step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib import comms, ddp
    from course_lib.compare import max_difference

    x, y = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank)), torch.zeros(8, 8)
    loss = torch.nn.functional.mse_loss
    model = DDP(ddp.MLPWithBranches())
    try:
        for _ in range(2):
            loss(model(x), y).backward()
        error = None
    except RuntimeError as raised:
        error = str(raised)
    dist.barrier()  # the error leaves the process group usable

    fixed = DDP(ddp.MLPWithBranches(), find_unused_parameters=True)
    task = rank % 2
    loss(fixed(x, branch=task), y).backward()
    alone = ddp.MLPWithBranches()
    loss(alone(x, branch=task), y).backward()
    branch_gaps = []
    for b, branch in enumerate(fixed.module.branches):
        expected = (alone.branches[b].weight.grad if b == task else torch.zeros_like(branch.weight)) / world_size
        dist.all_reduce(expected)
        branch_gaps.append(max_difference(branch.weight.grad, expected))

    frozen = ddp.MLPWithBranches()
    frozen.branches.requires_grad_(False)
    variants = {
        "frozen": DDP(frozen),
        "find_unused": DDP(ddp.MLPWithBranches(), find_unused_parameters=True),
        "static_graph": DDP(ddp.MLPWithBranches(), static_graph=True),
    }

    def step(model):
        return lambda: (model.zero_grad(), loss(model(x), y).backward())

    def recorded(fn):
        with comms.Recorder() as rec:
            fn()
        return rec.counts()

    counts = {}
    for name, variant in variants.items():
        counts[name] = [recorded(step(variant)) for _ in range(5)]
    return {
        "error": error,
        "indices": ddp.branch_indices(model),
        "branch_gaps": branch_gaps,
        "in_sync": ddp.check_gradient_sync(fixed),
        "counts": counts,
    }


def test_unused_parameters_error_fix_and_collectives_per_step():
    for rank, values in enumerate(run_source(unused_parameters, 3)):
        assert values["indices"] == [10, 11, 12, 13]
        error = values["error"]
        assert error.startswith("Expected to have finished reduction in the prior iteration"), error
        assert f"Parameter indices which did not receive grad for rank {rank}: 10 11 12 13" in error
        assert "find_unused_parameters=True" in error
        # every rank holds each branch's gradient: the takers' sum over N, also a rank that did not take it
        assert max(values["branch_gaps"]) < 1e-6 and values["in_sync"] == 0.0, values
        counts = values["counts"]
        # once DDP has learnt the order (and rebuilt its buckets, a few broadcasts in step 2): one all-reduce per
        # step, and find_unused_parameters adds the all-reduce of the used-parameter map (it never rebuilds)
        assert counts["frozen"][3:] == counts["static_graph"][3:] == [{"all_reduce": 1}] * 2, counts
        assert counts["find_unused"] == [{"all_reduce": 2}] * 5, counts


def uneven_inputs(rank: int, world_size: int) -> dict:
    """Without Join: a stuck all-reduce on a 2 s group, monitored_barrier naming the stuck ranks. With torch's Join
    (both divisors) and the from-scratch join: the reference's weights."""
    from datetime import timedelta

    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib import ddp
    from course_lib.compare import max_difference
    from course_lib.models import MLP

    batches = ddp.uneven_batches(world_size)
    loss = torch.nn.functional.mse_loss
    short = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
    stuck = DDP(MLP(), process_group=short)
    done, outcome = 0, "no error"
    try:
        for x, y in batches[rank]:
            loss(stuck(x), y).backward()
            done += 1
        dist.monitored_barrier(short, timeout=timedelta(seconds=2), wait_all_ranks=True)
    except RuntimeError as error:
        outcome = str(error)
    dist.barrier()  # the default group still works

    gaps = {}
    for divide in (True, False):
        model = DDP(MLP())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with Join([model], divide_by_initial_world_size=divide):
            for x, y in batches[rank]:
                optimizer.zero_grad()
                loss(model(x), y).backward()
                optimizer.step()
        for reference_divide in (True, False):
            reference = ddp.uneven_reference(MLP(), batches, lr=0.1, divide_by_initial_world_size=reference_divide)
            gaps[(divide, reference_divide)] = max_difference(model, reference)
    mine = ddp.MinimalDDP(MLP(seed=rank), bucket_cap_mb=0.01)
    steps = ddp.train_with_join(mine, batches[rank], torch.optim.SGD(mine.parameters(), lr=0.1))
    scratch_gap = max_difference(mine, ddp.uneven_reference(MLP(), batches, lr=0.1))
    return {"done": done, "outcome": outcome, "gaps": gaps, "steps": steps, "scratch_gap": scratch_gap}


@pytest.mark.parametrize("nproc", world_sizes(2, 3))
def test_uneven_inputs_hang_without_join_and_equal_the_reference_with_it(nproc):
    stuck = ", ".join(str(r) for r in range(1, nproc))
    for rank, values in enumerate(run_source(uneven_inputs, nproc)):
        if rank == 0:  # 2 batches, then the barrier names every rank still in its all-reduce
            assert values["done"] == 2 and f"Ranks {stuck} failed to pass monitoredBarrier" in values["outcome"]
        else:
            # its own timeout, or a peer's that closed the connection first
            assert values["done"] == 2 and re.search(r"timed? ?out|closed", values["outcome"], re.I), values
        gaps = values["gaps"]
        assert gaps[(True, True)] < 1e-6 and gaps[(False, False)] < 1e-6, gaps
        assert gaps[(True, False)] > 1e-3 and gaps[(False, True)] > 1e-3, gaps  # the divisor matters
        assert values["steps"] == nproc + 1 and values["scratch_gap"] < 1e-6, values


def test_uneven_batches_and_the_reference():
    batches = ddp.uneven_batches(3, batch_size=4, fewest=2)
    assert [len(b) for b in batches] == [2, 3, 4]
    rows = torch.cat([x for rank_batches in batches for x, _ in rank_batches])
    assert rows.shape == (36, 32) and len({tuple(r.tolist()) for r in rows}) == 36  # no sample on two ranks
    # one rank: the reference is plain SGD over its batches, whichever divisor
    model = MLP()
    one = ddp.uneven_reference(model, batches[:1], lr=0.1)
    plain = MLP()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for x, y in batches[0]:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(plain(x), y).backward()
        optimizer.step()
    assert compare.max_difference(one, plain) == 0.0
    assert compare.max_difference(model, MLP()) == 0.0  # the reference trains a copy


def test_branches_and_step_timing(monkeypatch):
    model = ddp.MLPWithBranches()
    x = torch.randn(5, 32)
    assert torch.equal(model(x), model.trunk(x))
    assert not torch.equal(model(x, branch=1), model(x, branch=0))
    assert ddp.branch_indices(model) == [10, 11, 12, 13]
    assert ddp.branch_indices(torch.nn.ModuleDict({"module": model})) == [10, 11, 12, 13]

    # A clock that only the steps move: "slow" costs 3 s, "fast" 1 s, the warm-up turn and one disturbed turn more.
    from types import SimpleNamespace

    from course_lib.launch import runtime

    now = [0.0]
    monkeypatch.setattr(runtime, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    calls = []

    def step(name: str, cost: float):
        def run():
            turn = calls.count(name)
            calls.append(name)
            now[0] += cost + (100.0 if turn == 0 else 50.0 if turn == 3 else 0.0)

        return run

    seconds = runtime.seconds_in_turns({"fast": step("fast", 1.0), "slow": step("slow", 3.0)}, repeats=5, warmup=1)
    assert calls == ["fast", "slow"] * 6  # in turns, warm-up included
    assert seconds == {"fast": 1.0, "slow": 3.0}  # the least disturbed turn, the warm-up not counted


def test_stamps_on_the_cpu_are_host_seconds_and_cuda_events_come_back_on_the_host_clock(monkeypatch):
    """CUDA events (faked: a GPU clock in ms) become perf_counter seconds through an anchor on the idle device."""
    import time

    before = time.perf_counter()
    now = ddp.stamp(torch.device("cpu"))
    assert isinstance(now, float) and before <= now <= time.perf_counter()
    rows = [(0, 8, 1.5, 2.5)]
    assert ddp.on_host_clock(rows) == rows  # no events: nothing to convert, no synchronization

    gpu_ms = [1000.0]  # the fake GPU's clock

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            self.at = None

        def record(self) -> None:
            self.at = gpu_ms[0]

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: FakeEvent) -> float:
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    start = ddp.stamp(torch.device("cuda", 0))
    gpu_ms[0] += 3.0  # the all-reduce takes 3 ms on the GPU
    end = ddp.stamp(torch.device("cuda", 0))
    gpu_ms[0] += 5.0  # 5 ms later the anchor: the host reads its clock right after it
    host_before = time.perf_counter()
    [(bucket, nbytes, s, e)] = ddp.on_host_clock([(0, 8, start, end)])
    host_after = time.perf_counter()
    assert (bucket, nbytes) == (0, 8)
    assert e - s == pytest.approx(3e-3)
    assert host_before - 5e-3 <= e <= host_after - 5e-3


def test_bytes_written_counts_on_gloo_and_is_none_under_nccl(monkeypatch):
    """wchar counts what gloo sends through sockets; NCCL's transports bypass it, so there is no number."""
    assert isinstance(ddp.bytes_written(), int)  # no process group: this process's count
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert isinstance(ddp.bytes_written(), int)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert ddp.bytes_written() is None


# ------------------------------------------------------------------------------------------------
# torch.compile under DDP (section 9)
# ------------------------------------------------------------------------------------------------


def test_recording_backend_sees_every_parameter_in_one_graph_without_ddp():
    graphs: list[int] = []
    model = MLP()
    compiled = torch.compile(model, backend=ddp.recording_backend(graphs))
    assert torch.equal(compiled(torch.ones(2, 32)), model(torch.ones(2, 32)))
    torch._dynamo.reset()
    assert graphs == [sum(p.numel() * 4 for p in model.parameters())]


def graph_splits(rank, world_size):
    import torch

    from course_lib import ddp
    from course_lib.models import MLP

    big = dict(d_in=64, d_hidden=512, d_out=64, n_layers=3)  # Linear layers of 0.13, 1.05, 1.05, 0.13 MB
    x = torch.randn(4, 64)
    return {
        "default": ddp.graphs_and_buckets(MLP(**big), x),
        "capped": ddp.graphs_and_buckets(MLP(**big), x, bucket_cap_mb=1.5),
        "off": ddp.graphs_and_buckets(MLP(**big), x, split=False),
    }


def test_ddp_optimizer_cuts_the_graphs_where_ddp_buckets_end():
    for splits in run_source(graph_splits, 2):
        total = sum(splits["default"]["buckets"])
        assert all(sum(s["graphs"]) == sum(s["buckets"]) == total for s in splits.values()), splits
        assert splits["default"]["graphs"] == splits["default"]["buckets"], splits  # the same cut, byte for byte
        assert len(splits["default"]["buckets"]) > 1, splits  # DDP's 1 MiB first bucket
        # With a cap given, DDP drops its small first bucket and DDPOptimizer does not: its first cut (1.18 MB)
        # falls inside DDP's first bucket (2.23 MB), whose end falls inside the second graph.
        graph_ends, bucket_ends = (set(itertools.accumulate(splits["capped"][k])) for k in ("graphs", "buckets"))
        assert not bucket_ends <= graph_ends, splits
        assert splits["off"]["graphs"] == [total], splits  # DDPOptimizer off: one graph
