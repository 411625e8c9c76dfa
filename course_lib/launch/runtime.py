"""Inside a rank: process-group set-up and tear-down, device choice, seeding.

A `%%torchrun` cell gets all of it from here, so a `--save`d script does the same via init_distributed and shutdown."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from course_lib.launch.spec import NCCL_PROCESS_GROUP, resolve_backend


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def init_distributed(backend: str = "auto", timeout_s: float = 300.0, seed: int | None = 0) -> RankContext:
    """Join the process group torchrun described in the environment.

    NCCL ranks get one GPU each (cuda:LOCAL_RANK) and a group that serves CPU tensors too
    (gloo under NCCL_PROCESS_GROUP), with TF32 off (fp32_in_ieee) so that float32 means float32 on every device;
    gloo ranks run on the CPU. `seed` seeds every RNG identically on all ranks (None leaves them
    alone); use `seed + rank` in the cell when ranks should draw different numbers.

    A group that torchrun restarted needs a store of its own: the course's agents that may restart run with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so rank 0 of each rendezvous round hosts a fresh one. On the
    agent's shared store (torch's default) a restart is refused with that advice, since a key prefix per
    attempt cannot be agreed on: TORCHELASTIC_RESTART_COUNT counts each node's own failures, so after one
    node fails the nodes disagree on it.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = resolve_backend(backend, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # binds the communicator eagerly; CPU ranks must not pass it
        fp32_in_ieee()  # the course's tolerances are float32's
    else:
        device = torch.device("cpu")
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if restarted and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise RuntimeError(
            "this group was restarted on torchrun's shared store, which still holds the previous group's addresses "
            "under the same keys: start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment"
        )
    group_backend = NCCL_PROCESS_GROUP if backend == "nccl" else backend
    dist.init_process_group(group_backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    if seed is not None:
        seed_everything(seed)
    return RankContext(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def fp32_in_ieee() -> None:
    """float32 CUDA matmuls and cuDNN convolutions in IEEE float32, not TF32 (a no-op on the CPU).
    These setters keep legacy and fp32_precision flags alike: fp32_precision alone raises under NGC's TF32 override."""
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False


def rank_device() -> torch.device:
    """This rank's device: its GPU under NCCL (set by init_distributed), else the CPU."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for `device`'s queued kernels (current CUDA device if None): else a clock read times only the launch."""
    if device is None:
        in_use = torch.cuda.is_available() and torch.cuda.is_initialized()
        device = torch.device("cuda", torch.cuda.current_device()) if in_use else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_in_turns(
    steps: dict[str, Callable[[], object]],
    repeats: int = 30,
    warmup: int = 3,
    statistic: Callable[[list[float]], float] = min,
) -> dict[str, float]:
    """Each step's wall time, run in turns (a, b, c, a, ...) under the same load: `statistic` (fastest) of `repeats`."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for turn in range(warmup + repeats):
        for name, step in steps.items():
            synchronize()
            start = time.perf_counter()
            step()
            synchronize()
            if turn >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistic(t) for name, t in times.items()}


@contextmanager
def fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """Be rank `rank` of `world_size` on torch's fake backend (collectives move nothing): what a rank builds."""
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore  # where torchtitan's dry runs take it from

    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a process group: simulate in one that has none "
            "(the notebook's kernel, not a %%torchrun cell)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        # the next rank's meshes equal this one's (same layout), so DTensor's caches would hand it this rank's
        # decisions, process groups included
        _clear_sharding_prop_cache()
        clear_redistribute_planner_cache()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def shutdown() -> None:
    """Destroy a leftover process group, collecting cycles that hold work on it first (freed at exit, they abort)."""
    import gc

    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
