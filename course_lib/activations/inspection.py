"""Looking at activation memory on any device: the tensors autograd saved, and the bytes alive at each moment.

- `saved_tensors`: walk the autograd graph from an output and list every tensor its nodes saved (which op,
  shape, dtype, bytes), each storage once: what `compare.saved_activation_bytes` counts, named.
- `LiveBytes`: a dispatch mode that records every tensor an op creates and, after each op, how many of their
  bytes are still alive: the bytes held at any moment and their peak, on the CPU as on a GPU, and whatever keeps
  a tensor alive (autograd's saved tensors, a checkpoint's inputs, selective checkpointing's cache).
- `matmul_flops`: the FLOPs of the matmuls a function runs, forward and backward (torch's FlopCounterMode).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from course_lib.compare import local_tensor

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def _storage_key(t: torch.Tensor) -> int:
    """The storage's identity (its StorageImpl), shared by every view; unlike data_ptr, not reused while we hold
    a weak reference to it, and distinct for two storages resized to 0 bytes."""
    return local_tensor(t).untyped_storage()._cdata


def saved_tensors(output: torch.Tensor, parameters: Iterable[torch.Tensor] = ()) -> list[dict[str, Any]]:
    """Every tensor saved by the graph behind `output`, parameters left out, each storage once.

    Rows: node (the backward op, e.g. NativeLayerNormBackward0), name (what it saved), shape, dtype, bytes (of the
    whole storage: a view counts what it keeps alive). A storage saved by several nodes is listed at the first
    one met, walking back from the output.
    """
    skip = {_storage_key(p) for p in parameters}
    rows: list[dict[str, Any]] = []
    stack, visited = [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for name in sorted(n for n in dir(node) if n.startswith("_saved_")):
            values = getattr(node, name)
            for t in values if isinstance(values, (tuple, list)) else [values]:
                if not isinstance(t, torch.Tensor) or _storage_key(t) in skip:
                    continue
                skip.add(_storage_key(t))
                local = local_tensor(t)
                rows.append(
                    {
                        "node": type(node).__name__,
                        "name": name.removeprefix("_saved_"),
                        "shape": tuple(local.shape),
                        "dtype": DTYPE_NAMES.get(local.dtype, str(local.dtype)),
                        "bytes": local.untyped_storage().nbytes(),
                    }
                )
        stack.extend(next_node for next_node, _ in node.next_functions)
    return rows


def _current_nbytes(ref: StorageWeakRef, recorded: int) -> int:
    """A live storage's size now: FSDP2 frees an unsharded parameter by resizing its storage to 0 bytes."""
    try:
        return torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
    except RuntimeError:  # a storage kind that cannot be looked at this way: its size when it was made
        return recorded


class LiveBytes(TorchDispatchMode):
    """Within `with LiveBytes() as live:`, the bytes of the tensors created since it began that are still alive.

    `live.now()` at any point; `live.peak` the largest value seen after any op; `live.mark(name)` records now()
    under a name (e.g. "after forward"). Storage is counted once however many views share it. Tensors made before
    the mode began (parameters, the input batch) are not counted, nor are a kernel's internal buffers.
    `live.now(communication=False)` leaves out the buffers a collective wrote into (FSDP's all-gather output):
    gloo's worker thread drops its reference to them a moment after the collective returns, so whether they are
    still alive right after one depends on scheduling, not on the program.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tensors: dict[int, tuple[StorageWeakRef, int]] = {}
        self.communication: set[int] = set()  # storages handed to a c10d collective
        self.peak = 0
        self.marks: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        if func.namespace == "c10d":
            self.communication |= inputs
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage_key(t) not in inputs:  # not a view or an in-place result
                storage = local_tensor(t).untyped_storage()
                if storage._cdata not in self.tensors:
                    self.tensors[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self.now())
        return out

    def now(self, communication: bool = True) -> int:
        """Bytes of the recorded tensors still alive (forgetting those that died), collectives' buffers included
        unless `communication=False`."""
        self.tensors = {k: v for k, v in self.tensors.items() if not v[0].expired()}
        self.communication &= self.tensors.keys()  # a dead storage's key may be reused by a new one
        kept = self.tensors if communication else {k: v for k, v in self.tensors.items() if k not in self.communication}
        return sum(_current_nbytes(ref, n) for ref, n in kept.values())

    def mark(self, name: str) -> int:
        self.marks[name] = self.now()
        return self.marks[name]


def matmul_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of the matmuls (linear layers, bmm, attention where torch has a formula) that fn() runs."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())
