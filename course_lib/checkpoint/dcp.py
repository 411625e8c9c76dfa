"""torch DCP (each rank writes its shards, one index maps them), safetensors out and back, and same-weights starts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from course_lib.checkpoint.atomic import _barrier, _commit, _prepare, _rank_world, verify
from course_lib.launch.runtime import rank_device
from course_lib.models import MLP, shard_layers_then_root


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
    """Verify, then load in place at any world size; OPTIONAL values the checkpoint lacks are dropped (DCP refuses)."""
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
        """Block until the save in flight is on disk and committed, on every rank."""
        if self.pending is None:
            return
        future, partial, final = self.pending
        self.pending = None
        future.result()  # on rank 0 this returns after every rank's data and the metadata are written
        if _rank_world()[0] == 0:
            _commit(partial, final)
        if self.group is not None:
            dist.barrier(group=self.group)  # no rank goes on to read it before rank 0 has renamed it


CONSOLIDATED = "model-00001-of-00001.safetensors"  # DCP's name for file 1 of 1 (Hugging Face's pattern)


def save_safetensors(directory: str | os.PathLike, model: torch.nn.Module) -> Path:
    """Every rank writes its shards to directory/sharded/, then rank 0 consolidates them into one file.

    `save_distributed=True`: each rank writes what it holds (its safetensors header records the offsets of
    its rows in the full tensor). `enable_consolidation=True`: rank 0 then stitches the shards into
    directory/model-00001-of-00001.safetensors, plus the index (model.safetensors.index.json) that
    Hugging Face's loaders read. Returns the consolidated file's path, written when every rank returns.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    writer = dcp.HuggingFaceStorageWriter(str(directory), save_distributed=True, enable_consolidation=True)
    dcp.save(get_model_state_dict(model), storage_writer=writer)
    return Path(directory) / CONSOLIDATED


def load_safetensors(directory: str | os.PathLike, model: torch.nn.Module) -> None:
    """Load the safetensors files in `directory` (not its sharded/ copy) into `model`, in place.

    The template is this job's state dict: its DTensors say which rows this rank holds, and the reader
    fetches exactly those slices of each tensor, whatever layout saved the file.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = get_model_state_dict(model)
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(directory)))
    set_model_state_dict(model, state)


def empty_sharded_mlp(**mlp_kwargs: Any) -> torch.nn.Module:
    """The FSDP2 MLP built on the meta device (shapes, no storage, no init), then given uninitialised
    storage for this rank's shards only: nothing the size of the whole model is ever allocated."""
    with torch.device("meta"):
        model = shard_layers_then_root(MLP(**mlp_kwargs))
    return model.to_empty(device=rank_device())


def from_seed_checkpoint(directory: str | os.PathLike, **mlp_kwargs: Any) -> torch.nn.Module:
    """torchtitan's seed checkpoint: every rank reads its own rows of one file saved once (any layout)."""
    model = empty_sharded_mlp(**mlp_kwargs)
    load_safetensors(directory, model)
    return model


def from_rank0(full_state: dict[str, torch.Tensor], **mlp_kwargs: Any) -> torch.nn.Module:
    """Rank 0 holds the whole state (`full_state`; ignored elsewhere) and sends each rank its shards.

    torch broadcasts one whole tensor at a time and every rank keeps its rows of it: rank 0 needs the whole
    model in memory, every other rank its shards plus the largest tensor, briefly."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = empty_sharded_mlp(**mlp_kwargs)
    on_rank0 = not dist.is_initialized() or dist.get_rank() == 0
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # a copy: set_model_state_dict puts the model's own (sharded) tensors into the dict it is given
    set_model_state_dict(model, dict(full_state) if on_rank0 else {}, options=options)
    return model


def gathered_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0, on the CPU ({} on the other ranks): what a comparison needs."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}
