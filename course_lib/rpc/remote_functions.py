"""Small remote functions and a remote model: the first examples of notebook 12."""

from __future__ import annotations

import contextlib
import io
import threading
import time
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
