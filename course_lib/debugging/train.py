"""The training run notebook 12 monitors: DDP on the course MLP, one line printed per step."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib.debugging.monitor import StepMonitor


def train_monitored(
    steps: int, batch: int, device: torch.device | str = "cpu", report: bool = True, lr: float = 1e-2
) -> StepMonitor:
    """DDP-train course_lib.models.MLP on the regression data for `steps` steps of `batch` samples per rank.

    With `report`, each step prints one line ``step I SECONDS s MEMORY MB LOSS`` that a live plot in the
    notebook can follow while the run goes on.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib.data import batch_for_step, regression
    from course_lib.models import MLP

    device = torch.device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = regression(n=batch * world * 4)
    model = DDP(MLP().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    monitor = StepMonitor(device)
    for i in range(steps):
        x, y = (t.to(device) for t in batch_for_step(data, i, batch * world, rank, world, shuffle_seed=None))
        with monitor.step(batch):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        if report:
            print(f"step {i} {monitor.seconds[-1]:.6f} s {monitor.memory_mb[-1]:.3f} MB {loss.item():.6f}", flush=True)
    return monitor
