"""Looking at tensors across layouts: every "equal to the reference" and "bytes on this rank" goes through here."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a DTensor (a collective: every rank calls it), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def grad_of(parameter: torch.Tensor, name: str = "") -> torch.Tensor:
    """`parameter.grad`, or a clear error when backward never reached it (`name` says which)."""
    if parameter.grad is None:
        raise ValueError(f"parameter {name or '(unnamed)'!r} has no gradient: did backward run through it?")
    return parameter.grad


def full_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by name, whole, detached, on the CPU (a collective for sharded parameters)."""
    return {name: full_tensor(p).detach().cpu() for name, p in module.named_parameters()}


def full_gradients(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by name, whole, detached, on the CPU (a collective when sharded)."""
    return {name: full_tensor(grad_of(p, name)).detach().cpu() for name, p in module.named_parameters()}


Comparable = torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor] | nn.Module


def max_difference(got: Comparable, expected: Comparable) -> float:
    """The largest |got - expected| over every element."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    if isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor):
        pairs = [(got, expected)]
    elif isinstance(got, Mapping) and isinstance(expected, Mapping):
        missing = sorted(set(got) - set(expected))
        if missing:
            raise ValueError(f"names missing from the reference: {missing}")
        pairs = [(got[name], expected[name]) for name in got]
    elif isinstance(got, nn.Module) and isinstance(expected, nn.Module):
        pairs = _same_length(list(got.parameters()), list(expected.parameters()), "parameters")
    elif isinstance(got, Sequence) and isinstance(expected, Sequence):
        pairs = _same_length(list(got), list(expected), "tensors")
    else:
        raise TypeError(f"cannot compare {type(got).__name__} with {type(expected).__name__}")
    if not pairs:
        raise ValueError("nothing to compare")
    return max(_difference(a, b) for a, b in pairs)


def _same_length(a: list, b: list, what: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if len(a) != len(b):
        raise ValueError(f"different numbers of {what}: {len(a)} vs {len(b)}")
    return list(zip(a, b))


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = full_tensor(a).detach(), full_tensor(b).detach()
    if a.shape != b.shape:
        raise ValueError(f"different shapes: {tuple(a.shape)} vs {tuple(b.shape)}")
    return float((a.to(b.device) - b).abs().max())


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got - expected| / max(max |expected|, 1)."""
    return ((got.to(expected.device) - expected).abs().max() / expected.abs().max().clamp_min(1.0)).item()


def bytes_per_rank(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank stores for `tensors` (its shard of each DTensor)."""
    return sum(local_tensor(t).numel() * t.element_size() for t in tensors)


def saved_activation_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for backward on this rank during `module(x)`."""
    parameters = {local_tensor(p).untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = local_tensor(t).untyped_storage()
        if storage.data_ptr() not in parameters:
            seen[storage.data_ptr()] = storage.nbytes()
        return t.detach()  # not t: an op saving its own output would keep its graph alive in a cycle

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())
