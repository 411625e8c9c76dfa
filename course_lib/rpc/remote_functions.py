"""Notebook 12's first RPC examples. RPC pickles functions by reference: what a worker calls lives at module level."""

from __future__ import annotations

import contextlib
import io
import os
import re
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

from course_lib.models import seeded


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
    """Collect what this process's RPC threads print to stderr."""
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
        with seeded(seed):
            self.linear = nn.Linear(d_in, d_out)
        # No threading.Lock in here: `rref.to_here()` pickles the whole object, and a lock cannot be pickled.

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def describe(self) -> str:
        n_parameters = sum(p.numel() for p in self.parameters())
        return f"RemoteModel with {n_parameters} parameters, running on {rpc.get_worker_info().name}"


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
