"""Two parameter servers: one server holds the model, trainers send gradients and get parameters."""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import torch
import torch.distributed.rpc as rpc

from course_lib.rpc.remote_functions import worker_name
from course_lib.rpc.train import (
    load_parameters,
    loss_and_gradients,
    make_model,
    set_average_gradient,
    snapshot,
    trainer_batch,
)


class BatchingParameterServer:
    """Sync server: one gradient per trainer, averaged, one step; update_and_fetch's Future frees server threads."""

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
        # In trainer order, not arrival order: the same sum as the data-parallel reference.
        by_trainer = [self.round_gradients[t] for t in sorted(self.round_gradients)]
        set_average_gradient(self.model, by_trainer)
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


def _values(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


SERVERS: dict[str, type[BatchingParameterServer] | type[LockingParameterServer]] = {
    "sync": BatchingParameterServer,
    "async": LockingParameterServer,
}


def train_on_trainer(
    server_rref: rpc.RRef, mode: str, trainer: int, n_trainers: int, steps: int, batch_size: int
) -> tuple[list[float], int]:
    """Runs on a trainer: fetch parameters, compute a gradient on its batch, send it, repeat. Returns the losses
    and the values that crossed to and from the server in the steps (the gradients sent, the parameters received)."""
    model = make_model()
    cls = SERVERS[mode]
    owner = server_rref.owner()
    fetched = rpc.rpc_sync(owner, _fetch, args=(server_rref,))
    version, values = fetched if mode == "async" else (None, fetched)
    losses, moved = [], 0
    for step in range(steps):
        load_parameters(model, values)
        loss, grads = loss_and_gradients(model, *trainer_batch(step, trainer, n_trainers, batch_size))
        losses.append(loss)
        if mode == "sync":
            values = rpc.rpc_sync(owner, cls.update_and_fetch, args=(server_rref, trainer, grads))
        else:
            version, values = rpc.rpc_sync(owner, cls.update_and_fetch, args=(server_rref, trainer, grads, version))
        moved += _values(grads) + _values(values)  # counted on the tensors that went and came back
    return losses, moved


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
    histogram (async), the values that went through the server (counted by the trainers), and the wall time.
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
    losses = [
        statistics.fmean(step_losses) for step_losses in zip(*(trainer_losses for trainer_losses, _ in per_trainer))
    ]
    staleness = getattr(server, "staleness", [])
    return {
        "mode": mode,
        "n_trainers": n_trainers,
        "losses": losses,
        "parameters": snapshot(server.model),
        "staleness": staleness,
        "values_moved": sum(moved for _, moved in per_trainer),  # what the trainers sent and received
        "wall_s": wall_s,
        "updates": n_trainers * steps,
    }
