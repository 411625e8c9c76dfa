"""Notebook 02's exercises: the reference solutions and the checkers that run them on every rank.

Both exercises are judged the same way: a few SGD steps next to torch DDP, whose gradients (the
average over ranks) the candidate must reproduce. No ``from __future__ import annotations``: the
reference hook goes to DDP's register_comm_hook, which compares its annotations with real classes.
"""

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from course_lib.ddp.comm_hooks import CommHook
from course_lib.ddp.minimal_ddp import unwrap
from course_lib.ddp.train import rank_loader
from course_lib.exercises import ExerciseFailed, expect_equal
from course_lib.launch.runtime import rank_device


def solution_average_gradient(param: torch.Tensor) -> None:
    assert param.grad is not None
    dist.all_reduce(param.grad)
    param.grad /= dist.get_world_size()


def solution_mean_allreduce_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer() / dist.get_world_size()
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


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


def check_mean_allreduce_hook(fn: CommHook) -> None:
    """fn as torch DDP's communication hook must give the same gradients as DDP's built-in all-reduce."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib.models import MLP

    model = DDP(MLP(seed=0).to(rank_device()))
    model.register_comm_hook(None, fn)
    try:
        _compare_with_torch_ddp(model)
    finally:
        del model
