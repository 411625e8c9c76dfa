"""course_lib.ddp: the from-scratch DDP against torch's DDP and single-process training, on real gloo ranks.

Each multi-rank test is one launch (about 3 s of start-up), so many checks share a body.
"""

from __future__ import annotations

import os
import re
import tempfile

import pytest
import torch
import torch.distributed as dist

from course_lib import ddp
from course_lib.exercises import check
from course_lib.launcher import launch
from course_lib.models import MLP

QUIET = dict(write=lambda text, stream: None)

EQUALITY_BODY = r"""
from torch.nn.parallel import DistributedDataParallel as DDP
from course_lib.data import regression
from course_lib.ddp import MinimalDDP, check_gradient_sync, max_difference, train
from course_lib.models import MLP

data = regression(n=144)              # 3 global batches of 48: divisible by 2, 3 and 4 ranks
def sgd_run(model, **kw):
    return train(model, data, global_batch=48, epochs=1, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kw)

results = {}
single = MLP()
sgd_run(single, distributed=False)
for cap_mb in (25.0, 0.01):           # one bucket; then a bucket per tensor or two (several async all-reduces)
    for accumulation in (1, 2, 3):
        if 48 % (world_size * accumulation):
            continue
        mine = MinimalDDP(MLP(seed=rank), bucket_cap_mb=cap_mb)   # different starts: rank 0 broadcasts seed 0
        theirs = DDP(MLP(seed=11 * rank), bucket_cap_mb=cap_mb)
        sgd_run(mine, accumulation=accumulation, check_sync=True)
        sgd_run(theirs, accumulation=accumulation)
        results[(cap_mb, accumulation)] = (max_difference(single, mine), max_difference(mine, theirs), len(mine.buckets))

# the timeline: one entry per bucket, launched in bucket order, each finishing after it started
timeline = mine.timeline
launch_order = [start for _, _, start, _ in timeline]
timeline_ok = (len(timeline) == len(mine.buckets) > 1 and launch_order == sorted(launch_order)
               and all(end >= start for _, _, start, end in timeline)
               and sum(nbytes for _, nbytes, _, _ in timeline) == sum(p.numel() * 4 for p in mine.parameters()))

# check_gradient_sync: silent when in sync, names the ranks that are not
model = MinimalDDP(MLP())
x, y = data.tensors[0][rank::world_size], data.tensors[1][rank::world_size]
torch.nn.functional.mse_loss(model(x), y).backward()
in_sync = check_gradient_sync(model)
with model.no_sync():
    torch.nn.functional.mse_loss(model(x), y).backward()
try:
    check_gradient_sync(model)
    out_of_sync = None
except AssertionError as error:
    out_of_sync = str(error)

# a parameter without gradient: MinimalDDP must say so instead of hanging
class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    def forward(self, x):
        return self.used(x)
partial = MinimalDDP(TwoHeads())
try:
    partial(torch.ones(2, 4)).sum().backward()
    unused_error = None
except RuntimeError as error:
    unused_error = str(error)
"""


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_minimal_ddp_equals_torch_ddp_and_single_process(nproc):
    run = launch(
        EQUALITY_BODY,
        nproc,
        backend="gloo",
        out=["results", "timeline_ok", "in_sync", "out_of_sync", "unused_error"],
        **QUIET,
    )
    for rank in range(nproc):
        results = run.values["results"][rank]
        assert (25.0, 1) in results and (0.01, 2) in results
        assert results[(25.0, 1)][2] == 1 and results[(0.01, 1)][2] > 1
        for (cap_mb, accumulation), (vs_single, vs_torch, n_buckets) in results.items():
            where = f"rank {rank}, bucket_cap_mb={cap_mb}, accumulation={accumulation}"
            assert vs_single < 1e-6, (where, vs_single)  # 3 SGD steps: only float rounding apart
            assert vs_torch < 1e-6, (where, vs_torch)
            assert n_buckets == len(ddp.assign_buckets(list(MLP().parameters()), int(cap_mb * ddp.MB))), where
        assert run.values["timeline_ok"][rank]
        assert run.values["in_sync"][rank] == 0.0
        message = run.values["out_of_sync"][rank]
        assert message is not None and message.startswith(f"gradients out of sync: rank(s) {list(range(1, nproc))}")
        if rank:
            assert f"here on rank {rank} first in 0.weight" in message
        assert "find_unused_parameters" in run.values["unused_error"][rank]


