"""Checkers see a learner's communication, turn hangs into errors; reports use a side gloo group, safe from desync."""

from __future__ import annotations

import contextlib
import datetime
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from course_lib import comms
from course_lib.exercises import ExerciseFailed

COLLECTIVES = (
    "all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather_object",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "broadcast",
    "broadcast_object_list",
    "all_to_all",
    "all_to_all_single",
    "barrier",
)
BLOCKING_P2P = ("send", "recv")
NONBLOCKING_P2P = ("isend", "irecv", "batch_isend_irecv")
COMMUNICATION = COLLECTIVES + BLOCKING_P2P + NONBLOCKING_P2P  # every call record_calls can refuse
DEADLOCK_S = 8.0  # a checked function still waiting this long in a collective, a send or a recv is deadlocked


@dataclass
class record_calls:
    """Wrap torch.distributed's communication: forbidden calls raise ExerciseFailed, the rest go to a comms.Recorder."""

    forbidden: Iterable[str] = ()
    advice: str = ""
    bound_s: float | None = None  # bounds gloo sends/recvs only: NCCL's wait does not block the host

    def __enter__(self) -> comms.Recorder:
        self._saved = {name: getattr(dist, name) for name in COMMUNICATION if hasattr(dist, name)}
        self._saved["P2POp"] = original_op = dist.P2POp
        blocked = set(self.forbidden)
        for name, original in list(self._saved.items())[:-1]:
            setattr(dist, name, self._wrap(name, original, name in blocked))
        # P2POp accepts only the real isend/irecv: hand it those behind the wrappers
        dist.P2POp = _unwrapping(original_op)  # type: ignore[misc,assignment]
        self._recorder = comms.Recorder()
        return self._recorder.__enter__()

    def _wrap(self, name: str, original: Callable, blocked: bool) -> Callable:
        # A blocking send/recv, bounded: post it and wait at most bound_s (gloo's recv ignores the group timeout)
        post = self._saved.get("i" + name) if name in BLOCKING_P2P and self.bound_s is not None else None

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if blocked:
                raise ExerciseFailed(f"dist.{name} is not allowed here: {self.advice}")
            if post is not None:  # blocking: post it, then wait at most bound_s
                work = post(*args, **kwargs)
                if work is not None:
                    _BoundedWork(work, self.bound_s or 0.0, name).wait()
                # dist.recv returns the sender's rank, dist.send None
                return kwargs.get("src", args[1] if len(args) > 1 else None) if name == "recv" else None
            posted = original(*args, **kwargs)
            if self.bound_s is None or name not in NONBLOCKING_P2P:
                return posted
            if isinstance(posted, list):  # batch_isend_irecv
                return [_BoundedWork(work, self.bound_s, name) for work in posted]
            return _BoundedWork(posted, self.bound_s, name) if posted is not None else None

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._recorder.__exit__(kind, error, trace)
        for name, original in self._saved.items():
            setattr(dist, name, original)


class _BoundedWork:
    """A send or recv handle whose wait() gives up after `seconds` (the rest is the handle's own)."""

    def __init__(self, work: Any, seconds: float, name: str) -> None:
        self._work, self._seconds, self._name = work, seconds, name

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._work.wait(datetime.timedelta(seconds=self._seconds)) is False:
            raise RuntimeError(f"dist.{self._name} timed out after {self._seconds:g} s")
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _unwrapping(original_op: type[dist.P2POp]) -> Callable[..., dist.P2POp]:
    def make(op: Callable, *args: Any, **kwargs: Any) -> dist.P2POp:
        return original_op(getattr(op, "__wrapped__", op), *args, **kwargs)

    return make


def run_bounded(fn: Callable[..., Any], *args: Any, seconds: float = DEADLOCK_S) -> tuple[Any, BaseException | None]:
    """fn(*args) under a `seconds` group timeout, so an unmatched collective fails fast: (result, None) or (None, e)."""
    with lowered_timeout(seconds):
        try:
            return fn(*args), None
        except ExerciseFailed:
            raise
        except Exception as error:  # the learner's code: any error is a report, not a crash of the checker
            return None, error


@contextlib.contextmanager
def lowered_timeout(seconds: float) -> Iterator[None]:
    """The default group's timeout is `seconds` inside, and its own again after (the session's, or torchrun's)."""
    from torch.distributed import distributed_c10d as c10d

    world = dist.group.WORLD
    assert world is not None
    own = world._get_backend(world._device_types[0]).options._timeout  # every backend of the group has the same
    c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), world)
    try:
        yield
    finally:
        c10d._set_pg_timeout(own, world)


def side_group() -> dist.ProcessGroup:
    """A gloo group of every rank, apart from the learner's: create it before calling the learner's function."""
    group = dist.new_group(backend="gloo")
    assert group is not None
    return group


def gather_reports(report: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's `report` (any picklable value), in rank order, through the side group."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, report, group=group)
    return out


def secret_values(shape: tuple[int, ...] = ()) -> torch.Tensor:
    """Whole numbers in [-50, 50] that differ between ranks and between calls (seeded by the OS, not the rank)."""
    gen = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    return torch.randint(-50, 51, shape, generator=gen).float()
