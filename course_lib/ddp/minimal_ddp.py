"""Data parallelism from scratch: :class:`MinimalDDP`, the algorithm notebook 02 shows."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

MB = 1024 * 1024

Stamp = float | torch.cuda.Event  # a moment: time.perf_counter() seconds, or a CUDA event the GPU passes then


def stamp(device: torch.device) -> Stamp:
    """Now, for work on `device`: perf_counter on CPU; on CUDA a stream event, as the host runs ahead of queued work."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def on_host_clock(rows: Iterable[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """`rows` with stamp()'s CUDA events as perf_counter seconds, so GPU and host times share one clock."""
    rows = [tuple(row) for row in rows]
    if not any(isinstance(value, torch.cuda.Event) for row in rows for value in row):
        return rows
    torch.cuda.synchronize()
    anchor = torch.cuda.Event(enable_timing=True)
    anchor.record()
    anchor.synchronize()
    now = time.perf_counter()
    return [
        tuple(now - v.elapsed_time(anchor) / 1e3 if isinstance(v, torch.cuda.Event) else v for v in row) for row in rows
    ]


@dataclass
class Bucket:
    """Parameters whose gradients travel in one all-reduce, and the flat buffer they travel in."""

    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor
    pending: int = 0  # gradients not yet ready in this backward
    work: dist.Work | None = None  # the in-flight all-reduce
    done_future: torch.futures.Future | None = None
    launched_at: Stamp = 0.0  # when the all-reduce started (stamp: on CUDA, when the GPU reached it)
    done_at: Stamp = 0.0  # ... and when it completed

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def views(self) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """Each parameter with the slice of the buffer that carries its gradient."""
        offset = 0
        for p in self.params:
            yield p, self.buffer[offset : offset + p.numel()]
            offset += p.numel()


def assign_buckets(params: list[nn.Parameter], bucket_cap_bytes: int) -> list[list[nn.Parameter]]:
    """Group parameters into buckets, closing a bucket once it holds `bucket_cap_bytes` or more.

    Reverse order of `model.parameters()`: backward produces the last layer's gradients first,
    so the first bucket fills first and its all-reduce starts while earlier layers still compute.
    (The same rule as torch DDP's bucket assignment, so both make the same buckets.)
    """
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    current_bytes = 0
    for p in reversed(params):
        current.append(p)
        current_bytes += p.numel() * p.element_size()
        if current_bytes >= bucket_cap_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
    if current:
        buckets.append(current)
    return buckets


class MinimalDDP(nn.Module):
    """Data parallelism in ~100 lines: broadcast, bucketed asynchronous all-reduce, averaging, no_sync."""

    def __init__(
        self, module: nn.Module, bucket_cap_mb: float = 25.0, process_group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.require_gradient_sync = True
        self._finish_queued = False
        self._stamps: list[tuple[int, int, Stamp, Stamp]] = []  # (bucket, bytes, start, end) of the last sync
        self._broadcast_from_rank0()

        params = [p for p in module.parameters() if p.requires_grad]
        assert len({(p.dtype, p.device) for p in params}) == 1, "one dtype and device per model, for brevity"
        self.buckets: list[Bucket] = []
        for index, group in enumerate(assign_buckets(params, int(bucket_cap_mb * MB))):
            buffer = torch.zeros(sum(p.numel() for p in group), dtype=group[0].dtype, device=group[0].device)
            self.buckets.append(Bucket(index, group, buffer, pending=len(group)))
            for p in group:
                # Runs right after autograd has accumulated this parameter's .grad.
                p.register_post_accumulate_grad_hook(lambda param, bucket=self.buckets[-1]: self._on_ready(bucket))
        self._next_to_launch = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def timeline(self) -> list[tuple[int, int, float, float]]:
        """(bucket, bytes, start, end) of each all-reduce of the last sync, in time.perf_counter() seconds."""
        seconds: list[tuple[int, int, float, float]] = on_host_clock(self._stamps)
        self._stamps = list(seconds)  # read once: the events become numbers
        return seconds

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        # Seeds may differ between ranks: rank 0's weights (and buffers) become everybody's.
        source = dist.get_global_rank(self.process_group, 0) if self.process_group else 0
        for tensor in self.module.state_dict().values():
            dist.broadcast(tensor, src=source, group=self.process_group)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates .grad locally, with no communication (gradient accumulation)."""
        previous, self.require_gradient_sync = self.require_gradient_sync, False
        try:
            yield
        finally:
            self.require_gradient_sync = previous

    def _on_ready(self, bucket: Bucket) -> None:
        if not self.require_gradient_sync:
            return
        if not self._finish_queued:
            # Ask autograd to call us once the whole backward pass is done: that is where we wait.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._finish_queued = True
        bucket.pending -= 1
        # Launch in bucket order only: collectives are matched by call order, so every rank
        # must start the same all-reduce first, whatever order its gradients became ready in.
        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].pending == 0:
            self._launch(self.buckets[self._next_to_launch])
            self._next_to_launch += 1

    @torch.no_grad()
    def _launch(self, bucket: Bucket) -> None:
        for p, view in bucket.views():
            # Divide before summing (as torch DDP does): the sum of N gradients cannot overflow.
            assert p.grad is not None  # every parameter of a bucket has its gradient when the bucket launches
            torch.mul(p.grad.reshape(-1), 1.0 / self.world_size, out=view)
        bucket.launched_at = stamp(bucket.buffer.device)
        work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
        assert work is not None  # async_op=True

        def mark_done(_: torch.futures.Future) -> None:
            # gloo: runs when the all-reduce has finished. NCCL: runs at once, on a stream that waits for the
            # all-reduce, so the event stamp records there marks the moment the all-reduce finished.
            bucket.done_at = stamp(bucket.buffer.device)

        bucket.work, bucket.done_future = work, work.get_future().then(mark_done)

    @torch.no_grad()
    def _finish(self) -> None:
        self._finish_queued = False
        self._next_to_launch = 0
        missing = [b for b in self.buckets if b.work is None]
        for b in self.buckets:
            b.pending = len(b.params)
        if missing:
            raise RuntimeError(
                f"{sum(b.pending for b in missing)} parameter(s) got no gradient in this backward; "
                "MinimalDDP cannot wait for them (torch DDP: find_unused_parameters=True)"
            )
        for b in self.buckets:
            assert b.work is not None and b.done_future is not None  # all launched (checked above)
            b.work.wait()  # the only place backward waits for the network
            b.done_future.wait()
            for p, view in b.views():
                assert p.grad is not None  # set in _launch
                p.grad.copy_(view.view_as(p))
            # Drop the finished work and future: a c10d future that outlives the process group
            # (freed at interpreter exit) can abort the process.
            b.work = b.done_future = None
        self._stamps = [(b.index, b.nbytes, b.launched_at, b.done_at) for b in self.buckets]


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside a MinimalDDP or torch DDP wrapper."""
    return getattr(model, "module", model)
