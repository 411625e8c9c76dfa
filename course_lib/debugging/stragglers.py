"""A straggler: one slow rank, and every other rank waiting for it in the gradient all-reduce."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from course_lib.launch.runtime import synchronize


def straggler_steps(
    steps: int, slow_rank: int, delay_s: float, batch: int = 32, device: torch.device | str = "cpu"
) -> dict[str, list[float]]:
    """Train course_lib.models.MLP for `steps` steps, averaging gradients with one all-reduce per step.

    Rank `slow_rank` sleeps `delay_s` in every step's work (a stand-in for a slower GPU, a throttled
    CPU, a noisy neighbour, a slow data loader). Returns this rank's seconds per step: "work" (forward,
    backward, the sleep), "wait" (in the all-reduce: waiting for the last rank, then the transfer) and "step".
    """
    from course_lib.data import batch_for_step, regression
    from course_lib.models import MLP

    device = torch.device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = regression(n=batch * world)
    x, y = (t.to(device) for t in batch_for_step(data, 0, batch * world, rank, world, shuffle_seed=None))
    model = MLP().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    times: dict[str, list[float]] = {"work": [], "wait": [], "step": []}
    for _ in range(steps):
        synchronize(device)
        begin = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if rank == slow_rank:
            time.sleep(delay_s)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        synchronize(device)
        arrived = time.perf_counter()
        dist.all_reduce(flat)  # returns when the last rank has arrived and the sum is back
        synchronize(device)
        done = time.perf_counter()
        for g, mean in zip(grads, (flat / world).split([g.numel() for g in grads])):
            g.copy_(mean.view_as(g))
        optimizer.step()
        times["work"].append(arrived - begin)
        times["wait"].append(done - arrived)
        times["step"].append(done - begin)
    return times
