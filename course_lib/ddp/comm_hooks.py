"""DDP comm hooks (fp16, bf16, PowerSGD) and their timing; no __future__ annotations: register_comm_hook checks them."""

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from course_lib.ddp.minimal_ddp import Stamp, on_host_clock, stamp, unwrap
from course_lib.ddp.train import TrainLog, train

CommHook = Callable[[object, dist.GradBucket], torch.futures.Future[torch.Tensor]]

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


def bf16_compress_hook_any_backend(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16_compress_hook renamed: torch refuses that name unless CUDA + NCCL >= 2.10; gloo does bfloat16."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def attach_comm_hook(ddp_model: DistributedDataParallel, name: str, powersgd_rank: int = 2) -> object:
    """Register one of torch's compression hooks on a torch DDP model; returns the hook's state."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "none":
        return None
    if name == "fp16":
        ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if name == "bf16":
        native = torch.cuda.is_available() and "nccl" in str(dist.get_backend())
        ddp_model.register_comm_hook(
            None, default_hooks.bf16_compress_hook if native else bf16_compress_hook_any_backend
        )
        return None
    if name == "powersgd":
        # start_powerSGD_iter=2: the first two steps are exact (PowerSGD's default waits 1000 steps
        # to get past the fast-changing start of training; our runs are much shorter).
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=2,
            min_compression_rate=2.0,
            random_seed=0,
        )
        ddp_model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    raise ValueError(f"unknown hook {name!r}; choose from {COMM_HOOKS}")


def payload_bytes(model: nn.Module, hook: str, powersgd_rank: int = 2, min_compression_rate: float = 2.0) -> int:
    """Bytes each all-reduce step hands to the network per rank, before the ring's 2(N-1)/N factor."""
    params = list(unwrap(model).parameters())
    if hook == "none":
        return sum(p.numel() * 4 for p in params)
    if hook in ("fp16", "bf16"):
        return sum(p.numel() * 2 for p in params)
    if hook == "powersgd":
        total = 0
        for p in params:
            n, m = p.shape[0], p.numel() // p.shape[0]
            r = min(n, m, powersgd_rank)
            compressed = (n + m) * r
            # PowerSGD compresses a matrix into P (n x r) and Q (m x r) only where that saves enough.
            total += 4 * (compressed if p.dim() > 1 and n * m >= min_compression_rate * compressed else p.numel())
        return total
    raise ValueError(hook)


def gradient_error(
    model: nn.Module, hook: str, x: torch.Tensor, y: torch.Tensor, repeats: int = 3, powersgd_rank: int = 2
) -> float:
    """Relative error ||g_hook - g_exact|| / ||g_exact|| of the averaged gradient, at the same weights."""
    exact = DistributedDataParallel(copy.deepcopy(unwrap(model)))
    compressed = DistributedDataParallel(copy.deepcopy(unwrap(model)))
    attach_comm_hook(compressed, hook, powersgd_rank)
    for _ in range(repeats):
        for m in (exact, compressed):
            m.zero_grad(set_to_none=True)
            nn.functional.mse_loss(m(x), y).backward()
    g_exact = torch.cat([p.grad.reshape(-1) for p in exact.parameters() if p.grad is not None])
    g_hook = torch.cat([p.grad.reshape(-1) for p in compressed.parameters() if p.grad is not None])
    return ((g_hook - g_exact).norm() / g_exact.norm()).item()


def train_with_hook(
    hook: str, dataset: Dataset, device: torch.device, powersgd_rank: int = 2, **train_kwargs: Any
) -> tuple[TrainLog, nn.Module]:
    """Train the course MLP under torch DDP with one of COMM_HOOKS; returns the log and the plain model."""
    from course_lib.models import MLP

    model = DistributedDataParallel(MLP().to(device))
    attach_comm_hook(model, hook, powersgd_rank)
    log = train(model, dataset, **train_kwargs)
    return log, model.module


def timed_allreduce_hook(events: list[tuple[int, int, float, float]]) -> CommHook:
    """A DDP comm hook that all-reduces (mean) and records (bucket, bytes, start, end) in perf_counter seconds."""
    pending: list[tuple[int, int, Stamp, Stamp]] = []  # this step's rows on CUDA, until its last bucket

    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer().div_(dist.get_world_size())
        start = stamp(buffer.device)
        future = dist.all_reduce(buffer, async_op=True).get_future()

        def done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            row: tuple[int, int, Any, Any] = (bucket.index(), buffer.nbytes, start, stamp(buffer.device))
            if buffer.device.type != "cuda":
                events.append(row)  # gloo: runs when the all-reduce has finished
            else:
                pending.append(row)
                if bucket.is_last():
                    events.extend(on_host_clock(pending))
                    pending.clear()
            return fut.value()[0]

        return future.then(done)

    return hook


def recording_hook(model: nn.Module, buckets: dict[int, list[str]]) -> CommHook:
    """A torch DDP comm hook that averages each bucket as DDP does and records what it carries."""
    names = {id(p): name for name, p in unwrap(model).named_parameters()}

    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buckets[bucket.index()] = [names[id(p)] for p in bucket.parameters()]
        buffer = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])

    return hook
