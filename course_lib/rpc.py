"""Remote procedure calls (torch.distributed.rpc): helpers, a parameter server, distributed autograd.

Everything a worker calls on another worker lives here, at module level: RPC
pickles a function or class *by reference* (module + name), so the callee must
be able to import it. A function defined in a notebook cell exists only in the
kernel, never in the ranks.

Worker names follow one convention: rank 0 is ``"server"``, rank r > 0 is
``"trainer{r}"``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import re
import statistics
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn

from course_lib.data import regression
from course_lib.models import MLP

SERVER = "server"

# init_rpc (TensorPipe backend) builds a private ProcessGroupGloo and hands it to
# dist.all_gather_object to exchange device maps (rpc/backend_registry.py). That object
# is a Backend, not a ProcessGroup, so distributed_c10d warns about an API the *caller*
# uses: torch's own code, not ours, and nothing our code does can avoid it.
BACKEND_AS_PROCESS_GROUP = re.compile(
    r"You are using a Backend <class 'torch\.distributed\.distributed_c10d\.ProcessGroupGloo'> as a ProcessGroup\."
)


def worker_name(rank: int) -> str:
    return SERVER if rank == 0 else f"trainer{rank}"


def _is_torch_internal_backend_notice(record: warnings.WarningMessage) -> bool:
    """Exactly the notice init_rpc triggers inside torch: message, category and file must all match."""
    filename = record.filename.replace(os.sep, "/")
    return (
        record.category is UserWarning
        and bool(BACKEND_AS_PROCESS_GROUP.match(str(record.message)))
        and filename.endswith("torch/distributed/distributed_c10d.py")
    )


def start(
    rank: int, world_size: int, name: str | None = None, timeout_s: float = 60.0, num_worker_threads: int = 16
) -> list[dict[str, str]]:
    """`rpc.init_rpc` under the course's names, hiding only torch's internal Backend notice.

    Every other warning raised during init is shown as usual. Returns one record
    (category, source file, first sentence) per notice hidden, so a caller can see what was dropped.
    """
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=num_worker_threads, rpc_timeout=timeout_s)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rpc.init_rpc(name or worker_name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)
    hidden = []
    for record in caught:
        if _is_torch_internal_backend_notice(record):
            hidden.append(
                {
                    "category": record.category.__name__,
                    "source": "/".join(record.filename.replace(os.sep, "/").split("/")[-3:]),
                    "message": str(record.message).split(". ")[0] + ".",
                }
            )
        else:
            warnings.showwarning(record.message, record.category, record.filename, record.lineno)
    return hidden


# ---------------------------------------------------------------------------------------
# Small remote functions for the first examples


def echo(value: Any) -> Any:
    """Return the argument: a round trip that measures the transport, not the work."""
    return value


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


def who_am_i() -> str:
    return rpc.get_worker_info().name


def fail(message: str) -> None:
    raise ValueError(message)


_slow_calls_done = threading.Event()


def sleep_then_return(seconds: float, value: Any) -> Any:
    """A slow remote function: the caller's timeout fires while this still runs."""
    time.sleep(seconds)
    _slow_calls_done.set()
    return value


def wait_for_slow_call(timeout_s: float = 10.0) -> bool:
    """Runs on the callee: returns once the slow call above has finished (so shutdown drops no reply)."""
    return _slow_calls_done.wait(timeout_s)


@contextlib.contextmanager
def captured_stderr() -> Iterator[io.StringIO]:
    """Collect what this process's RPC threads print to stderr.

    When a remote function raises, torch prints the traceback on the *callee*
    (rpc/internal.py, with absolute file paths) before sending the exception
    back. Inside this block it is collected instead, so a cell can summarise it.
    """
    buffer = io.StringIO()
    with contextlib.redirect_stderr(buffer):
        yield buffer


