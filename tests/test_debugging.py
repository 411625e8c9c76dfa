"""course_lib.debugging: desync check, NaN/Inf hooks, environment report, DETAIL parsing, trace helpers.

Multi-rank tests are real gloo runs through course_lib.launcher; each launch costs a few seconds of
start-up, so one body carries many checks and brings the results back with `out`.
"""

from __future__ import annotations

import pytest
import torch

from course_lib import debugging, launcher
from course_lib.exercises import check

QUIET = dict(write=lambda text, stream: None)

SCENARIOS_BODY = r"""
import os, tempfile, warnings
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile
from course_lib.data import regression
from course_lib.debugging import (DistributedDebugger, GradientDesyncError, NonFiniteError, NonFiniteEvent,
                                  allreduce_sizes, differing_keys, environment_report, trace_event_names,
                                  is_allreduce, train_monitored)
from course_lib.models import MLP

results = {}
data = regression(n=32 * world_size)
x, y = data.tensors[0][rank::world_size], data.tensors[1][rank::world_size]
model = DDP(MLP(), bucket_cap_mb=0.01)
debugger = DistributedDebugger(model)

def backward(forward=model, inputs=x):
    model.zero_grad()
    torch.nn.functional.mse_loss(forward(inputs), y).backward()

def verdict():
    try:
        return ("ok", debugger.check_gradient_sync())
    except (GradientDesyncError, NonFiniteError) as error:
        return (type(error).__name__, str(error))

backward(); results["healthy"] = verdict()
backward(model.module); results["bypass"] = verdict()
backward()
if rank == 1:
    model.module[0].weight.grad[2, 3] += 1e-6           # tiny: float64 checksums still see it
results["nudge rank 1"] = verdict()
backward()
if rank == world_size - 1:
    g = model.module[2].weight.grad
    g[0, 0], g[0, 1] = g[0, 1].clone(), g[0, 0].clone()  # a plain sum would not change
results["swap last rank"] = verdict()
backward()
for p in model.module[-1].parameters():
    p.grad = None                                      # no gradient on any rank: still in sync
results["grad None everywhere"] = verdict()
backward()
if rank == 0:
    model.module[2].bias.grad[0] = float("nan")
results["nan rank 0"] = verdict()

# NaN/Inf hooks: forward input, forward output, backward of a module, loss gradient, parameter gradient
class SqrtActivation(torch.nn.Module):
    def forward(self, t):
        return torch.sqrt(t.abs())                     # finite forward, infinite gradient where t == 0

events = {}
plain = torch.nn.Sequential(torch.nn.Linear(4, 4), SqrtActivation(), torch.nn.Linear(4, 2))
inputs = torch.ones(3, 4)
def run(watcher, inputs, loss_scale=1.0):
    watcher.reset()
    plain.zero_grad()
    (plain(inputs).sum() * loss_scale).backward()
    return str(watcher.first_nonfinite())
bad = inputs.clone(); bad[1, 2] = float("nan")
watcher = DistributedDebugger(plain).watch_nonfinite()
events["input"] = run(watcher, bad)
with torch.no_grad():
    plain[0].weight.zero_(); plain[0].bias.zero_()      # sqrt sees exact zeros
events["backward"] = run(watcher, inputs)
with torch.no_grad():
    plain[0].weight.fill_(0.1); plain[0].bias.fill_(0.1)
events["loss"] = run(watcher, inputs, float("inf"))
with torch.no_grad():
    plain[2].weight[0, 0] = float("inf")
events["output"] = run(watcher, inputs)
with torch.no_grad():
    plain[2].weight[0, 0] = 0.0
watcher.remove()
run(watcher, bad)
events["clean after remove"] = watcher.first_nonfinite()
handle = plain[2].weight.register_hook(lambda g: g * float("nan"))   # before the debugger's own hook
injected = DistributedDebugger(plain).watch_nonfinite()
events["gradient"] = run(injected, inputs)
injected.remove(); handle.remove()
raiser = DistributedDebugger(plain).watch_nonfinite(raise_on_nonfinite=True)
try:
    plain(bad)
    events["raised"] = None
except NonFiniteError as error:
    events["raised"] = str(error)
raiser.remove()
watcher.reset()
if rank == world_size - 1:
    watcher.events.append(NonFiniteEvent(rank, "gradient", "w", 1))
events["gathered"] = [str(e) if e else None for e in watcher.gather_nonfinite()]

# profiler trace: all-reduce events and their sizes
for _ in range(2):
    backward()
trace = os.path.join(tempfile.mkdtemp(), "trace.json")
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    backward()
prof.export_chrome_trace(trace)
names = trace_event_names(trace)
profiled = (any(is_allreduce(n) for n in names), allreduce_sizes(trace), sum(p.numel() for p in model.parameters()))

report = environment_report()
monitor = train_monitored(4, 8, report=False).as_dict()
"""


