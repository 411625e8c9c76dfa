"""Rank programs for tests/test_ddp.py: MinimalDDP against torch DDP and one process; hooks,
snapshots and the exercise checkers."""

from __future__ import annotations

import torch
import torch.distributed as dist


class TwoHeads(torch.nn.Module):
    """A model with a parameter that gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def equality(rank: int, world_size: int) -> dict:
    """MinimalDDP and torch DDP (bucket caps, gradient accumulation) against one process; the
    timeline; check_gradient_sync in and out of sync; a parameter without gradient."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib.compare import max_difference
    from course_lib.data import regression
    from course_lib.ddp import MinimalDDP, check_gradient_sync, train
    from course_lib.models import MLP

    data = regression(n=144)  # 3 global batches of 48: divisible by 2, 3 and 4 ranks

    def sgd_run(model, **kw):
        return train(
            model, data, global_batch=48, epochs=1, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **kw
        )

    results = {}
    single = MLP()
    sgd_run(single, distributed=False)
    for cap_mb in (25.0, 0.01):  # one bucket; then a bucket per tensor or two (several async all-reduces)
        for accumulation in (1, 2, 3):
            if 48 % (world_size * accumulation):
                continue
            mine = MinimalDDP(MLP(seed=rank), bucket_cap_mb=cap_mb)  # different starts: rank 0 broadcasts seed 0
            theirs = DDP(MLP(seed=11 * rank), bucket_cap_mb=cap_mb)
            sgd_run(mine, accumulation=accumulation, check_sync=True)
            sgd_run(theirs, accumulation=accumulation)
            results[(cap_mb, accumulation)] = (
                max_difference(single, mine),
                max_difference(mine, theirs),
                len(mine.buckets),
            )

    # the timeline of the last step (one entry per bucket, in bucket order): several buckets, launched
    # in order 0, 1, ..., each finishing after it started, together carrying every gradient byte
    timeline = mine.timeline
    launch_order = [start for _, _, start, _ in timeline]
    timeline_ok = (
        len(timeline) > 1
        and launch_order == sorted(launch_order)
        and all(end >= start for _, _, start, end in timeline)
        and sum(nbytes for _, nbytes, _, _ in timeline) == sum(p.numel() * 4 for p in mine.parameters())
    )

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
    partial = MinimalDDP(TwoHeads())
    try:
        partial(torch.ones(2, 4)).sum().backward()
        unused_error = None
    except RuntimeError as error:
        unused_error = str(error)
    return {
        "results": results,
        "timeline_ok": timeline_ok,
        "in_sync": in_sync,
        "out_of_sync": out_of_sync,
        "unused_error": unused_error,
    }


# ---- wrong answers for the exercise checkers ------------------------------------------------------


def sum_without_average(param: torch.Tensor) -> None:
    dist.all_reduce(param.grad)


def local_only(param: torch.Tensor) -> None:
    pass


def hook_sum_only(state, bucket):
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


def hook_torchs_allreduce(state, bucket):  # the shortcut: torch's own default hook
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook(None, bucket)


def hook_torchs_allreduce_fut(state, bucket):  # the shortcut: the helper inside torch's default hook
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._allreduce_fut(None, bucket.buffer())


def hook_local_only(state, bucket):
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def accumulate_never_syncs(model, micro_batches, optimizer):  # the notebook's broken function
    optimizer.zero_grad(set_to_none=True)
    for x, y in micro_batches:
        with model.no_sync():
            (torch.nn.functional.mse_loss(model(x), y) / len(micro_batches)).backward()
    optimizer.step()


def accumulate_syncs_every_micro_batch(model, micro_batches, optimizer):  # right numbers, twice the traffic
    optimizer.zero_grad(set_to_none=True)
    for x, y in micro_batches:
        (torch.nn.functional.mse_loss(model(x), y) / len(micro_batches)).backward()
    optimizer.step()


def accumulate_no_sync_around_backward_only(model, micro_batches, optimizer):  # forward decides: syncs twice
    optimizer.zero_grad(set_to_none=True)
    for x, y in micro_batches:
        loss = torch.nn.functional.mse_loss(model(x), y) / len(micro_batches)
        with model.no_sync():
            loss.backward()
    optimizer.step()


