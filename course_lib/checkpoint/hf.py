"""Out to Hugging Face safetensors and back, through DCP; and two ways to start every layout from the same weights."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from course_lib.launch.runtime import rank_device
from course_lib.models import MLP, shard_layers_then_root

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