def test_debugger_scenarios_on_three_ranks():
    run = launcher.launch(
        SCENARIOS_BODY, 3, backend="gloo", out=["results", "events", "profiled", "report", "monitor"], **QUIET
    )
    results, events = run.values["results"], run.values["events"]
    assert all(r == results[0] for r in results), "every rank must reach the same verdict"
    r = results[0]
    assert r["healthy"] == ("ok", 10)
    assert r["bypass"][0] == "GradientDesyncError" and "in 10 of 10 parameter tensors" in r["bypass"][1]
    assert r["nudge rank 1"] == (
        "GradientDesyncError",
        "gradients differ between ranks in 1 of 10 parameter "
        "tensors, first '0.weight': rank(s) [1] differ from the majority",
    )
    assert r["swap last rank"][0] == "GradientDesyncError" and "'2.weight': rank(s) [2]" in r["swap last rank"][1]
    assert r["grad None everywhere"] == ("ok", 10)
    assert r["nan rank 0"][0] == "NonFiniteError" and "'2.bias'" in r["nan rank 0"][1]

    e = events[0]
    assert e["input"] == "rank 0: 1 non-finite value(s) in the forward input of '0'"
    assert e["backward"] == "rank 0: 12 non-finite value(s) in the backward of '1'"
    assert e["loss"] == "rank 0: 6 non-finite value(s) in the loss gradient of 'model output'"
    assert e["gradient"] == "rank 0: 8 non-finite value(s) in the gradient of '2.weight'"
    assert e["output"] == "rank 0: 3 non-finite value(s) in the forward output of '2'"
    assert e["clean after remove"] is None
    assert e["raised"] == "rank 0: 1 non-finite value(s) in the forward input of '0'"
    assert e["gathered"] == [None, None, "rank 2: 1 non-finite value(s) in the gradient of 'w'"]
    assert all(ev["gathered"] == e["gathered"] for ev in events)

    has_allreduce, sizes, n_params = run.values["profiled"][0]
    assert has_allreduce and len(sizes) > 1 and sum(sizes) == n_params

    reports = run.values["report"]
    assert [rep["rank"] for rep in reports] == ["0", "1", "2"] and debugging.differing_keys(reports) == []
    for m in run.values["monitor"]:
        assert len(m["seconds"]) == len(m["memory_mb"]) == 4 and min(m["memory_mb"]) > 0
        assert all(abs(rate * t - 8) < 1e-6 for rate, t in zip(m["samples_per_s"], m["seconds"]))


def test_differing_keys_names_the_odd_key():
    reports = [
        {"rank": "0", "pid": "11", "torch": "2.13.0", "NCCL_DEBUG": "<unset>"},
        {"rank": "1", "pid": "12", "torch": "2.13.0", "NCCL_DEBUG": "INFO"},
    ]
    assert debugging.differing_keys(reports) == ["NCCL_DEBUG"]
    reports[1]["NCCL_DEBUG"] = "<unset>"
    assert debugging.differing_keys(reports) == []


