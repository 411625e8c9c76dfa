"""torchft replica groups that train on when one dies (rank side); LocalSGD and DiLoCo against DDP, bytes counted."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

GLOBAL_BATCH = 48  # samples per step, split over the replicas that take part in the step
# The replicas' environment: torchft's Rust side logs every quorum at INFO (RUST_LOG sets its level), and DDP's C++
# reducer warns that torchft's find_unused_parameters=True found none (TORCH_CPP_LOG_LEVEL sets that level): both
# only in the replicas' own log files, kept quiet so that what they print is what the lesson reads.
QUIET = {"RUST_LOG": "error", "TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}
# Quorum rules of the lighthouse: a replica whose heartbeats (every 100 ms) stop for 2 s is dropped; a quorum waits up
# to 10 s for a replica that heartbeats but has not asked to join.
LIGHTHOUSE = {"min_replicas": 1, "join_timeout_ms": 10_000, "quorum_tick_ms": 20, "heartbeat_timeout_ms": 2_000}


def counting_gloo(timeout: timedelta) -> Any:
    """torchft's gloo recording all-reduce bytes; not comms.Recorder: torchft's groups bypass c10d's registry."""
    from torchft import ProcessGroupGloo

    class CountingGloo(ProcessGroupGloo):
        def __init__(self, timeout: timedelta) -> None:
            super().__init__(timeout=timeout)
            self.allreduced: list[int] = []

        def allreduce(self, tensors: list[torch.Tensor], opts: object) -> Any:
            self.allreduced.append(sum(t.numel() * t.element_size() for t in tensors))
            return super().allreduce(tensors, opts)

    return CountingGloo(timeout)


def _log(root: Path, replica: int, entry: dict) -> None:
    with open(root / f"replica_{replica}.jsonl", "a") as f:
        f.write(json.dumps({**entry, "time": time.time()}) + "\n")


def wait_at_lighthouse(lighthouse: str, what: str, ready: Callable[[int, int], bool], limit_s: float) -> None:
    """Poll the lighthouse's status page until ready(replicas asking for the next quorum, replicas heartbeating)."""
    import urllib.request

    deadline = time.monotonic() + limit_s
    while True:
        with urllib.request.urlopen(f"{lighthouse}/status", timeout=limit_s) as page:
            status = re.search(r"\[(\d+)/\d+ participants healthy\]\[(\d+) heartbeating\]", page.read().decode())
        if status is None:
            raise RuntimeError(f"the lighthouse's status page at {lighthouse}/status no longer says who is asking")
        if ready(int(status[1]), int(status[2])):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {limit_s:.0f} s at the lighthouse for {what}; it says {status[0]}")
        time.sleep(0.05)


def _manager(
    lighthouse: str, replica: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **options: Any
) -> tuple[Any, Any, Any]:
    """A one-process replica's torchft Manager, counting group and loopback TCPStore (keep it: the manager uses it)."""
    import torch.distributed as dist
    from torchft import Manager

    timeout = timedelta(seconds=options.pop("timeout_s", 20))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this group's store
    group = counting_gloo(timeout)
    manager = Manager(
        pg=group,
        min_replica_size=1,
        # what a healing replica receives from a peer: the model and the optimizer state (Adam's moments)
        state_dict=lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
        load_state_dict=lambda s: (model.load_state_dict(s["model"]), optimizer.load_state_dict(s["optimizer"])),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"replica_{replica}",
        hostname="127.0.0.1",
        init_sync=False,  # every replica builds the same seeded MLP: nothing to fetch at step 0
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        **options,
    )
    return manager, group, store


def torchft_step(manager: Any, ddp: torch.nn.Module, optimizer: Any, data: Any, step: int) -> tuple[Any, int, Any]:
    """One step of one replica group under torchft; returns (loss, replicas in the quorum, this one's rank there)."""
    from course_lib.data import batch_for_step

    optimizer.zero_grad()  # asks the lighthouse for this step's quorum
    participants, rank = manager.num_participants(), manager.participating_rank()  # rank None: healing
    x, y = batch_for_step(data, step, GLOBAL_BATCH, rank or 0, participants)  # B / |Q| samples each
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    loss.backward()  # DDP's hook: manager.allreduce over this step's quorum
    optimizer.step()  # only if every replica of the quorum says the step succeeded (should_commit)
    return loss, participants, rank


