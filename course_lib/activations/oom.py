"""A real out-of-memory under a memory limit set for this process, and the rungs of the ladder that fix it."""

from __future__ import annotations

import re
import resource
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

MiB = 2**20


def mapped_bytes() -> int:
    """This process's address space now (VmSize in /proc/self/status)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status: RLIMIT_AS limits need Linux")


@contextmanager
def memory_limit(extra_bytes: int, device: torch.device | None = None) -> Iterator[None]:
    """Let this process allocate at most `extra_bytes` more on `device` inside the block; the limit is lifted after.

    CPU: the soft RLIMIT_AS becomes the address space mapped now plus extra_bytes (the hard limit is untouched, so
    it can be raised back). CUDA: the caching allocator may hold what is allocated now plus extra_bytes.
    """
    device = device or torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = (torch.cuda.memory_allocated(device) + extra_bytes) / total
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped_bytes() + extra_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def is_out_of_memory(error: BaseException) -> bool:
    """torch's out-of-memory errors: CUDA's OutOfMemoryError, the CPU allocator's "can't allocate memory"."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error)
    )


def short_message(error: BaseException) -> str:
    """An OOM error's first line without what varies (source location, byte count, CUDA capacity), so runs compare."""
    first = str(error).strip().splitlines()[0]
    first = re.sub(r"\[enforce fail at [^\]]*\]\s*(err == 0\.\s*)?", "", first)
    first = re.sub(r":? ?you tried to allocate \d+ bytes.*", "", first)  # the CPU allocator
    first = re.sub(r"\s*Tried to allocate .*", "", first)  # CUDA's caching allocator
    return f"{type(error).__name__}: " + first.strip()


def oom_message(device: torch.device | str) -> str:
    """The short_message of an OOM under memory_limit on `device`'s type, to compare with attempt()'s error."""
    if torch.device(device).type == "cuda":
        return "OutOfMemoryError: CUDA out of memory."
    return "RuntimeError: DefaultCPUAllocator: can't allocate memory"


def allocation_scale(device: torch.device | str) -> int:
    """Scale for a limit to mean what it does on CPU: 16 on CUDA, whose allocator reserves 2 and 20 MiB segments."""
    return 16 if torch.device(device).type == "cuda" else 1


def attempt(step: Callable[[], Any]) -> dict[str, Any]:
    """{"ok": True, "value": step()}, or {"ok": False, "error": its short message} if it ran out of memory."""
    try:
        value = step()
    except Exception as error:  # only out-of-memory is expected here: anything else propagates
        if not is_out_of_memory(error):
            raise
        return {"ok": False, "error": short_message(error), "value": None}
    return {"ok": True, "error": "", "value": value}


def train_step(model: nn.Module, x: torch.Tensor, micro_batches: int = 1) -> float:
    """The model's gradients become those of the mean of model(x)² over the batch, accumulated over
    `micro_batches` slices of x.

    Each slice's loss is divided by the number of slices, so the summed gradients are those of the whole batch;
    only one slice's activations are alive at a time. Returns the loss (a float: no graph is kept).
    """
    model.zero_grad(set_to_none=True)
    total = 0.0
    for chunk in x.chunk(micro_batches):
        loss = model(chunk).float().square().mean() / micro_batches
        loss.backward()
        total += loss.item()
    return total


def unmap_freed_memory(threshold: int = 64 * 1024) -> None:
    """Make glibc mmap allocations from `threshold` and unmap them when freed, so a limit doesn't depend on history."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    if libc.mallopt(-3, threshold) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")
