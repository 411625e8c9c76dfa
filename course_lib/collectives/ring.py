"""Notebook 01: collectives from point-to-point messages, their cost model, and a benchmark.

The ring algorithms here are built from send/recv only, so every byte they move
is visible. They are the two halves later notebooks reuse (FSDP shards
parameters with :func:`ring_all_gather` and gradients with
:func:`ring_reduce_scatter`):

* :func:`ring_reduce_scatter` (tensor) -> this rank's chunk of the reduced tensor
* :func:`ring_all_gather` (chunk, sizes) -> the full flat tensor, every rank's chunk in rank order
* :func:`ring_all_reduce` (tensor) -> the same tensor, reduced in place (reduce-scatter, then all-gather)

Chunks follow ``torch.tensor_split(flat, world_size)``: when the number of
elements is not divisible by the world size, the first ``numel % world_size``
chunks hold one element more (see :func:`chunk_sizes`). Every rank can compute
every chunk's size, so no sizes need to be exchanged.

:func:`ring_step` is the schedule (which chunk each rank sends and receives at
step k); the implementation and the notebook's step-by-step figure both use it.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from course_lib.exercises import ExerciseFailed, expect_equal

# Bytes this process handed to dist.isend in the from-scratch algorithms (see reset_traffic).
_traffic = {"bytes_sent": 0, "messages": 0}
# While record_steps() is active: (phase, step, copy of the flat buffer) after every ring step.
_recorded_steps: list | None = None


# ---------------------------------------------------------------------------
# Chunks and the ring schedule


def chunk_sizes(numel: int, world_size: int) -> list[int]:
    """Element count of each rank's chunk, as torch.tensor_split cuts: the first numel % N get one more."""
    base, extra = divmod(numel, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def chunk_offsets(sizes: Sequence[int]) -> list[int]:
    """Start of each chunk in the flat tensor, plus the end: offsets[r]:offsets[r + 1] is chunk r."""
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    return offsets


def ring_step(rank: int, world_size: int, step: int, phase: str) -> tuple[int, int]:
    """(chunk this rank sends to rank+1, chunk it receives from rank-1) at `step` of a ring phase.

    phase "reduce_scatter": steps 0..N-2; the received chunk is added to the local one.
      After the last step rank r holds the fully reduced chunk r.
    phase "all_gather": steps 0..N-2; rank r starts with chunk r and the received chunk replaces
      the local one. After the last step every rank holds every chunk.
    """
    n = world_size
    if phase == "reduce_scatter":
        return (rank - step - 1) % n, (rank - step - 2) % n
    if phase == "all_gather":
        return (rank - step) % n, (rank - step - 1) % n
    raise ValueError(f"phase must be 'reduce_scatter' or 'all_gather', got {phase!r}")


# ---------------------------------------------------------------------------
# Point-to-point plumbing


def reset_traffic() -> None:
    """Zero the counter of bytes this rank sent in the from-scratch algorithms."""
    _traffic.update(bytes_sent=0, messages=0)


def traffic() -> dict[str, int]:
    """Bytes and messages this rank sent since reset_traffic()."""
    return dict(_traffic)


class record_steps:
    """Context manager: ``with record_steps() as steps:`` collects (phase, step, buffer copy) after
    every ring step of this rank, so the notebook can compare the real ring with the picture."""

    def __enter__(self) -> list:
        global _recorded_steps
        _recorded_steps = []
        return _recorded_steps

    def __exit__(self, *exc) -> None:
        global _recorded_steps
        _recorded_steps = None


def _after_step(phase: str, step: int, flat: torch.Tensor) -> None:
    if _recorded_steps is not None:
        _recorded_steps.append((phase, step, flat.detach().cpu().clone()))


def _peer(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def send_recv(
    send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group: dist.ProcessGroup | None = None
) -> None:
    """Send `send` to dst while receiving `recv` from src, both at once.

    batch_isend_irecv posts both before waiting, so a ring where every rank sends
    to its right and receives from its left cannot deadlock (on NCCL it also
    groups them into one launch). Empty tensors are skipped: both sides know the
    chunk sizes, so they skip the same message.
    """
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, _peer(group, dst), group))
        _traffic["bytes_sent"] += send.numel() * send.element_size()
        _traffic["messages"] += 1
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, _peer(group, src), group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


