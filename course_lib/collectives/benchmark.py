"""Notebook 01: time torch's collectives and the from-scratch ring on every rank; the rows as a table."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from course_lib.collectives.cost import bus_factor
from course_lib.collectives.ring import naive_all_reduce, ring_all_reduce
from course_lib.launch.runtime import synchronize


def collective_calls(world_size: int) -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]:
    """name -> call(full, shard): full is the whole tensor (numel divisible by N), shard one N-th."""
    return {
        "all_reduce": lambda full, shard: dist.all_reduce(full),
        "ring_all_reduce": lambda full, shard: ring_all_reduce(full),
        "naive_all_reduce": lambda full, shard: naive_all_reduce(full),
        "all_gather": lambda full, shard: dist.all_gather_single(full, shard),
        "reduce_scatter": lambda full, shard: dist.reduce_scatter_single(shard, full),
        "broadcast": lambda full, shard: dist.broadcast(full, src=0),
    }


def benchmark(
    sizes_bytes: Sequence[int],
    names: Sequence[str],
    repeats: int = 5,
    device: torch.device | str = "cpu",
    warmup: int = 1,
) -> list[dict]:
    """Time each collective at each size on every rank; call on all ranks.

    Runs alternate (size by size, one run of each collective in turn, `repeats` rounds), so slow
    phases of a shared machine hit every collective alike. A run's time is the slowest rank's
    (all_reduce MAX). Returns, on every rank, one row per (name, size): median seconds, algorithm
    bandwidth size/time and bus bandwidth (nccl-tests conventions, size = full tensor bytes).
    """
    device = torch.device(device)
    n = dist.get_world_size()
    calls = collective_calls(n)
    rows = []
    for nbytes in sizes_bytes:
        numel = max(n, nbytes // 4 // n * n)  # float32, divisible by N
        full = torch.ones(numel, device=device)
        shard = torch.ones(numel // n, device=device)
        times: dict[str, list[float]] = {name: [] for name in names}
        for round_index in range(warmup + repeats):
            for name in names:
                full.fill_(1.0)
                synchronize(device)
                dist.barrier()
                start = time.perf_counter()
                calls[name](full, shard)
                synchronize(device)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the collective ends when the last rank is done
                if round_index >= warmup:
                    times[name].append(elapsed.item())
        size = numel * 4
        for name in names:
            seconds = statistics.median(times[name])
            algbw = size / seconds
            rows.append(
                {"name": name, "bytes": size, "seconds": seconds, "algbw": algbw, "busbw": algbw * bus_factor(name, n)}
            )
    return rows


def format_table(rows: Sequence[dict]) -> str:
    """Benchmark rows as a text table (time in µs, bandwidths in MB/s)."""
    lines = [f"{'collective':>17} {'size':>9} {'time':>12} {'algbw':>14} {'busbw':>14}"]
    for row in rows:
        lines.append(
            f"{row['name']:>17} {human_bytes(row['bytes']):>9} {row['seconds'] * 1e6:>9.0f} us "
            f"{row['algbw'] / 1e6:>9.1f} MB/s {row['busbw'] / 1e6:>9.1f} MB/s"
        )
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    """A byte count in B, KB, MB or GB (powers of 1024), for tables and titles."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} GB"
