"""Notebook 14's monitored DDP run (a line per step), and a slow rank that all others wait for in the all-reduce."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from course_lib.debugging.lab import StepMonitor
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


def train_monitored(
    steps: int, batch: int, device: torch.device | str = "cpu", report: bool = True, lr: float = 1e-2
) -> StepMonitor:
    """DDP-train course_lib.models.MLP on the regression data for `steps` steps of `batch` samples per rank.

    With `report`, each step prints one line ``step I SECONDS s MEMORY MB LOSS`` that a live plot in the
    notebook can follow while the run goes on.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib import training
    from course_lib.data import regression
    from course_lib.models import MLP

    device = torch.device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(MLP().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    monitor = StepMonitor(device)

    def print_step(step: int, loss: float) -> None:
        print(f"step {step} {monitor.seconds[-1]:.6f} s {monitor.memory_mb[-1]:.3f} MB {loss:.6f}", flush=True)

    training.train(
        model, torch.optim.SGD(model.parameters(), lr=lr), regression(n=batch * world * 4), steps, batch * world,
        rank=rank, world_size=world, shuffle_seed=None, device=device,
        around_step=lambda: monitor.step(batch), after_step=print_step if report else None,
    )  # fmt: skip
    return monitor