_COMBINE = {
    "SUM": torch.Tensor.add_,
    "AVG": torch.Tensor.add_,  # summed on the ring, divided once at the end
    "MAX": lambda a, b: torch.maximum(a, b, out=a),
    "MIN": lambda a, b: torch.minimum(a, b, out=a),
}


def _op_name(op) -> str:
    for name in _COMBINE:
        if op == getattr(dist.ReduceOp, name):
            return name
    raise ValueError(f"the ring supports ReduceOp SUM, AVG, MAX and MIN, got {op}")


def _ring_reduce_scatter_(
    flat: torch.Tensor, offsets: list[int], op_name: str, group: dist.ProcessGroup | None = None
) -> None:
    """In place on the flat buffer: afterwards chunk `rank` holds the reduction over all ranks."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    combine = _COMBINE[op_name]
    incoming = torch.empty(max(b - a for a, b in itertools.pairwise(offsets)), dtype=flat.dtype, device=flat.device)
    for step in range(n - 1):
        send_chunk, recv_chunk = ring_step(rank, n, step, "reduce_scatter")
        start, end = offsets[recv_chunk], offsets[recv_chunk + 1]
        received = incoming[: end - start]
        send_recv(flat[offsets[send_chunk] : offsets[send_chunk + 1]], (rank + 1) % n, received, (rank - 1) % n, group)
        combine(flat[start:end], received)  # add what the left neighbour has accumulated so far
        _after_step("reduce_scatter", step, flat)
    if op_name == "AVG":
        flat[offsets[rank] : offsets[rank + 1]].div_(n)


def _ring_all_gather_(flat: torch.Tensor, offsets: list[int], group: dist.ProcessGroup | None = None) -> None:
    """In place on the flat buffer: chunk `rank` is valid before; every chunk is valid after."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    for step in range(n - 1):
        send_chunk, recv_chunk = ring_step(rank, n, step, "all_gather")
        send_recv(
            flat[offsets[send_chunk] : offsets[send_chunk + 1]],
            (rank + 1) % n,
            flat[offsets[recv_chunk] : offsets[recv_chunk + 1]],
            (rank - 1) % n,
            group,
        )
        _after_step("all_gather", step, flat)


# ---------------------------------------------------------------------------
# The from-scratch collectives


