"""Notebook 02's exercise checkers; no __future__ annotations: register_comm_hook compares them with real classes."""

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from course_lib.ddp.comm_hooks import CommHook, recording_hook, timed_allreduce_hook
from course_lib.ddp.minimal_ddp import unwrap
from course_lib.ddp.train import rank_loader
from course_lib.exercises import ExerciseFailed, expect_equal, refusing
from course_lib.launch.runtime import rank_device


def _exercise_batches(steps: int = 3) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    from course_lib.data import regression

    # 16 samples per rank per step, each rank its DistributedSampler shard, as in the lesson
    data = regression(n=16 * dist.get_world_size() * steps, seed=1)
    for x, y in rank_loader(data, micro_batch=16, epoch=0):
        yield x.to(rank_device()), y.to(rank_device())


def _compare_with_torch_ddp(candidate: nn.Module, steps: int = 3) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib.models import MLP

    reference = DDP(MLP(seed=0).to(rank_device()))
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(candidate.parameters(), lr=0.1)
    for step, (x, y) in enumerate(_exercise_batches(steps)):
        for model, o in ((reference, opt_ref), (candidate, opt)):
            o.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
        for (name, p), q in zip(unwrap(candidate).named_parameters(), reference.parameters()):
            if p.grad is None:
                raise ExerciseFailed(f"step {step}: {name} has no gradient after backward")
            # check() prefixes the rank that failed first
            expect_equal(
                f"step {step}: gradient of {name} (torch DDP's is the average over ranks)",
                p.grad,
                q.grad,
                atol=1e-6,
                rtol=1e-4,
            )
        opt_ref.step()
        opt.step()


def check_average_gradient(fn: Callable[[torch.Tensor], None]) -> None:
    """fn as a post-accumulate-grad hook on every parameter must reproduce torch DDP's gradients."""
    from course_lib.models import MLP

    model = MLP(seed=0).to(rank_device())
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(fn)
    _compare_with_torch_ddp(model)


_WRITE_THE_HOOK = (
    "this calls a ready-made all-reduce hook (torch's allreduce_hook or _allreduce_fut, or the course's): "
    "the exercise is to write the all-reduce and the averaging yourself"
)


def check_mean_allreduce_hook(fn: CommHook) -> None:
    """fn as torch DDP's communication hook must give the same gradients as DDP's built-in all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import _allreduce_fut, allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib.models import MLP

    ready_made = (allreduce_hook, _allreduce_fut, timed_allreduce_hook, recording_hook)

    def learners_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        with refusing(*ready_made, why=_WRITE_THE_HOOK):  # in the thread that runs hooks
            return fn(state, bucket)

    model = DDP(MLP(seed=0).to(rank_device()))
    model.register_comm_hook(None, learners_hook)
    try:
        _compare_with_torch_ddp(model)
    finally:
        del model


def check_accumulate_step(fn: Callable[..., None]) -> None:
    """Checker: 2 accumulated micro-batches equal DDP's full-batch step: one all-reduce a step, one backward each."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib.models import MLP

    syncs: list[tuple[int, int, float, float]] = []
    model = DDP(MLP(seed=0).to(rank_device()))  # 60 kB of gradients: one bucket
    model.register_comm_hook(None, timed_allreduce_hook(syncs))
    backwards: list[int] = []  # one entry per backward pass that reached the first layer's weight
    model.module[0].weight.register_post_accumulate_grad_hook(lambda param: backwards.append(1))
    reference = DDP(MLP(seed=0).to(rank_device()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    try:
        for step, (x, y) in enumerate(_exercise_batches()):
            syncs.clear()
            backwards.clear()
            fn(model, [(x[:8], y[:8]), (x[8:], y[8:])], opt)
            opt_ref.zero_grad(set_to_none=True)
            nn.functional.mse_loss(reference(x), y).backward()
            opt_ref.step()
            if len(backwards) != 2:
                raise ExerciseFailed(
                    f"step {step}: {len(backwards)} backward pass(es) for 2 micro-batches: one forward and backward "
                    "on the micro-batches joined (torch.cat) is one big batch, not accumulation; the exercise is "
                    "a backward per micro-batch, all but the last under no_sync()"
                )
            if not syncs:
                raise ExerciseFailed(f"step {step}: no all-reduce ran, so this rank stepped with its own gradient")
            if len(syncs) > 1:
                raise ExerciseFailed(
                    f"step {step}: DDP all-reduced {len(syncs)} times for 2 micro-batches; accumulation should "
                    "communicate once per optimizer step"
                )
            for (name, p), q in zip(model.module.named_parameters(), reference.module.parameters()):
                expect_equal(
                    f"step {step}: {name} after your step (torch DDP on the whole batch)",
                    p.detach(),
                    q.detach(),
                    atol=1e-5,
                    rtol=1e-4,
                )
    finally:
        del model, reference