DETAIL_BODY = r"""
from datetime import timedelta
group = dist.new_group(timeout=timedelta(seconds=20))
x = torch.ones(5 if rank == 2 else 4)
dist.all_reduce(x, group=group)
"""


def test_detail_names_each_ranks_collective_on_four_ranks():
    with pytest.raises(launcher.RankFailedError) as caught:
        launcher.launch(DETAIL_BODY, 4, backend="gloo", timeout=120, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, **QUIET)
    seen = {}
    for failure in caught.value.failures:
        for rank, sequence, op, shape in debugging.mismatch_fingerprints(failure.summary):
            seen[rank] = (sequence, op, shape)
    assert seen.get(2) == (0, "ALLREDUCE", (5,)), seen
    assert len(seen) >= 2 and all(v == (0, "ALLREDUCE", (4,)) for r, v in seen.items() if r != 2), seen


def test_mismatch_fingerprints_parses_shapes_and_ops():
    message = (
        "Detected mismatch between collectives on ranks. Rank 1 is running collective: "
        "CollectiveFingerPrint(SequenceNumber=7, OpType=BROADCAST, TensorShape=[2, 3], TensorDtypes=Float), "
        "but Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=7, OpType=ALLREDUCE, "
        "TensorShape=[], TensorDtypes=Float)."
    )
    assert debugging.mismatch_fingerprints(message) == [(1, 7, "BROADCAST", (2, 3)), (0, 7, "ALLREDUCE", ())]


def test_gradient_checksums_see_swaps_and_missing_gradients():
    a = torch.nn.Linear(3, 2)
    a.weight.grad = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    before = debugging.gradient_checksums(a)
    assert before.dtype == torch.float64 and before.shape == (2,) and before[1] == 0  # bias has no grad
    a.weight.grad = torch.tensor([[2.0, 1.0, 3.0], [4.0, 5.0, 6.0]])
    assert debugging.gradient_checksums(a)[0] != before[0]


# ---- the exercise --------------------------------------------------------------------------------


def wrong_always_true(model):
    return True


def wrong_plain_sum(model):
    import torch.distributed as dist

    sums = torch.stack(
        [
            p.grad.double().sum() if p.grad is not None else torch.zeros((), dtype=torch.float64)
            for p in model.parameters()
        ]
    )
    high, low = sums.clone(), sums.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return bool(torch.equal(high, low))


def wrong_max_only(model):
    import torch.distributed as dist

    from course_lib.debugging import gradient_checksums

    mine = gradient_checksums(model)
    high = mine.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(torch.equal(high, mine))  # the rank holding the maximum believes all is well


def gradients_in_sync(model):
    raise NotImplementedError


def reference_in_sync(model):
    from course_lib.debugging import solution_gradients_in_sync

    return solution_gradients_in_sync(model)


@pytest.mark.parametrize("nproc", [2, 4])
def test_exercise_reference_passes(nproc, capsys):
    assert check(reference_in_sync, "course_lib.debugging:check_gradients_in_sync", nproc=nproc, backend="gloo")


def test_exercise_stub_is_not_attempted(capsys):
    assert check(gradients_in_sync, "course_lib.debugging:check_gradients_in_sync", nproc=2, backend="gloo") is None
    assert "not attempted yet" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, expected",
    [
        (wrong_always_true, "one gradient entry changed on rank 2: expected False on every rank, got True on rank "),
        (
            wrong_plain_sum,
            "two entries of one gradient swapped on rank 1: expected False on every rank, got True on rank ",
        ),
        (wrong_max_only, "one gradient entry changed on rank 2: expected False on every rank, got True on rank 2"),
    ],
)
def test_exercise_wrong_answers_fail_naming_the_rank(wrong, expected, capsys):
    assert check(wrong, "course_lib.debugging:check_gradients_in_sync", nproc=3, backend="gloo") is False
    said = capsys.readouterr().out
    assert expected in said and "rank" in said.split(":")[1], said