class RemoteModel(nn.Module):
    """A model that lives on one worker and is used from others through an RRef.

    Created with ``rpc.remote("server", RemoteModel, args=(...))``: the constructor
    runs on the server, the caller gets an RRef. Methods run on the owner through
    ``rref.rpc_sync().forward(x)``; parameters never leave it.
    """

    def __init__(self, d_in: int = 4, d_out: int = 2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.linear = nn.Linear(d_in, d_out)
        # No threading.Lock in here: `rref.to_here()` pickles the whole object, and a lock cannot be pickled.

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def describe(self) -> str:
        n_parameters = sum(p.numel() for p in self.parameters())
        return f"RemoteModel with {n_parameters} parameters, running on {rpc.get_worker_info().name}"


# ---------------------------------------------------------------------------------------
# Parameter server: one server holds the model, trainers send gradients and get parameters


_MODEL_BUILD_LOCK = threading.Lock()


def make_model() -> nn.Sequential:
    """The course MLP, small: 32 -> 32 -> 32 -> 8.

    MLP seeds the global RNG and then draws the weights from it: two RPC threads building
    models at once would interleave their draws and get different weights. One at a time.
    """
    with _MODEL_BUILD_LOCK:
        return MLP(d_in=32, d_hidden=32, d_out=8, n_layers=2, seed=0)


@functools.lru_cache(maxsize=4)
def _dataset(n_samples: int):
    return regression(n=n_samples, d_in=32, d_out=8, seed=0)


def trainer_batch(
    step: int, trainer: int, n_trainers: int, batch_size: int = 16, n_samples: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer `trainer`'s share of step `step`: the global batch of step `step` is
    `n_trainers * batch_size` rows of a fixed permutation; each trainer takes its slice."""
    data = _dataset(n_samples)
    order = torch.randperm(n_samples, generator=torch.Generator().manual_seed(step))
    rows = order[(trainer * batch_size) % n_samples :][:batch_size]
    return data.tensors[0][rows], data.tensors[1][rows]


def full_data_loss(parameters: list[torch.Tensor]) -> float:
    """Loss of `parameters` on the whole data set: convergence measured without mini-batch noise."""
    model = make_model()
    load_parameters(model, parameters)
    x, y = _dataset(512).tensors
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


def loss_and_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    loss = nn.functional.mse_loss(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return loss.item(), [g.detach() for g in grads]


def load_parameters(model: nn.Module, values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(model.parameters(), values):
            p.copy_(v)


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


class BatchingParameterServer:
    """Synchronous server: waits for one gradient from every trainer, averages, steps once.

    `update_and_fetch` is an `@rpc.functions.async_execution` function: it returns a
    `torch.futures.Future` at once, so the RPC thread goes back to the pool while the
    trainer's reply waits for the round to complete. A version that blocked (waited on a
    condition variable) would hold one server thread per waiting trainer.
    """

    def __init__(self, n_trainers: int, lr: float):
        self.model = make_model()
        # The optimizer belongs to the server, built over the model's parameters
        # (nn.Module has no .optimizer of its own to step).
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.n_trainers = n_trainers
        self.lock = threading.Lock()
        self.round_gradients: dict[int, list[torch.Tensor]] = {}
        self.next_parameters: torch.futures.Future[list[torch.Tensor]] = (
            torch.futures.Future()
        )  # completed when the current round steps
        self.steps = 0

    def parameters(self) -> list[torch.Tensor]:
        with self.lock:
            return snapshot(self.model)

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch(server_rref: rpc.RRef, trainer: int, gradients: list[torch.Tensor]) -> torch.futures.Future:
        self = server_rref.local_value()
        with self.lock:
            self.round_gradients[trainer] = gradients
            this_round = self.next_parameters  # taken under the lock: the future of *this* round
            if len(self.round_gradients) == self.n_trainers:
                self._average_and_step()
                self.next_parameters = torch.futures.Future()  # before completing: late callers get the next one
                this_round.set_result(snapshot(self.model))
        return this_round

    def _average_and_step(self) -> None:
        # Sum in trainer order, not arrival order: the result is deterministic and equals
        # the data-parallel reference bit for bit in exact arithmetic.
        trainers = sorted(self.round_gradients)
        for i, p in enumerate(self.model.parameters()):
            total = self.round_gradients[trainers[0]][i].clone()
            for t in trainers[1:]:
                total += self.round_gradients[t][i]
            p.grad = total / self.n_trainers
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.round_gradients.clear()
        self.steps += 1


class LockingParameterServer:
    """Asynchronous server: every gradient is applied at once, one optimizer step per update,
    under a lock. A trainer's gradient was computed on the parameters it last fetched; the
    number of steps taken since then is its *staleness*, counted here."""

    def __init__(self, n_trainers: int, lr: float):
        self.model = make_model()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.lock = threading.Lock()
        self.version = 0  # optimizer steps taken so far
        self.staleness: list[int] = []

    def parameters(self) -> tuple[int, list[torch.Tensor]]:
        with self.lock:
            return self.version, snapshot(self.model)

    @staticmethod
    def update_and_fetch(
        server_rref: rpc.RRef, trainer: int, gradients: list[torch.Tensor], read_version: int
    ) -> tuple[int, list[torch.Tensor]]:
        self = server_rref.local_value()
        with self.lock:
            self.staleness.append(self.version - read_version)
            for p, g in zip(self.model.parameters(), gradients):
                p.grad = g
            self.optimizer.step()
            self.version += 1
            return self.version, snapshot(self.model)


SERVERS: dict[str, type[BatchingParameterServer] | type[LockingParameterServer]] = {
    "sync": BatchingParameterServer,
    "async": LockingParameterServer,
}


def train_on_trainer(
    server_rref: rpc.RRef, mode: str, trainer: int, n_trainers: int, steps: int, batch_size: int
) -> list[float]:
    """Runs on a trainer: fetch parameters, compute a gradient on its batch, send it, repeat."""
    model = make_model()
    cls = SERVERS[mode]
    owner = server_rref.owner()
    fetched = rpc.rpc_sync(owner, _fetch, args=(server_rref,))
    version, values = fetched if mode == "async" else (None, fetched)
    losses = []
    for step in range(steps):
        load_parameters(model, values)
        loss, grads = loss_and_gradients(model, *trainer_batch(step, trainer, n_trainers, batch_size))
        losses.append(loss)
        if mode == "sync":
            values = rpc.rpc_sync(owner, cls.update_and_fetch, args=(server_rref, trainer, grads))
        else:
            version, values = rpc.rpc_sync(owner, cls.update_and_fetch, args=(server_rref, trainer, grads, version))
    return losses


def _fetch(server_rref: rpc.RRef):
    return server_rref.local_value().parameters()


def trainer_worker(trainer: int, world_size: int) -> str:
    """Logical trainer t (0-based) runs on trainer process 1 + t mod (world_size - 1)."""
    return worker_name(1 + trainer % (world_size - 1))


def run_parameter_server(
    mode: str, n_trainers: int, world_size: int, steps: int = 40, batch_size: int = 16, lr: float = 1.0
) -> dict[str, Any]:
    """Runs on the server: build the server object, start every trainer through rpc_async, wait.

    Returns the per-step loss (mean over trainers), the final parameters, the staleness
    histogram (async) and the wall time.
    """
    server = SERVERS[mode](n_trainers, lr)
    server_rref = rpc.RRef(server)  # owned here; trainers reach it through the RRef
    start_time = time.perf_counter()
    futures = [
        rpc.rpc_async(
            trainer_worker(t, world_size), train_on_trainer, args=(server_rref, mode, t, n_trainers, steps, batch_size)
        )
        for t in range(n_trainers)
    ]
    per_trainer = torch.futures.wait_all(futures)
    wall_s = time.perf_counter() - start_time
    losses = [statistics.fmean(step_losses) for step_losses in zip(*per_trainer)]
    staleness = getattr(server, "staleness", [])
    return {
        "mode": mode,
        "n_trainers": n_trainers,
        "losses": losses,
        "parameters": snapshot(server.model),
        "staleness": staleness,
        "wall_s": wall_s,
        "updates": n_trainers * steps,
    }


def data_parallel_reference(
    n_trainers: int, steps: int = 40, batch_size: int = 16, lr: float = 1.0
) -> tuple[list[torch.Tensor], list[float]]:
    """Single process: what data-parallel training (DDP) computes with the same data.

    DDP averages the trainers' gradients (all-reduce, then divide by N) and every rank
    takes the same SGD step. Returns (final parameters, per-step mean loss)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        results = [
            loss_and_gradients(model, *trainer_batch(step, t, n_trainers, batch_size)) for t in range(n_trainers)
        ]
        losses.append(statistics.fmean(loss for loss, _ in results))
        for i, p in enumerate(model.parameters()):
            total = results[0][1][i].clone()
            for _, grads in results[1:]:
                total += grads[i]
            p.grad = total / n_trainers
        optimizer.step()
        optimizer.zero_grad()
    return snapshot(model), losses


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------
# Measurements


def rpc_latency(peer: str, sizes_bytes: list[int], repeats: int = 7, warmup: int = 3) -> dict[int, float]:
    """Median round-trip time (seconds) of rpc_sync(echo) of a float32 tensor of each size.

    The sizes are visited in alternating rounds, so drift of a shared machine hits all alike.
    """
    tensors = {n: torch.zeros(max(1, n // 4)) for n in sizes_bytes}
    for _ in range(warmup):
        rpc.rpc_sync(peer, echo, args=(tensors[sizes_bytes[0]],))
    times: dict[int, list[float]] = {n: [] for n in sizes_bytes}
    for _ in range(repeats):
        for n in sizes_bytes:
            start_time = time.perf_counter()
            rpc.rpc_sync(peer, echo, args=(tensors[n],))
            times[n].append(time.perf_counter() - start_time)
    return {n: statistics.median(ts) for n, ts in times.items()}


def fit_latency_model(latency: dict[int, float]) -> tuple[float, float]:
    """alpha (s) and beta (bytes/s) of t(n) = alpha + 2n/beta (2n: the tensor travels there and back).

    alpha: the smallest round trip measured (a few bytes cost nothing else);
    beta: from the largest size, where the bandwidth term dominates.
    """
    sizes = sorted(latency)
    alpha = min(latency.values())
    largest = sizes[-1]
    beta = 2.0 * largest / max(latency[largest] - alpha, 1e-9)
    return alpha, beta


# ---------------------------------------------------------------------------------------
# Distributed autograd: a forward across three nodes


def three_stage_model() -> list[nn.Module]:
    """The course MLP (two hidden layers) cut into three stages: Linear+GELU | Linear+GELU | Linear."""
    layers = list(make_model())
    return [nn.Sequential(*layers[0:2]), nn.Sequential(*layers[2:4]), nn.Sequential(*layers[4:])]


class PythonSGD(torch.optim.SGD):
    """torch.optim.SGD under another name, for DistributedOptimizer.

    For the optimizer classes it knows (SGD, Adam, ...) DistributedOptimizer compiles a
    TorchScript functional optimizer on every owner, and TorchScript support is deprecated
    (it warns). For any other class it runs the ordinary Python optimizer on each owner.
    Same update, no deprecated path.
    """


@contextlib.contextmanager
def _logger_level(name: str, level: int):
    logger = logging.getLogger(name)
    previous = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(previous)


class Stage(nn.Module):
    """One stage of `three_stage_model`, built on the worker that owns it."""

    def __init__(self, index: int):
        super().__init__()
        self.net = three_stage_model()[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def parameter_rrefs(self) -> list[rpc.RRef]:
        return [rpc.RRef(p) for p in self.parameters()]


def stage_gradients(stage_rref: rpc.RRef, context_id: int) -> list[torch.Tensor]:
    """Runs on the stage's owner: the gradients distributed autograd accumulated there.

    They live in the context, not in `.grad` (which stays None)."""
    grads = dist_autograd.get_gradients(context_id)
    return [grads[p].clone() for p in stage_rref.local_value().parameters()]


def stage_parameters(stage_rref: rpc.RRef) -> list[torch.Tensor]:
    return snapshot(stage_rref.local_value())


def stage_owner(index: int, world_size: int) -> str:
    """Stage k lives on worker k mod world_size: three different processes when there are three."""
    return f"worker{index % world_size}"


def distributed_training_step(world_size: int, x: torch.Tensor, y: torch.Tensor, lr: float = 0.1) -> dict[str, Any]:
    """Runs on worker0: one SGD step of the three-stage model spread over the workers.

    Forward: x -> stage 0 -> stage 1 -> stage 2, each an RPC to the stage's owner; the loss
    is computed here. `dist_autograd.backward` runs the backward pass through every worker
    the forward touched; `DistributedOptimizer` steps each parameter on its owner.
    """
    from torch.distributed.optim import DistributedOptimizer  # imported here: it loads TorchScript machinery

    stages = [rpc.remote(stage_owner(k, world_size), Stage, args=(k,)) for k in range(3)]
    param_rrefs = [p for s in stages for p in s.rpc_sync().parameter_rrefs()]
    # For a class without TorchScript support DistributedOptimizer logs that the Python optimizer
    # may be slow under the GIL. Known and chosen (see PythonSGD): that logger only, only here.
    with _logger_level("torch.distributed.optim.optimizer", logging.ERROR):
        optimizer = DistributedOptimizer(PythonSGD, param_rrefs, lr=lr)
    with dist_autograd.context() as context_id:
        h = x
        for stage in stages:
            h = stage.rpc_sync().forward(h)
        loss = nn.functional.mse_loss(h, y)
        dist_autograd.backward(context_id, [loss])
        gradients = [g for s in stages for g in rpc.rpc_sync(s.owner(), stage_gradients, args=(s, context_id))]
        local_grads_here = len(dist_autograd.get_gradients(context_id))
        optimizer.step(context_id)
    parameters = [p for s in stages for p in rpc.rpc_sync(s.owner(), stage_parameters, args=(s,))]
    return {
        "loss": loss.item(),
        "gradients": gradients,
        "parameters": parameters,
        "owners": [s.owner().name for s in stages],
        "local_grads_here": local_grads_here,
    }


def local_training_step(x: torch.Tensor, y: torch.Tensor, lr: float = 0.1) -> dict[str, Any]:
    """The same step in one process: the reference distributed autograd must reproduce."""
    model = nn.Sequential(*three_stage_model())
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    gradients = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    torch.optim.SGD(model.parameters(), lr=lr).step()
    return {"loss": loss.item(), "gradients": gradients, "parameters": snapshot(model)}


# ---------------------------------------------------------------------------------------
# Exercise: a counter held behind an RRef, updated by every trainer


class Counter:
    """State on the owner. Reading is slow (as a real store would be), so two RPC threads
    that read, add and write without holding `lock` lose updates."""

    def __init__(self):
        self.value = 0
        self.lock = threading.Lock()

    def read(self) -> int:
        value = self.value
        time.sleep(0.02)  # the value is on its way back while other threads may write
        return value

    def write(self, value: int) -> None:
        self.value = value


def add_on_owner(counter_rref: rpc.RRef, amount: int) -> int:
    """Reference solution: runs on the counter's owner; returns the total after this update."""
    counter = counter_rref.local_value()
    with counter.lock:
        total = counter.read() + amount
        counter.write(total)
    return total


def _read_counter(counter_rref: rpc.RRef) -> int:
    return counter_rref.local_value().value


def check_counter(add_fn, calls_per_trainer: int = 8, amount_base: int = 1) -> None:
    """Checker: every trainer sends `calls_per_trainer` concurrent updates through `add_fn`,
    run on the server; the total must be the sum of every amount, and every call must have
    seen a different total (no two updates interleaved)."""
    import torch.distributed as dist

    from course_lib.exercises import ExerciseFailed

    rank, world_size = dist.get_rank(), dist.get_world_size()
    start(rank, world_size)
    problem = None
    try:
        if rank == 0:
            counter_rref = rpc.RRef(Counter())
            futures = [
                rpc.rpc_async(worker_name(r), _trainer_counts, args=(counter_rref, add_fn, r, calls_per_trainer))
                for r in range(1, world_size)
            ]
            returned = [v for f in futures for v in f.wait()]
            expected = sum(r * amount_base * calls_per_trainer for r in range(1, world_size))
            total = _read_counter(counter_rref)
            if total != expected:
                problem = (
                    f"the counter's owner: total expected {expected}, got {total} "
                    f"after {len(returned)} updates from {world_size - 1} trainer(s)"
                )
            elif sorted(returned) != sorted(set(returned)) or max(returned, default=0) != expected:
                problem = (
                    f"the {len(returned)} calls returned the totals {sorted(returned)}: each call "
                    f"must return the total right after its own update (all different, the last = {expected})"
                )
    finally:
        rpc.shutdown()
    if problem:
        raise ExerciseFailed(problem)


def _trainer_counts(counter_rref: rpc.RRef, add_fn, trainer_rank: int, calls: int) -> list[int]:
    """Runs on a trainer: `calls` updates in flight at once, each adding `trainer_rank`."""
    owner = counter_rref.owner()
    futures = [rpc.rpc_async(owner, add_fn, args=(counter_rref, trainer_rank)) for _ in range(calls)]
    return [f.wait() for f in futures]
