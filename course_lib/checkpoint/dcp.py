"""torch's distributed checkpoint (DCP): every rank writes its own shards, one index says where each piece lives."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from course_lib.checkpoint.atomic import _barrier, _commit, _prepare, _rank_world
from course_lib.checkpoint.integrity import verify
from course_lib.launch.runtime import rank_device


class AppState(Stateful):
    """Everything a resumed job needs: model, optimizer, step and RNG state.

    DCP calls `state_dict()` when saving, and when loading it first calls `state_dict()` for a template
    (the sharded tensors of *this* job's world size), fills it from the files, then calls
    `load_state_dict()`. `get_state_dict` / `set_state_dict` turn FSDP2's sharded parameters and the
    optimizer's per-parameter state into the plain, fully-qualified names that DCP stores.
    The ranks of this course draw identical random numbers (same seed, same calls), so one RNG state is
    saved; with per-rank generators save one per rank under rank-specific names. A rank on a GPU also saves
    that GPU's generator ("cuda_rng", a list of its state's bytes: a Python value, not a tensor). It is
    OPTIONAL: a checkpoint saved on CPU ranks has none, and a CPU rank loading a GPU checkpoint ignores it.
    """

    OPTIONAL = ("cuda_rng",)  # loaded only when the checkpoint has it (dcp_load and load_sharded check)

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int = 0) -> None:
        self.model, self.optimizer, self.step = model, optimizer, step
        device = rank_device()
        self.cuda_device = device if device.type == "cuda" else None
        self.absent: set[str] = set()  # OPTIONAL names the checkpoint being loaded lacks

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state, "step": self.step, "rng": torch.get_rng_state()}
        if self.cuda_device is not None and "cuda_rng" not in self.absent:
            state["cuda_rng"] = torch.cuda.get_rng_state(self.cuda_device).tolist()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        self.step = state["step"]
        torch.set_rng_state(state["rng"])
        if self.cuda_device is not None and "cuda_rng" in state:
            torch.cuda.set_rng_state(torch.tensor(state["cuda_rng"], dtype=torch.uint8), self.cuda_device)


def dcp_save(root: str | os.PathLike, step: int, app: AppState) -> Path:
    """dcp.save into step_N.tmp, then commit (rename) to step_N. Blocks training until the files are written."""
    import torch.distributed.checkpoint as dcp

    partial, final = _prepare(Path(root), step)
    dcp.save({"app": app}, checkpoint_id=partial)  # returns on every rank after rank 0 wrote .metadata
    if _rank_world()[0] == 0:
        _commit(partial, final)
    _barrier()
    return final


def dcp_load(directory: str | os.PathLike, app: AppState) -> None:
    """Verify, then load into `app` in place (any world size: DCP reads the overlapping pieces).
    OPTIONAL values the checkpoint lacks are left out of the template: DCP would refuse them."""
    import torch.distributed.checkpoint as dcp

    verify(directory)
    saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    app.absent = {name for name in app.OPTIONAL if f"app.{name}" not in saved}
    try:
        dcp.load({"app": app}, checkpoint_id=directory)
    finally:
        app.absent = set()


class AsyncCheckpointer:
    """dcp.async_save with the rules that make it safe.

    1. `async_save` returns once the state is staged (copied to CPU memory); a background thread writes the files.
       The next save first waits for the previous one: two in flight would double the staging memory.
    2. Only a finished save is committed (renamed); its collectives run on a gloo group of their own.
    3. One writer serves every save (`checkpoint_id=` names each directory): on GPUs its stager keeps one pinned
       CPU buffer across saves (`cache_staged_state_dict=True`); a new writer per save would pin a new one.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        import torch.distributed.checkpoint as dcp

        self.root = Path(root)
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.pending: tuple[Any, Path, Path] | None = None  # (future, partial, final)
        self.root.mkdir(parents=True, exist_ok=True)
        self.writer = dcp.FileSystemWriter(self.root, cache_staged_state_dict=torch.cuda.is_available())

    def save(self, step: int, app: AppState) -> None:
        import torch.distributed.checkpoint as dcp

        self.wait()
        partial, final = _prepare(self.root, step)
        future = dcp.async_save(
            {"app": app}, checkpoint_id=partial, storage_writer=self.writer, process_group=self.group
        )
        self.pending = (future, partial, final)

    def wait(self) -> None:
        """Block until the save in flight is on disk, and commit it."""
        if self.pending is None:
            return
        future, partial, final = self.pending
        self.pending = None
        future.result()  # on rank 0 this returns after every rank's data and the metadata are written
        if _rank_world()[0] == 0:
            _commit(partial, final)
