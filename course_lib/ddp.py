"""Notebook 02: data parallelism from scratch, next to torch's DistributedDataParallel.

Every rank holds a full replica of the model and sees B/N samples of each global batch of B.
After backward each rank holds the gradient of its own shard's mean loss; averaging those
gradients over the N ranks gives exactly the gradient of the mean loss over the global batch:

    g = 1/N * sum_r g_r,    w <- w - lr * g        (the same update on every rank)

so the replicas stay identical and training equals single-process training on batches of B.

:class:`MinimalDDP` does this the way torch DDP does: parameters broadcast from rank 0 at
start, gradients packed into buckets (in reverse parameter order, the order backward produces
them), each full bucket all-reduced asynchronously while backward continues, one wait at the end
of backward, before the optimizer step. ``no_sync()`` skips the communication for gradient
accumulation. The rest of the module holds what notebook 02 measures with it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from course_lib.exercises import ExerciseFailed, expect_equal
from course_lib.launch.runtime import rank_device

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

MB = 1024 * 1024


# ---- the from-scratch DDP --------------------------------------------------------------------


@dataclass
class Bucket:
    """Parameters whose gradients travel in one all-reduce, and the flat buffer they travel in."""

    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor
    pending: int = 0  # gradients not yet ready in this backward
    work: dist.Work | None = None  # the in-flight all-reduce
    done_future: torch.futures.Future | None = None
    launched_at: float = 0.0  # time.perf_counter() when the all-reduce started
    done_at: float = 0.0  # ... and when it completed

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
    """Data parallelism in ~100 lines: broadcast, bucketed asynchronous all-reduce, averaging, no_sync.

    Use it like torch DDP: ``model = MinimalDDP(MLP()); loss(model(x), y).backward(); opt.step()``.
    After ``backward()`` returns, every rank holds the averaged gradient.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, process_group=None):
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.require_gradient_sync = True
        self._finish_queued = False
        self.timeline: list[tuple[int, int, float, float]] = []  # (bucket, bytes, start, end) of the last sync
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

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        # Seeds may differ between ranks: rank 0's weights (and buffers) become everybody's.
        source = dist.get_global_rank(self.process_group, 0) if self.process_group else 0
        for tensor in self.module.state_dict().values():
            dist.broadcast(tensor, src=source, group=self.process_group)

    @contextlib.contextmanager
    def no_sync(self):
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
        bucket.launched_at = time.perf_counter()
        work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
        assert work is not None  # async_op=True

        def mark_done(_: torch.futures.Future) -> None:
            bucket.done_at = time.perf_counter()

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
        self.timeline = [(b.index, b.nbytes, b.launched_at, b.done_at) for b in self.buckets]


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside a MinimalDDP or torch DDP wrapper."""
    return getattr(model, "module", model)


# ---- checks and the snapshot -------------------------------------------------------------------


def check_gradient_sync(model: nn.Module, atol: float = 0.0, group=None) -> float:
    """Assert every rank holds the same gradients as rank 0; return the largest difference seen.

    Call it after backward (before the optimizer step). Replicas that drift apart (a rank that
    skipped a sync, a different batch order after a restart) are found here at the first step,
    rather than as a mysteriously worse loss much later. Costs one broadcast of all gradients.
    """
    named = [(n, p) for n, p in unwrap(model).named_parameters() if p.requires_grad]
    mine = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for _, p in named])
    reference = mine.clone()
    dist.broadcast(reference, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    local = (mine - reference).abs().max().reshape(1)
    per_rank = [torch.zeros_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(per_rank, local, group=group)
    worst = max(float(d) for d in per_rank)
    bad = [r for r, d in enumerate(per_rank) if float(d) > atol]
    if bad:
        where = ""
        if float(local) > atol:
            offset = 0
            for name, p in named:
                if (mine[offset : offset + p.numel()] - reference[offset : offset + p.numel()]).abs().max() > atol:
                    where = f"; here on rank {dist.get_rank(group)} first in {name}"
                    break
                offset += p.numel()
        raise AssertionError(f"gradients out of sync: rank(s) {bad} differ from rank 0 by up to {worst:.3g}{where}")
    return worst


def save_snapshot(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Rank 0 writes model + optimizer + step; the others wait until the file is complete.

    The replicas are identical, so one copy is the whole state. Saved without the DDP wrapper
    (no "module." prefix), so the file loads into a plain model too.
    """
    if dist.get_rank() == 0:
        torch.save({"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path)
    dist.barrier()  # nobody may read (or exit and delete) the file before rank 0 has written it


def load_snapshot(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Every rank loads the same snapshot onto its own device; returns the step to resume from."""
    device = next(unwrap(model).parameters()).device
    snapshot = torch.load(path, map_location=device, weights_only=True)
    unwrap(model).load_state_dict(snapshot["model"])
    optimizer.load_state_dict(snapshot["optimizer"])
    return snapshot["step"]


# ---- training: single process vs data parallel ------------------------------------------------


def shuffled_order(dataset: Dataset, epoch: int, seed: int = 0) -> list[int]:
    """The permutation DistributedSampler(shuffle=True, seed=seed) uses in `epoch`, on every rank."""
    g = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(len(cast(Sized, dataset)), generator=g).tolist()


def rank_loader(dataset: Dataset, micro_batch: int, epoch: int, seed: int = 0) -> DataLoader:
    """This rank's shard: DistributedSampler hands rank r the indices order[r::N]."""
    sampler: DistributedSampler = DistributedSampler(dataset, shuffle=True, seed=seed, drop_last=True)
    sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
    return DataLoader(dataset, batch_size=micro_batch, sampler=sampler)


def global_loader(dataset: Dataset, batch: int, epoch: int, seed: int = 0) -> DataLoader:
    """Single-process reference: the same shuffled order, whole global batches."""
    return DataLoader(dataset, batch_size=batch, sampler=shuffled_order(dataset, epoch, seed))


@dataclass
class TrainLog:
    losses: list[float] = field(default_factory=list)  # mean loss over each global batch
    bytes_sent: list[int] = field(default_factory=list)  # per step, by this process (gloo only)


def bytes_written() -> int:
    """Bytes this process has passed to write()/writev(): on gloo that is what it sent to its peers."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar"):
                return int(line.split()[1])
    return 0


def train(
    model: nn.Module,
    dataset: Dataset,
    *,
    global_batch: int,
    epochs: int,
    lr: float = 1e-2,
    accumulation: int = 1,
    max_grad_norm: float | None = 1.0,
    distributed: bool = True,
    check_sync: bool = False,
    seed: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
    first_epoch: int = 0,
) -> TrainLog:
    """Adam on `dataset` in global batches of `global_batch`, single-process or data-parallel.

    Data-parallel: each rank takes global_batch / N samples per step, in `accumulation` micro-batches;
    all but the last run under no_sync(). The loss is divided by `accumulation` so the summed
    gradient is the mean over the rank's samples; the all-reduce then averages over ranks.
    Runs epochs first_epoch .. epochs-1 (pass the optimizer to resume a run).
    """
    n = dist.get_world_size() if distributed else 1
    if global_batch % (n * accumulation):
        raise ValueError(f"global batch {global_batch} must split into {n} ranks x {accumulation} micro-batches")
    device = next(model.parameters()).device
    optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=lr)
    log = TrainLog()
    for epoch in range(first_epoch, epochs):
        loader = (
            rank_loader(dataset, global_batch // (n * accumulation), epoch, seed)
            if distributed
            else global_loader(dataset, global_batch // accumulation, epoch, seed)
        )
        batches = iter(loader)
        for _ in range(len(loader) // accumulation):
            step_loss = torch.zeros((), device=device)
            sent = bytes_written()
            for micro in range(accumulation):
                x, y = (t.to(device) for t in next(batches))
                last = micro == accumulation - 1
                wrapper = cast("DistributedDataParallel | MinimalDDP", model)
                sync = contextlib.nullcontext() if (last or not distributed) else wrapper.no_sync()
                with sync:  # forward too: torch DDP prepares its reducer in forward
                    loss = nn.functional.mse_loss(model(x), y) / accumulation
                    loss.backward()
                step_loss += loss.detach()
            log.bytes_sent.append(bytes_written() - sent)
            if check_sync:
                check_gradient_sync(model)
            if max_grad_norm is not None:
                # Gradients are identical on every rank after the sync, so every rank clips by the same factor.
                nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if distributed:
                dist.all_reduce(step_loss)
                step_loss /= n
            log.losses.append(step_loss.item())
    return log


def max_difference(a: nn.Module, b: nn.Module) -> float:
    """Largest absolute difference between two models' parameters."""
    return max((p - q).abs().max().item() for p, q in zip(unwrap(a).parameters(), unwrap(b).parameters()))


# ---- communication hooks ----------------------------------------------------------------------


def bf16_compress_hook_any_backend(state, bucket):
    """torch's bf16_compress_hook under another name.

    torch 2.13's register_comm_hook refuses the hook *by its name* unless CUDA + NCCL >= 2.10 (or
    XPU + XCCL) are present; gloo all-reduces bfloat16 on the CPU fine, so the CPU course calls it
    through this wrapper. On GPUs with NCCL use torch's hook directly.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


def attach_comm_hook(ddp_model: DistributedDataParallel, name: str, powersgd_rank: int = 2):
    """Register one of torch's compression hooks on a torch DDP model; returns the hook's state."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "none":
        return None
    if name == "fp16":
        ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if name == "bf16":
        native = torch.cuda.is_available() and dist.get_backend() == "nccl"
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


def ring_bytes(payload: int, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce: reduce-scatter + all-gather, (N-1)/N of the data each."""
    return 2 * (world_size - 1) / world_size * payload


def gradient_error(
    model: nn.Module, hook: str, x: torch.Tensor, y: torch.Tensor, repeats: int = 3, powersgd_rank: int = 2
) -> float:
    """Relative error ||g_hook - g_exact|| / ||g_exact|| of the averaged gradient, at the same weights.

    Runs `repeats` backward passes on the same batch (PowerSGD's first steps are exact) and
    measures the last, error feedback included.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    exact, compressed = DDP(_copy(model)), DDP(_copy(model))
    attach_comm_hook(compressed, hook, powersgd_rank)
    for _ in range(repeats):
        for m in (exact, compressed):
            m.zero_grad(set_to_none=True)
            nn.functional.mse_loss(m(x), y).backward()
    g_exact = torch.cat([p.grad.reshape(-1) for p in exact.parameters() if p.grad is not None])
    g_hook = torch.cat([p.grad.reshape(-1) for p in compressed.parameters() if p.grad is not None])
    return ((g_hook - g_exact).norm() / g_exact.norm()).item()


def train_with_hook(
    hook: str, dataset: Dataset, device: torch.device, powersgd_rank: int = 2, **train_kwargs
) -> tuple[TrainLog, nn.Module]:
    """Train the course MLP under torch DDP with one of COMM_HOOKS; returns the log and the plain model."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib.models import MLP

    model = DDP(MLP().to(device))
    attach_comm_hook(model, hook, powersgd_rank)
    log = train(model, dataset, **train_kwargs)
    return log, model.module


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(unwrap(model))


# ---- the overlap timeline ---------------------------------------------------------------------


def timed_allreduce_hook(events: list):
    """A torch DDP comm hook that all-reduces (mean) and records (bucket, bytes, start, end) in `events`."""

    def hook(state, bucket):  # no annotations: DDP checks them, and this module postpones them to strings
        buffer = bucket.buffer().div_(dist.get_world_size())
        start = time.perf_counter()
        future = dist.all_reduce(buffer, async_op=True).get_future()

        def done(fut):
            events.append((bucket.index(), buffer.numel() * buffer.element_size(), start, time.perf_counter()))
            return fut.value()[0]

        return future.then(done)

    return hook


def simulate_buckets(
    grad_bytes_in_order: list[int],
    grad_ready_s: list[float],
    bucket_cap_mb: float,
    latency_s: float,
    bandwidth_Bps: float,
    world_size: int,
):
    """Model of bucketed all-reduce during backward.

    Gradients (in the order backward produces them) become ready at `grad_ready_s`; a bucket is sent
    when its last gradient is ready and the previous all-reduce has finished (one at a time, as on
    one communicator). Each call costs latency + ring bytes / bandwidth. Returns the list of
    (start, end) per bucket.
    """
    cap = bucket_cap_mb * MB
    buckets: list[tuple[int, float]] = []  # (bytes, ready time), closed as in assign_buckets
    size = 0
    for nbytes, t in zip(grad_bytes_in_order, grad_ready_s):
        size += nbytes
        if size >= cap:
            buckets.append((size, t))
            size = 0
    if size:
        buckets.append((size, grad_ready_s[-1]))
    calls, free_at = [], 0.0
    for nbytes, ready in buckets:
        start = max(ready, free_at)
        free_at = start + latency_s + ring_bytes(nbytes, world_size) / bandwidth_Bps
        calls.append((start, free_at))
    return calls


def overlap_fraction(calls: list[tuple[float, float]], backward_s: float) -> float:
    """Share of the communication time that falls inside backward (hidden behind compute)."""
    total = sum(e - s for s, e in calls)
    hidden = sum(max(0.0, min(e, backward_s) - s) for s, e in calls)
    return hidden / total if total else 1.0


# ---- memory per rank --------------------------------------------------------------------------


def ddp_bytes_per_rank(n_params: int, param_bytes: int = 4, optimizer_states: int = 2, bucket_copy: bool = True) -> int:
    """Every rank holds everything: weights + gradients + optimizer states (+ the bucket copy of the
    gradients unless gradient_as_bucket_view=True). Activations come on top and scale with B/N."""
    copies = 1 + 1 + optimizer_states + (1 if bucket_copy else 0)
    return n_params * param_bytes * copies


# ---- exercises --------------------------------------------------------------------------------


def solution_average_gradient(param: torch.Tensor) -> None:
    assert param.grad is not None
    dist.all_reduce(param.grad)
    param.grad /= dist.get_world_size()


def solution_mean_allreduce_hook(state, bucket):
    buffer = bucket.buffer() / dist.get_world_size()
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _exercise_batches(steps: int = 3):
    from course_lib.data import regression

    data = regression(n=16 * dist.get_world_size() * steps, seed=1)
    rank, n = dist.get_rank(), dist.get_world_size()
    for s in range(steps):
        lo = (s * n + rank) * 16
        yield data.tensors[0][lo : lo + 16].to(rank_device()), data.tensors[1][lo : lo + 16].to(rank_device())


def _compare_with_torch_ddp(candidate: nn.Module, what: str, steps: int = 3) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib.models import MLP

    reference = DDP(MLP(seed=0).to(rank_device()))
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(candidate.parameters(), lr=0.1)
    for step, (x, y) in enumerate(_exercise_batches(steps)):
        for model, o in ((reference, opt_ref), (candidate, opt)):
            o.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
        for (name, p), q in zip(unwrap(candidate).named_parameters(), reference.parameters()):
            if p.grad is None:
                raise ExerciseFailed(f"step {step}: {name} has no gradient after backward")
            # check() prefixes the rank that failed first
            expect_equal(
                f"step {step}: gradient of {name} (torch DDP's is the average over ranks)",
                p.grad,
                q.grad,
                atol=1e-6,
                rtol=1e-4,
            )
        opt_ref.step()
        opt.step()


def check_average_gradient(fn: Callable[[torch.Tensor], None]) -> None:
    """fn as a post-accumulate-grad hook on every parameter must reproduce torch DDP's gradients."""
    from course_lib.models import MLP

    model = MLP(seed=0).to(rank_device())
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(fn)
    _compare_with_torch_ddp(model, "average_gradient")


def check_mean_allreduce_hook(fn) -> None:
    """fn as torch DDP's communication hook must give the same gradients as DDP's built-in all-reduce."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib.models import MLP

    model = DDP(MLP(seed=0).to(rank_device()))
    model.register_comm_hook(None, fn)
    try:
        _compare_with_torch_ddp(model, "mean_allreduce_hook")
    finally:
        del model
