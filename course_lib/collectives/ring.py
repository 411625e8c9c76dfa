"""Ring collectives from send/recv only, so every byte moved is visible; bytes per rank, the alpha-beta time model."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist

from course_lib import comms


def peer(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (send/recv address ranks globally)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def send_recv(
    send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group: dist.ProcessGroup | None = None
) -> None:
    """Send and receive at once: batch_isend_irecv posts both before waiting, so a ring of these cannot deadlock."""
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, peer(group, dst), group))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, peer(group, src), group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


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
# One ring step, and one ring phase, in place on a flat buffer


_COMBINE = {
    "SUM": torch.Tensor.add_,
    "AVG": torch.Tensor.add_,  # summed on the ring, divided once at the end
    "MAX": lambda a, b: torch.maximum(a, b, out=a),
    "MIN": lambda a, b: torch.minimum(a, b, out=a),
}


def _op_name(op: dist.ReduceOp.RedOpType) -> str:
    for name in _COMBINE:
        if op == getattr(dist.ReduceOp, name):
            return name
    raise ValueError(f"the ring supports ReduceOp SUM, AVG, MAX and MIN, got {op}")


def reduce_scatter_step_(
    flat: torch.Tensor,
    offsets: Sequence[int],
    step: int,
    op_name: str = "SUM",
    group: dist.ProcessGroup | None = None,
    scratch: torch.Tensor | None = None,
) -> None:
    """Step `step` of the ring reduce-scatter, in place on the flat buffer: send one chunk to the
    right neighbour, receive the left neighbour's partial chunk and combine it into this rank's copy.

    `scratch` (at least one chunk long) receives the incoming chunk; None allocates one.
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    send_chunk, recv_chunk = ring_step(rank, n, step, "reduce_scatter")
    start, end = offsets[recv_chunk], offsets[recv_chunk + 1]
    if scratch is None:
        scratch = torch.empty(end - start, dtype=flat.dtype, device=flat.device)
    received = scratch[: end - start]
    send_recv(flat[offsets[send_chunk] : offsets[send_chunk + 1]], (rank + 1) % n, received, (rank - 1) % n, group)
    _COMBINE[op_name](flat[start:end], received)  # add what the left neighbour has accumulated so far


def all_gather_step_(
    flat: torch.Tensor, offsets: Sequence[int], step: int, group: dist.ProcessGroup | None = None
) -> None:
    """Step `step` of the ring all-gather, in place: send a finished chunk to the right neighbour,
    receive the next finished chunk from the left one straight into its place (replacing a stale copy)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    send_chunk, recv_chunk = ring_step(rank, n, step, "all_gather")
    send_recv(
        flat[offsets[send_chunk] : offsets[send_chunk + 1]],
        (rank + 1) % n,
        flat[offsets[recv_chunk] : offsets[recv_chunk + 1]],
        (rank - 1) % n,
        group,
    )


def _ring_reduce_scatter_(
    flat: torch.Tensor, offsets: list[int], op_name: str, group: dist.ProcessGroup | None = None
) -> None:
    """In place on the flat buffer: afterwards chunk `rank` holds the reduction over all ranks."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    scratch = torch.empty(max(b - a for a, b in itertools.pairwise(offsets)), dtype=flat.dtype, device=flat.device)
    for step in range(n - 1):
        reduce_scatter_step_(flat, offsets, step, op_name, group, scratch)
    if op_name == "AVG":
        flat[offsets[rank] : offsets[rank + 1]].div_(n)


def _ring_all_gather_(flat: torch.Tensor, offsets: list[int], group: dist.ProcessGroup | None = None) -> None:
    """In place on the flat buffer: chunk `rank` is valid before; every chunk is valid after."""
    for step in range(dist.get_world_size(group) - 1):
        all_gather_step_(flat, offsets, step, group)


# ---------------------------------------------------------------------------
# The from-scratch collectives


def ring_reduce_scatter(
    tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Reduce `tensor` over all ranks and return this rank's chunk (1-D), with a ring of send/recv."""
    n = dist.get_world_size(group)
    offsets = chunk_offsets(chunk_sizes(tensor.numel(), n))
    flat = tensor.detach().reshape(-1).clone()
    with comms.collective("reduce_scatter", flat, group):
        _ring_reduce_scatter_(flat, offsets, _op_name(op), group)
    rank = dist.get_rank(group)
    return flat[offsets[rank] : offsets[rank + 1]].clone()


def ring_all_gather(
    chunk: torch.Tensor, sizes: Sequence[int] | None = None, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Concatenate every rank's `chunk` in rank order, on every rank, with a ring of send/recv."""
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
    with comms.collective("all_gather", flat, group):
        _ring_all_gather_(flat, offsets, group)
    return flat


def ring_all_reduce(
    tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-reduce `tensor` in place with a ring: reduce-scatter, then all-gather. Returns `tensor`.

    Works for any world size and any number of elements. Each rank sends 2(N-1)/N of the data,
    whatever N is: the reason the ring is bandwidth-optimal.
    """
    n = dist.get_world_size(group)
    offsets = chunk_offsets(chunk_sizes(tensor.numel(), n))
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    with comms.collective("all_reduce", flat, group):
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
            dist.recv(incoming, peer(group, src), group)
            tensor.add_(incoming)
        for dst in range(1, n):
            dist.send(tensor, peer(group, dst), group)
    else:
        dist.send(tensor, peer(group, 0), group)
        dist.recv(tensor, peer(group, 0), group)
    return tensor


def bytes_sent_per_rank(collective: str, nbytes: float, world_size: int) -> float:
    """Bytes each rank sends, for a tensor of `nbytes` (the full, unsharded size), ring algorithms."""
    if collective == "naive_all_reduce":
        return float(world_size - 1) * nbytes
    return comms.sent_per_rank(collective.removeprefix("ring_"), nbytes, world_size)


# nccl-tests' bus factors (its doc/PERFORMANCE.md): what makes a collective's bus bandwidth comparable to a link's
# peak. They differ from bytes sent per rank (comms.RING) where the payload is counted another way: a reduce's busbw
# is its algbw (the root receives the whole tensor), an all-to-all's is (N-1)/N of it (a rank keeps its own block).
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send": lambda n: 1.0,
}


def bus_factor(collective: str, world_size: int) -> float:
    """nccl-tests' bus bandwidth = algorithm bandwidth x this factor (size = the full tensor)."""
    return BUS_FACTOR[collective.removeprefix("ring_").removeprefix("naive_")](world_size)


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
    """Fit alpha (s) and beta (s/byte) by least squares on relative error, so small messages weigh as much as large."""
    import numpy as np

    messages = alpha_beta_time(collective, 1.0, world_size, 1.0, 0.0)
    per_byte = bytes_sent_per_rank(collective, 1.0, world_size)
    t = np.asarray(seconds, dtype=float)
    design = np.stack([np.full_like(t, messages), np.asarray(nbytes, float) * per_byte], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    return max(float(alpha), 0.0), max(float(beta), 0.0)
