"""Rank programs of tests/test_precision.py: the loss scaler on FSDP2-sharded ranks, and the exercise checker."""

from __future__ import annotations

import runpy
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib import precision
from course_lib.compare import local_tensor
from course_lib.exercises import ExerciseFailed
from course_lib.models import MLP, shard_layers_then_root

SOLUTIONS = Path(__file__).resolve().parents[2] / "notebooks" / "solutions" / "04_mixed_precision.py"


def solutions() -> dict:
    """The solution blocks, with what the notebook defines above them (the prediction reads MLP and FSDP_NPROC)."""
    return runpy.run_path(str(SOLUTIONS), init_globals={"MLP": MLP, "FSDP_NPROC": 2})


# Answers to the found-inf exercise that the checker must reject, each for its own reason.


def calls_the_course_version(grads):
    return precision.found_inf_across_ranks(grads)


def local_only(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor(float(any(not torch.isfinite(g).all() for g in grads)))


def summed(grads: list[torch.Tensor]) -> torch.Tensor:
    found = torch.tensor(float(any(not torch.isfinite(g).all() for g in grads)))
    dist.all_reduce(found)
    return found


def misses_nan(grads: list[torch.Tensor]) -> torch.Tensor:
    found = torch.tensor(float(any(torch.isinf(g).any() for g in grads)))
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return found


def cleans_gradients(grads: list[torch.Tensor]) -> torch.Tensor:
    found = torch.tensor(float(any(not torch.isfinite(g).all() for g in grads)))
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    for g in grads:
        g.nan_to_num_(posinf=0.0, neginf=0.0)
    return found


def scalers_on_sharded_ranks(rank: int, world_size: int) -> dict:
    """GradScaler, DynamicLossScaler and the naive scaler on an FSDP2 MLP; the FSDP2 policy; checker verdicts."""
    device = torch.device("cpu")
    settings = dict(init_scale=2.0**24, growth_interval=3)
    scalers = {
        "torch": lambda: torch.amp.GradScaler("cpu", **settings),
        "mine": lambda: precision.DynamicLossScaler(**settings),
        "naive": lambda: precision.DynamicLossScaler(**settings, sync_found_inf=False),
    }
    batches = precision.rank_batches(16, 48, device)
    runs, params = {}, {}
    for name, make in scalers.items():
        model = shard_layers_then_root(MLP())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        # step 10: an overflow on the last rank only; step 12: on rank 0 only
        # no clipping here: clip_grad_norm_ over DTensor gradients all-reduces the norm, which would hide the
        # naive scaler's disagreement (an inf norm zeroes every rank's update)
        runs[name] = precision.amp_training_loop(model, optimizer, make(), batches, poison={10: world_size - 1, 12: 0})
        params[name] = [local_tensor(p.detach()).clone() for p in model.parameters()]
    verdicts = {}
    for candidate in (
        solutions()["found_inf"],
        precision.found_inf_across_ranks,  # the shortcut, handed in as the answer
        calls_the_course_version,  # the same, called from the learner's code
        local_only,
        summed,
        misses_nan,
        cleans_gradients,
    ):
        try:
            precision.check_found_inf(candidate)
            verdicts[candidate.__name__] = "passed"
        except ExerciseFailed as failure:
            verdicts[candidate.__name__] = str(failure)
    return {
        "scales": {name: run["scales"] for name, run in runs.items()},
        "skipped": {name: run["skipped"] for name, run in runs.items()},
        "params_equal": all(torch.equal(a, b) for a, b in zip(params["torch"], params["mine"])),
        "policy": precision.inspect_fsdp2_mixed_precision(torch.bfloat16, torch.float32),
        "verdicts": verdicts,
    }


# Answers to the clipping exercise that the checker must reject.


def clips_scaled(model, optimizer, scaler, x, y, max_norm):  # the broken step the notebook shows
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def no_clipping(model, optimizer, scaler, x, y, max_norm):
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def no_update(model, optimizer, scaler, x, y, max_norm):
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    optimizer.zero_grad(set_to_none=True)


def fixed_scale(model, optimizer, scaler, x, y, max_norm):
    """Overrides GradScaler's scale every step (the anti-pattern of section 4)."""
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update(new_scale=2.0**16)
    optimizer.zero_grad(set_to_none=True)


def clips_local_shards(model, optimizer, scaler, x, y, max_norm):
    """Clips each rank's shard by its own norm: the ranks' clip factors differ."""
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grads = [local_tensor(p.grad) for p in model.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    for g in grads:
        g.mul_(min(1.0, max_norm / (float(norm) + 1e-6)))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def calls_the_course_loop(model, optimizer, scaler, x, y, max_norm):
    """The shortcut: the course's own training loop, one batch at a time."""
    return precision.amp_training_loop(model, optimizer, scaler, [(x, y)], max_norm=max_norm)["losses"][0]


def clipping_verdicts(rank: int, world_size: int) -> dict:
    """The clipping checker against the solution and the wrong answers: 'passed' or the message, per candidate."""
    candidates = [solutions()["train_step"], clips_scaled, no_clipping, no_update]
    verdicts = {}
    for candidate in [*candidates, fixed_scale, clips_local_shards, calls_the_course_loop]:
        try:
            precision.check_clipped_scaler_step(candidate)
            verdicts[candidate.__name__] = "passed"
        except ExerciseFailed as failure:
            verdicts[candidate.__name__] = str(failure)
    return verdicts
