"""The training run notebook 14 monitors: DDP on the course MLP, one line printed per step."""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.debugging.lab import StepMonitor


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