def accumulate_one_backward_on_the_joined_batch(model, micro_batches, optimizer):  # the shortcut: no accumulation
    optimizer.zero_grad(set_to_none=True)
    x = torch.cat([x for x, _ in micro_batches])
    y = torch.cat([y for _, y in micro_batches])
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def accumulate_sums_losses(model, micro_batches, optimizer):  # forgets to divide by the micro-batch count
    optimizer.zero_grad(set_to_none=True)
    for i, (x, y) in enumerate(micro_batches):
        if i < len(micro_batches) - 1:
            with model.no_sync():
                torch.nn.functional.mse_loss(model(x), y).backward()
        else:
            torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def solutions() -> dict:
    """notebooks/solutions/02_ddp.py (the prediction needs the notebook's NPEERS, BIG, MLP and param_bytes)."""
    import runpy
    from pathlib import Path

    from course_lib.models import MLP, param_bytes

    path = Path(__file__).resolve().parents[2] / "notebooks" / "solutions" / "02_ddp.py"
    return runpy.run_path(str(path), init_globals={"NPEERS": 2, "BIG": {}, "MLP": MLP, "param_bytes": param_bytes})


def hooks_snapshot_and_exercises(rank: int, world_size: int, snapshot_path: str) -> dict:
    """Every comm hook's bytes, gradient error and loss; a snapshot round trip; the checkers."""
    from course_lib import comms, compare, ddp
    from course_lib.data import regression
    from course_lib.exercises import ExerciseFailed
    from course_lib.models import MLP

    data = regression(n=240)
    x, y = next(iter(ddp.rank_loader(data, 48 // world_size, epoch=0)))
    hooks = {}
    for hook in ddp.COMM_HOOKS:
        log, model = ddp.train_with_hook(hook, data, torch.device("cpu"), global_batch=48, epochs=1)
        hooks[hook] = (
            sorted(log.bytes_sent)[len(log.bytes_sent) // 2],
            comms.sent_per_rank("all_reduce", ddp.payload_bytes(model, hook), world_size),
            ddp.gradient_error(MLP(), hook, x, y),
            log.losses[-1],
        )

    # snapshot: rank 0 writes, every rank reads the same weights and optimizer state
    model = ddp.MinimalDDP(MLP())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ddp.train(model, data, global_batch=48, epochs=1, optimizer=optimizer)
    ddp.save_snapshot(snapshot_path, model, optimizer, step=7)
    fresh = ddp.MinimalDDP(MLP(seed=5))
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    snapshot_step = ddp.load_snapshot(snapshot_path, fresh, fresh_optimizer)
    snapshot_gap = compare.max_difference(model, fresh)
    snapshot_keys = sorted(torch.load(snapshot_path, weights_only=True)["model"])

    # exercise checkers: the reference passes, wrong answers fail with a message naming the step
    verdicts = {}
    solution = solutions()
    for checker, candidates in (
        (ddp.check_average_gradient, (solution["average_gradient"], sum_without_average, local_only)),
        (
            ddp.check_mean_allreduce_hook,
            (
                solution["mean_allreduce_hook"],
                hook_sum_only,
                hook_local_only,
                hook_torchs_allreduce,
                hook_torchs_allreduce_fut,
            ),
        ),
        (
            ddp.check_accumulate_step,
            (
                solution["accumulate_step"],
                accumulate_never_syncs,
                accumulate_syncs_every_micro_batch,
                accumulate_no_sync_around_backward_only,
                accumulate_sums_losses,
                accumulate_one_backward_on_the_joined_batch,
            ),
        ),
    ):
        for candidate in candidates:
            try:
                checker(candidate)
                verdicts[candidate.__name__] = "passed"
            except ExerciseFailed as failure:
                verdicts[candidate.__name__] = str(failure)
    return {
        "hooks": hooks,
        "snapshot_step": snapshot_step,
        "snapshot_gap": snapshot_gap,
        "snapshot_keys": snapshot_keys,
        "verdicts": verdicts,
    }