HOOKS_SNAPSHOT_AND_EXERCISES_BODY = r"""
from course_lib import ddp
from course_lib.data import regression
from course_lib.exercises import ExerciseFailed
from course_lib.models import MLP

data = regression(n=240)
x, y = next(iter(ddp.rank_loader(data, 48 // world_size, epoch=0)))
hooks = {}
for hook in ddp.COMM_HOOKS:
    log, model = ddp.train_with_hook(hook, data, torch.device("cpu"), global_batch=48, epochs=1)
    hooks[hook] = (sorted(log.bytes_sent)[len(log.bytes_sent) // 2], ddp.ring_bytes(ddp.payload_bytes(model, hook), world_size),
                   ddp.gradient_error(MLP(), hook, x, y), log.losses[-1])

# snapshot: rank 0 writes, every rank reads the same weights and optimizer state
model = ddp.MinimalDDP(MLP())
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
ddp.train(model, data, global_batch=48, epochs=1, optimizer=optimizer)
ddp.save_snapshot(snapshot_path, model, optimizer, step=7)
fresh = ddp.MinimalDDP(MLP(seed=5))
fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=1e-2)
snapshot_step = ddp.load_snapshot(snapshot_path, fresh, fresh_optimizer)
snapshot_gap = ddp.max_difference(model, fresh)
snapshot_keys = sorted(torch.load(snapshot_path, weights_only=True)["model"])

# exercise checkers: the reference passes, wrong answers fail with a message naming the rank
def sum_without_average(param):
    dist.all_reduce(param.grad)

def local_only(param):
    pass

def hook_sum_only(state, bucket):
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])

def hook_local_only(state, bucket):
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future

verdicts = {}
for checker, candidates in ((ddp.check_average_gradient, (ddp.solution_average_gradient, sum_without_average, local_only)),
                            (ddp.check_mean_allreduce_hook, (ddp.solution_mean_allreduce_hook, hook_sum_only, hook_local_only))):
    for candidate in candidates:
        try:
            checker(candidate)
            verdicts[candidate.__name__] = "passed"
        except ExerciseFailed as failure:
            verdicts[candidate.__name__] = str(failure)
"""


def test_hooks_snapshot_and_exercise_checkers():
    nproc = 3
    snapshot_path = os.path.join(tempfile.mkdtemp(), "snapshot.pt")
    run = launch(
        HOOKS_SNAPSHOT_AND_EXERCISES_BODY,
        nproc,
        backend="gloo",
        push={"snapshot_path": snapshot_path},
        out=["hooks", "snapshot_step", "snapshot_gap", "snapshot_keys", "verdicts"],
        **QUIET,
    )
    hooks = run.values["hooks"][0]
    errors = {name: h[2] for name, h in hooks.items()}
    assert errors["none"] == 0.0 and 1e-5 < errors["fp16"] < 1e-3 < errors["bf16"] < 1e-2 < errors["powersgd"], errors
    for name in ("none", "fp16", "bf16"):
        sent, formula = hooks[name][:2]
        assert abs(sent / formula - 1) < 0.05, (name, sent, formula)  # 2(N-1)/N x payload, + headers
    assert hooks["powersgd"][0] < 0.2 * hooks["none"][0]
    for name in ("fp16", "bf16"):
        assert abs(hooks[name][3] - hooks["none"][3]) < 0.01 * hooks["none"][3], name
    assert run.values["snapshot_step"] == [7] * nproc
    assert run.values["snapshot_gap"] == [0.0] * nproc
    assert run.values["snapshot_keys"][0] == sorted(MLP().state_dict())  # no "module." prefix
    for rank, verdicts in enumerate(run.values["verdicts"]):
        assert verdicts["solution_average_gradient"] == "passed"
        assert verdicts["solution_mean_allreduce_hook"] == "passed"
        for wrong in ("sum_without_average", "local_only", "hook_sum_only", "hook_local_only"):
            assert verdicts[wrong].startswith("step 0: gradient of"), (rank, wrong, verdicts[wrong])


def wrong_average_gradient(param):
    dist.all_reduce(param.grad)  # sums, forgets to divide


def test_check_reports_wrong_answer_with_its_rank(capsys):
    assert check(wrong_average_gradient, "course_lib.ddp:check_average_gradient", nproc=2, backend="gloo") is False
    said = capsys.readouterr().out
    # every rank gets it wrong; whichever reported first is named
    assert re.match(r"✗ wrong_average_gradient: rank [01]: step 0: gradient of 0\.weight", said), said


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
    assert ddp.ring_bytes(1000, 4) == 1500
    assert ddp.ddp_bytes_per_rank(10, bucket_copy=False) == 10 * 4 * 4
    model = MLP()
    n = sum(p.numel() for p in model.parameters())
    assert ddp.payload_bytes(model, "none") == 4 * n and ddp.payload_bytes(model, "fp16") == 2 * n
    assert ddp.payload_bytes(model, "powersgd") < ddp.payload_bytes(model, "fp16") / 4
    order = ddp.shuffled_order(torch.utils.data.TensorDataset(torch.zeros(10)), epoch=3, seed=1)
    sampler = torch.utils.data.DistributedSampler(range(10), num_replicas=2, rank=1, shuffle=True, seed=1)
    sampler.set_epoch(3)
    assert list(sampler) == order[1::2]
