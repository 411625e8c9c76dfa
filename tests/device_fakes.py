"""Checkers on a device this machine does not have: rank_device() answers "meta", in a one-rank torch.distributed
whose collectives leave their tensors as they are. A fake learner function records the devices of what it was
given and raises Reached, so a test sees where a checker built its data without computing anything on it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from course_lib.exercises import calls

META = torch.device("meta")


class Reached(BaseException):
    """The checker called the learner's function (a BaseException: no checker's `except Exception` takes it)."""


def on_meta(monkeypatch: pytest.MonkeyPatch, *modules: Any) -> None:
    """`rank_device` of each module returns the meta device; dist is a world of one rank that changes nothing."""
    for module in modules:
        monkeypatch.setattr(module, "rank_device", lambda: META)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *args, **kwargs: None)
    monkeypatch.setattr(dist, "all_gather", lambda tensors, tensor, *args, **kwargs: None)
    monkeypatch.setattr(dist, "new_group", lambda *args, **kwargs: object())
    monkeypatch.setattr(calls, "lowered_timeout", lambda seconds: contextlib.nullcontext())


def recorder(devices: list[torch.device]) -> Callable[..., Any]:
    """A learner's function that appends the device of every tensor argument to `devices`, then raises Reached."""

    def fn(*args: Any) -> Any:
        devices.extend(a.device for a in args if isinstance(a, torch.Tensor))
        devices.extend(t.device for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor))
        raise Reached

    return fn