def train_replica(
    root: str | os.PathLike,
    replica: int,
    lighthouse: str,
    total_steps: int,
    *,
    replicas: int = 2,
    pause_at: int | None = None,
    wait_for_rejoin_at: int | None = None,
    rejoining: bool = False,
    limit_s: float = 60.0,
) -> None:
    """One replica group of one process: torchft's DDP and Optimizer around the course's MLP, `total_steps` steps."""
    from torchft import DistributedDataParallel, Optimizer

    from course_lib.data import regression
    from course_lib.models import MLP

    root = Path(root)
    model = MLP()
    adam = torch.optim.Adam(model.parameters(), lr=1e-2)
    manager, _, _store = _manager(lighthouse, replica, model, adam)
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, adam)
    data = regression(n=480)
    _log(root, replica, {"event": "start", "pid": os.getpid()})
    if not rejoining:  # the first replicas start together: every one heartbeats before the first quorum
        wait_at_lighthouse(lighthouse, f"{replicas} replicas", lambda _, beating: beating >= replicas, limit_s)
    while manager.current_step() < total_steps:
        step = manager.current_step()
        if step == pause_at:
            _log(root, replica, {"event": "pause", "step": step})
            time.sleep(limit_s)
            raise TimeoutError(f"replica {replica} was not killed within {limit_s:.0f} s")
        if step == wait_for_rejoin_at:  # the newcomer must ask first: see wait_for_rejoin_at above
            wait_at_lighthouse(lighthouse, "a replica asking to join", lambda asking, _: asking >= 1, limit_s)
        loss, participants, rank = torchft_step(manager, ddp, optimizer, data, step)
        if manager.current_step() == step + 1 or rank is None:  # committed (a healing replica jumps ahead)
            healed = rank is None
            _log(
                root,
                replica,
                {
                    "event": "step",
                    "step": manager.current_step() - 1,
                    "participants": participants,
                    "healed": healed,
                    "loss": None if healed else loss.item(),
                },
            )
        else:
            _log(root, replica, {"event": "retry", "step": step})
    torch.save(model.state_dict(), root / f"replica_{replica}.pt")
    _log(root, replica, {"event": "done", "step": manager.current_step()})
    manager.shutdown(wait=False)


def reference_losses(total_steps: int) -> list[float]:
    """The same training in one process without any failure: the whole global batch every step."""
    from course_lib import training
    from course_lib.data import regression
    from course_lib.models import MLP

    model = MLP()
    return training.train(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), regression(n=480), total_steps, GLOBAL_BATCH
    )


def step_losses(events: list[list[dict]]) -> dict[int, float]:
    """Global-batch loss per committed step: the mean over the replicas that took part, whose slices are equal."""
    per_step: dict[int, list[float]] = {}
    for log in events:
        for e in log:
            if e["event"] == "step" and not e["healed"]:
                per_step.setdefault(e["step"], []).append(e["loss"])
    return {step: sum(losses) / len(losses) for step, losses in sorted(per_step.items())}


SYNC_RUNS = {
    "DDP": ("ddp", 1),
    "LocalSGD H=2": ("local_sgd", 2),
    "LocalSGD H=4": ("local_sgd", 4),
    "LocalSGD H=8": ("local_sgd", 8),
    "DiLoCo H=4, outer SGD lr 1": ("diloco", 4),
    "DiLoCo H=4, outer Nesterov": ("diloco_nesterov", 4),
}


def synchronised(
    method: str, sync_every: int, manager: Any, model: torch.nn.Module, inner: Any
) -> tuple[Any, Any, Any]:
    """(the module to call, the optimizer to step, the context to train in) for one method of :data:`SYNC_RUNS`."""
    from torchft import DistributedDataParallel, Optimizer
    from torchft.local_sgd import DiLoCo, LocalSGD

    if method == "ddp":  # gradients averaged at every step
        return DistributedDataParallel(manager, model), Optimizer(manager, inner), contextlib.nullcontext()
    if method == "local_sgd":  # H steps alone, then the weights averaged
        return model, inner, LocalSGD(manager, model, inner, sync_every=sync_every)
    nesterov = method == "diloco_nesterov"  # H steps alone, then the outer optimizer on the mean pseudo-gradient
    outer = torch.optim.SGD(
        model.parameters(), lr=0.7 if nesterov else 1.0, momentum=0.9 if nesterov else 0.0, nesterov=nesterov
    )
    return model, inner, DiLoCo(manager, [model], inner, outer, sync_every=sync_every, pin_memory=False)


def train_synced(
    root: str | os.PathLike,
    replica: int,
    lighthouses: dict[str, str],
    steps: int,
    *,
    replicas: int = 2,
    limit_s: float = 60.0,
) -> None:
    """Train the same MLP `steps` steps once per entry of :data:`SYNC_RUNS`, with that entry's lighthouse."""
    from course_lib.data import batch_for_step, regression
    from course_lib.models import MLP

    root = Path(root)
    data = regression(n=480)
    x_all, y_all = data.tensors
    result: dict[str, dict[str, list]] = {}
    for name, (method, sync_every) in SYNC_RUNS.items():
        model = MLP()
        inner = torch.optim.Adam(model.parameters(), lr=1e-2)
        # DiLoCo requires a synchronous quorum (at the synchronisation, not during the steps)
        manager, group, _store = _manager(lighthouses[name], replica, model, inner, use_async_quorum=method == "ddp")
        # every manager heartbeats before the first quorum, which would otherwise form without the later one
        wait_at_lighthouse(lighthouses[name], f"{replicas} replicas", lambda _, beating: beating >= replicas, limit_s)
        forward, optimizer, algorithm = synchronised(method, sync_every, manager, model, inner)
        losses = []
        with algorithm:
            for step in range(steps):
                x, y = batch_for_step(data, step, GLOBAL_BATCH, replica, replicas)
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(forward(x), y).backward()
                optimizer.step()  # LocalSGD and DiLoCo synchronise in the optimizer's post-step hook
                if (step + 1) % 8 == 0:  # a synchronisation point of every H here: the replicas agree
                    with torch.no_grad():
                        losses.append(torch.nn.functional.mse_loss(model(x_all), y_all).item())
        result[name] = {"allreduced": group.allreduced, "losses": losses}
        manager.shutdown(wait=False)
    (root / f"synced_{replica}.json").write_text(json.dumps(result))
