"""A real out-of-memory under a memory limit set for this process, the bytes per GPU estimated, the ladder of fixes."""

from __future__ import annotations

import re
import resource
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from course_lib import models
from course_lib.activations.formulas import course_block_bytes, selective_block_bytes, stack_bytes
from course_lib.memory import GB, zero_bytes_per_gpu
from course_lib.models import ModelShape

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


# The out-of-memory procedure: estimate bytes per GPU (ZeRO's states + activations per layer times the layers), then
# climb the ladder of fixes; each rung keeps the previous ones and changes one thing, cheapest first.


@dataclass(frozen=True)
class Setup(ModelShape):
    """A 7B-like stack of course TransformerBlocks (d_ff = 4h), trained with bf16 mixed precision and Adam."""

    n_params: float | None = None
    n_layers: int = 32
    d_model: int = 4096
    n_heads: int = 32
    micro_batch: int = 4
    gpus: int = 8
    recompute: str = "none"  # none | selective | full
    zero_stage: int = 0
    offload_optimizer: bool = False
    tensor_parallel: int = 1  # with sequence parallelism

    @property
    def parameters(self) -> float:
        return models.parameters(self)  # attention 4h², feed-forward 8h² and norms 2h per layer


def estimate(setup: Setup, element_bytes: int = 2, stats_bytes: int = 4) -> dict[str, float]:
    """Bytes per GPU: parameters, gradients, optimizer state (ZeRO over the data-parallel GPUs) and activations."""
    t = setup.tensor_parallel
    states = zero_bytes_per_gpu(setup.parameters / t, setup.gpus // t, setup.zero_stage)
    if setup.offload_optimizer:
        states["optimizer"] = 0.0  # lives in CPU memory; the CPU runs the Adam step
    s, b, h = setup.seq, setup.micro_batch, setup.d_model
    shape: dict[str, Any] = {"h": h, "a": setup.n_heads, "d_ff": setup.ffn, "element_bytes": element_bytes}
    per_layer = course_block_bytes(s, b, **shape, stats_bytes=stats_bytes, t=t, sequence_parallel=True)
    block_input = element_bytes * s * b * h / t
    selective = selective_block_bytes(s, b, h, setup.n_heads, setup.ffn, element_bytes=element_bytes) / t
    activations = stack_bytes(per_layer, setup.n_layers, block_input, setup.recompute, selective)["peak"]
    out = {part: states[part] for part in ("params", "grads", "optimizer")} | {"activations": activations}
    out["total"] = sum(out.values())
    return out


RUNGS: list[tuple[str, dict[str, Any], str]] = [
    (
        "smaller micro-batch (4 -> 1)",
        {"micro_batch": 1},
        "4x the accumulation steps; smaller matmuls run less efficiently",
    ),
    ("full recomputation", {"recompute": "full"}, "one more forward per step: about +33% compute"),
    ("ZeRO-3 / FSDP over the GPUs", {"zero_stage": 3}, "all-gathers every layer's weights twice: 1.5x DDP's traffic"),
    ("offload the optimizer state", {"offload_optimizer": True}, "states cross PCIe every step; the CPU runs Adam"),
    ("tensor + sequence parallel (t = 8)", {"tensor_parallel": 8}, "collectives inside every layer: NVLink only"),
]


def ladder(setup: Setup, gpu_bytes: float = 80 * GB) -> list[dict[str, Any]]:
    """The baseline, then each rung of RUNGS applied on top of the previous ones: bytes per GPU, fits, cost."""
    rows: list[dict[str, Any]] = [{"rung": "baseline (DDP)", "setup": setup, **estimate(setup), "cost": "-"}]
    for name, change, cost in RUNGS:
        setup = replace(setup, **change)
        rows.append({"rung": name, "setup": setup, **estimate(setup), "cost": cost})
    for row in rows:
        row["fits"] = row["total"] <= gpu_bytes
    return rows