def ring_reduce_scatter(
    tensor: torch.Tensor, op=dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Reduce `tensor` over all ranks and return this rank's chunk (1-D), with a ring of send/recv.

    Chunk r is ``torch.tensor_split(tensor.flatten(), N)[r]`` of the reduced tensor: sizes need
    not divide evenly. `tensor` is left unchanged. Each rank sends (N-1) chunks: (N-1)/N of the data.
    """
    n = dist.get_world_size(group)
    offsets = chunk_offsets(chunk_sizes(tensor.numel(), n))
    flat = tensor.detach().reshape(-1).clone()
    _ring_reduce_scatter_(flat, offsets, _op_name(op), group)
    rank = dist.get_rank(group)
    return flat[offsets[rank] : offsets[rank + 1]].clone()


def ring_all_gather(
    chunk: torch.Tensor, sizes: Sequence[int] | None = None, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Concatenate every rank's `chunk` in rank order, on every rank, with a ring of send/recv.

    `sizes[r]` is the element count of rank r's chunk (default: all equal to this chunk's);
    use ``chunk_sizes(numel, N)`` to undo :func:`ring_reduce_scatter`. Returns a new 1-D tensor.
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    sizes = [chunk.numel()] * n if sizes is None else list(sizes)
    if len(sizes) != n or sizes[rank] != chunk.numel():
        raise ValueError(
            f"rank {rank}: sizes {sizes} must list {n} chunk sizes, with sizes[{rank}] = "
            f"{chunk.numel()} (this rank's chunk)"
        )
    offsets = chunk_offsets(sizes)
    flat = torch.empty(offsets[-1], dtype=chunk.dtype, device=chunk.device)
    flat[offsets[rank] : offsets[rank + 1]] = chunk.detach().reshape(-1)
    _ring_all_gather_(flat, offsets, group)
    return flat


def ring_all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce `tensor` in place with a ring: reduce-scatter, then all-gather. Returns `tensor`.

    Works for any world size and any number of elements. Each rank sends 2(N-1)/N of the data,
    whatever N is: the reason the ring is bandwidth-optimal.
    """
    n = dist.get_world_size(group)
    if n == 1:
        return tensor
    offsets = chunk_offsets(chunk_sizes(tensor.numel(), n))
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    _ring_reduce_scatter_(flat, offsets, _op_name(op), group)
    _ring_all_gather_(flat, offsets, group)
    if flat.data_ptr() != tensor.data_ptr():  # non-contiguous input: we worked on a copy
        tensor.copy_(flat.view(tensor.shape))
    return tensor


def naive_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce (SUM) in place the simple way: every rank sends to rank 0, rank 0 sums and sends back.

    Rank 0 receives and sends (N-1) whole tensors: its link carries N-1 times what a ring rank
    sends, so the time grows with N while the ring's stays nearly flat.
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for src in range(1, n):
            dist.recv(incoming, _peer(group, src), group)
            tensor.add_(incoming)
        for dst in range(1, n):
            dist.send(tensor, _peer(group, dst), group)
            _traffic["bytes_sent"] += tensor.numel() * tensor.element_size()
            _traffic["messages"] += 1
    else:
        dist.send(tensor, _peer(group, 0), group)
        _traffic["bytes_sent"] += tensor.numel() * tensor.element_size()
        _traffic["messages"] += 1
        dist.recv(tensor, _peer(group, 0), group)
    return tensor


# ---------------------------------------------------------------------------
# Cost model


def bytes_sent_per_rank(collective: str, nbytes: float, world_size: int) -> float:
    """Bytes each rank sends, for a tensor of `nbytes` (the full, unsharded size), ring algorithms.

    all_reduce 2(N-1)/N; all_gather and reduce_scatter (N-1)/N; broadcast 1 (pipelined chain:
    every rank but the last forwards the whole tensor once); naive all-reduce: (N-1) at rank 0.
    """
    n = world_size
    factors = {
        "all_reduce": 2 * (n - 1) / n,
        "ring_all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "broadcast": 1.0,
        "naive_all_reduce": float(n - 1),
    }
    return factors[collective] * nbytes


def bus_factor(collective: str, world_size: int) -> float:
    """nccl-tests' bus bandwidth = algorithm bandwidth × this factor (size = the full tensor).

    The factor makes the bus bandwidth comparable to the link's peak whatever the collective
    and N: all_reduce 2(N-1)/N, all_gather and reduce_scatter (N-1)/N, broadcast 1.
    """
    n = world_size
    return {
        "all_reduce": 2 * (n - 1) / n,
        "ring_all_reduce": 2 * (n - 1) / n,
        "naive_all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "broadcast": 1.0,
    }[collective]


def alpha_beta_time(collective: str, nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """The alpha-beta model: messages × alpha (latency, s) + bytes sent × beta (s per byte = 1/bandwidth).

    Ring all-reduce sends 2(N-1) messages, all_gather / reduce_scatter N-1, broadcast (chain) N-1.
    """
    n = world_size
    messages = {
        "all_reduce": 2 * (n - 1),
        "ring_all_reduce": 2 * (n - 1),
        "all_gather": n - 1,
        "reduce_scatter": n - 1,
        "broadcast": n - 1,
        "naive_all_reduce": 2 * (n - 1),
    }[collective]
    return messages * alpha + bytes_sent_per_rank(collective, nbytes, n) * beta


def fit_alpha_beta(
    collective: str, nbytes: Sequence[float], seconds: Sequence[float], world_size: int
) -> tuple[float, float]:
    """Fit alpha (s) and beta (s/byte) of :func:`alpha_beta_time` to measured times.

    Least squares on the relative error, so the small messages (which fix alpha) count as much as
    the large ones (which fix beta). A negative estimate is clamped to zero.
    """
    import numpy as np

    messages = alpha_beta_time(collective, 1.0, world_size, 1.0, 0.0)
    per_byte = bytes_sent_per_rank(collective, 1.0, world_size)
    t = np.asarray(seconds, dtype=float)
    design = np.stack([np.full_like(t, messages), np.asarray(nbytes, float) * per_byte], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    return max(float(alpha), 0.0), max(float(beta), 0.0)


# ---------------------------------------------------------------------------
# Benchmark (runs on every rank)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
                _sync(device)
                dist.barrier()
                start = time.perf_counter()
                calls[name](full, shard)
                _sync(device)
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
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} GB"


# ---------------------------------------------------------------------------
# The ring, step by step (the notebook's explorer draws this)


def ring_all_reduce_states(world_size: int) -> list[dict]:
    """Simulate the ring all-reduce without any process: what each rank holds after each step.

    Returns one entry per step (2(N-1) steps, plus the start): `holds[r][c]` is the set of ranks
    whose contribution chunk c on rank r contains, and `sends[r]` the chunk rank r sends at this
    step (None at the start). Uses :func:`ring_step`, the schedule the real code runs.
    """
    n = world_size
    holds = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    states: list[dict[str, Any]] = [{"phase": "start", "step": None, "sends": [None] * n, "holds": holds}]
    for phase in ("reduce_scatter", "all_gather"):
        for step in range(n - 1):
            moves = [ring_step(r, n, step, phase) for r in range(n)]
            new = [row[:] for row in holds]
            for r in range(n):
                send_chunk = moves[r][0]
                receiver = (r + 1) % n
                assert moves[receiver][1] == send_chunk  # the schedule pairs every send with a receive
                incoming = holds[r][send_chunk]
                new[receiver][send_chunk] = (
                    holds[receiver][send_chunk] | incoming if phase == "reduce_scatter" else incoming
                )
            holds = new
            states.append({"phase": phase, "step": step, "sends": [m[0] for m in moves], "holds": holds})
    return states


def draw_ring_step(world_size: int, step: int, ax=None):
    """Grid of ranks × chunks after `step` (0 = start) of the ring all-reduce; arrows: what was sent.

    A cell's shade is how many ranks' contributions it holds (dark = all N: fully reduced).
    """
    import matplotlib.pyplot as plt

    states = ring_all_reduce_states(world_size)
    step = max(0, min(step, len(states) - 1))
    state = states[step]
    n = world_size
    if ax is None:
        _, ax = plt.subplots(figsize=(1.2 + 0.9 * n, 0.8 + 0.7 * n))
    cmap = plt.cm.Blues
    for r in range(n):
        for c in range(n):
            count = len(state["holds"][r][c])
            ax.add_patch(plt.Rectangle((c, n - 1 - r), 0.94, 0.9, color=cmap(0.15 + 0.8 * count / n)))
            label = "Σ" if count == n else "+".join(str(k) for k in sorted(state["holds"][r][c]))
            ax.text(
                c + 0.47,
                n - 0.45 - r,
                label,
                ha="center",
                va="center",
                fontsize=8,
                color="white" if count == n else "black",
            )
        sent = state["sends"][r]
        if sent is not None:  # framed in red, with its destination: what rank r sent at this step
            ax.add_patch(plt.Rectangle((sent, n - 1 - r), 0.94, 0.9, fill=False, edgecolor="crimson", lw=2))
            ax.text(
                sent + 0.47,
                n - 0.8 - r,
                f"sent → r{(r + 1) % n}",
                ha="center",
                va="center",
                fontsize=7,
                color="crimson",
                bbox=dict(facecolor="white", edgecolor="none", pad=1),
            )
    ax.set_xlim(0, n)
    ax.set_ylim(0, n)
    ax.set_xticks([c + 0.47 for c in range(n)], [f"chunk {c}" for c in range(n)], fontsize=8)
    ax.set_yticks([n - 0.55 - r for r in range(n)], [f"rank {r}" for r in range(n)], fontsize=8)
    what = (
        "start: rank r holds only its own data"
        if state["step"] is None
        else (f"{state['phase'].replace('_', '-')} step {state['step'] + 1} of {n - 1}")
    )
    ax.set_title(f"ring all-reduce, N = {n}: {what}", fontsize=9)
    return ax


# ---------------------------------------------------------------------------
# Pictures of who holds what


def draw_holdings(ax, values: Sequence, title: str, vmax: float | None = None, columns: int | None = None) -> None:
    """One row per rank, one cell per element, the value written in it; None = nothing defined.

    `columns` fixes the width (in cells) so panels of different lengths share one scale.
    """
    import matplotlib.pyplot as plt

    rows = [None if v is None else [float(x) for x in torch.as_tensor(v).reshape(-1)] for v in values]
    width = max([len(r) for r in rows if r is not None] + [columns or 1])
    top = vmax or max((max(r) for r in rows if r), default=1.0) or 1.0
    for i, row in enumerate(rows):
        y = len(rows) - 1 - i
        if row is None:
            ax.text(width / 2, y + 0.45, "(unspecified)", ha="center", va="center", fontsize=7, color="gray")
            continue
        for j, value in enumerate(row):
            ax.add_patch(plt.Rectangle((j, y), 0.94, 0.9, color=plt.cm.YlGn(0.1 + 0.7 * value / top)))
            ax.text(j + 0.47, y + 0.45, f"{value:g}", ha="center", va="center", fontsize=7)
    ax.set_xlim(0, width)
    ax.set_ylim(0, len(rows))
    ax.set_yticks([len(rows) - 0.55 - i for i in range(len(rows))], [f"r{i}" for i in range(len(rows))], fontsize=7)
    ax.set_xticks([])
    ax.set_title(title, fontsize=8)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)


# ---------------------------------------------------------------------------
# Exercises


def solution_reduce_scatter(tensor: torch.Tensor) -> torch.Tensor:
    """Reference solution of the exercise: this rank's chunk of the sum, from send/recv."""
    return ring_reduce_scatter(tensor)


def solution_all_gather(chunk: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    return ring_all_gather(chunk, sizes)


_FORBIDDEN = (
    "all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "broadcast",
    "all_to_all",
    "all_to_all_single",
    "all_gather_object",
)


class _OnlyPointToPoint:
    """While active, torch's collectives raise: the exercise is to build one from send/recv."""

    def __enter__(self):
        self.saved = {name: getattr(dist, name) for name in _FORBIDDEN if hasattr(dist, name)}
        for name in self.saved:

            def refuse(*args, _name=name, **kwargs):
                raise ExerciseFailed(
                    f"dist.{_name} is not allowed here: use dist.send/recv, isend/irecv or batch_isend_irecv"
                )

            setattr(dist, name, refuse)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)
        return False


# Sizes the checks try: divisible, not divisible, fewer elements than ranks are added per N.
def _check_sizes(n: int) -> list[int]:
    return [4 * n, 4 * n + 1, 2 * n + n - 1, 1, 37]


def _rank_data(numel: int, rank: int) -> torch.Tensor:
    # Whole numbers: the sum is exact in any order, so any correct algorithm matches exactly.
    gen = torch.Generator().manual_seed(1000 * numel + rank)
    data = torch.randint(-9, 10, (numel,), generator=gen).float()
    # NCCL moves only GPU tensors: put the data where this rank's backend can send it.
    return data.cuda() if dist.get_backend() == "nccl" else data


def check_reduce_scatter(fn) -> None:
    """fn(tensor) on every rank must return chunk `rank` of the sum, cut as torch.tensor_split does."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for numel in _check_sizes(n):
        data = _rank_data(numel, rank)
        total = data.clone()
        dist.all_reduce(total)
        expected = torch.tensor_split(total, n)[rank]
        with _OnlyPointToPoint():
            got = fn(data.clone())
        expect_equal(
            f"reduce_scatter of {numel} elements on {n} ranks (chunk {rank})",
            got.reshape(-1) if isinstance(got, torch.Tensor) else got,
            expected,
        )


def check_all_gather(fn) -> None:
    """fn(chunk, sizes) on every rank must return all chunks concatenated in rank order."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for numel in _check_sizes(n):
        full = _rank_data(numel, 0)  # the same on every rank: the expected answer
        sizes = chunk_sizes(numel, n)
        chunk = torch.tensor_split(full, n)[rank].clone()
        with _OnlyPointToPoint():
            got = fn(chunk, sizes)
        expect_equal(
            f"all_gather of {numel} elements on {n} ranks (chunk sizes {sizes})",
            got.reshape(-1) if isinstance(got, torch.Tensor) else got,
            full,
        )
