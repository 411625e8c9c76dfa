"""Time, throughput and memory per training step, on one rank."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from course_lib.launch.runtime import synchronize


def memory_mb(device: torch.device | str = "cpu") -> float:
    """Memory this rank holds now: CUDA tensors on a GPU, the process's resident set on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    import psutil

    return psutil.Process().memory_info().rss / 2**20


@dataclass
class StepMonitor:
    """Per-step wall time, throughput (samples/s) and memory on one rank.

    ``with monitor.step(samples):`` around each training step. On a GPU the step is closed with a
    synchronize, so the time covers the kernels and not only their launch.
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seconds: list[float] = field(default_factory=list)
    samples_per_s: list[float] = field(default_factory=list)
    memory_mb: list[float] = field(default_factory=list)

    def step(self, samples: int) -> _TimedStep:
        return _TimedStep(self, samples)

    def as_dict(self) -> dict[str, list[float]]:
        return {"seconds": self.seconds, "samples_per_s": self.samples_per_s, "memory_mb": self.memory_mb}


class _TimedStep:
    def __init__(self, monitor: StepMonitor, samples: int):
        self.monitor, self.samples = monitor, samples

    def __enter__(self) -> _TimedStep:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        synchronize(self.monitor.device)
        elapsed = time.perf_counter() - self.start
        self.monitor.seconds.append(elapsed)
        self.monitor.samples_per_s.append(self.samples / elapsed)
        self.monitor.memory_mb.append(memory_mb(self.monitor.device))
