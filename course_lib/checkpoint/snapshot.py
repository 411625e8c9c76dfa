"""The classic pattern: gather the full state, and rank 0 saves it in one file."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from course_lib.checkpoint.atomic import _barrier, _rank_world


def save_full_snapshot(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int
) -> None:
    """Gather the full model and optimizer state onto rank 0 and write one torch.save file there.

    Every rank takes part in the gather; only rank 0 holds the result (cpu_offload) and writes it,
    to a temporary name first, so a crash never leaves a half-written file under the real name.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    rank, _ = _rank_world()
    if rank == 0:
        path = Path(path)
        partial = path.with_name(path.name + ".tmp")
        torch.save({"model": model_state, "optimizer": optimizer_state, "step": step}, partial)
        os.replace(partial, path)  # atomic: the old file or the new one, never half of one
    _barrier()  # nobody goes on (or exits) before the file is complete


def load_full_snapshot(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Every rank reads the full file and keeps its own shard (set_state_dict reshards). Returns the step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    snapshot = torch.load(path, map_location="cpu", weights_only=True)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=snapshot["model"],
        optim_state_dict=snapshot["optimizer"],
        options=StateDictOptions(full_state_dict=True),
    )
    return snapshot["step"]
