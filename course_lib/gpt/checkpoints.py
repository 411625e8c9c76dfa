"""Checkpoint and resume for the capstone, with notebook 06's DCP pieces (AppState, dcp_save, dcp_load)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from course_lib.compare import full_tensor


def save(root: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Path:
    """dcp.save of model, optimizer and step into root/step_<step> (committed when complete)."""
    from course_lib.checkpoint import AppState, dcp_save

    return dcp_save(root, step, AppState(model, optimizer, step))


def load(root: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the newest complete checkpoint under `root` into this layout's model and optimizer; its step."""
    from course_lib.checkpoint import AppState, dcp_load, latest_complete

    app = AppState(model, optimizer)
    directory, _ = latest_complete(root)
    if directory is None:
        raise FileNotFoundError(f"no complete checkpoint under {root}")
    dcp_load(directory, app)
    return app.step


def fingerprint(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of every value of the state, whole, by name (a collective when sharded: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from course_lib.compose import quiet_full_tensor

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state_by_key: Any = optimizer_state["state"]
    named: dict[str, Any] = {f"model.{k}": v for k, v in model_state.items()}
    for key, state in state_by_key.items():
        named.update({f"optimizer.{key}.{name}": value for name, value in state.items()})
    digest = hashlib.sha256()
    with quiet_full_tensor():
        for name in sorted(named):
            value = named[name]
            if isinstance(value, torch.Tensor):
                value = full_tensor(value).detach().cpu().contiguous()
                digest.update(name.encode() + value.numpy().tobytes())
    return digest.hexdigest()[:16]
