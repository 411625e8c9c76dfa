"""Every c10d op a rank makes (seen by a TorchDispatchMode) and its wire cost; a from-scratch `collective` is one op."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# Bytes one rank sends per byte of payload, in a group of n ranks. Ring algorithms (what NCCL runs): all-reduce is a
# reduce-scatter then an all-gather, each passing (n-1)/n of the tensor; broadcast is a pipelined chain, where every
# rank but the last forwards the whole tensor (nccl-tests' bus factor 1); in a reduce every rank but the root sends the
# tensor once (to the next in a chain, or its parent in a tree), (n-1)/n per rank on average, so a loop of reduces, one
# chunk to each rank, costs a reduce-scatter. The payload of an all-to-all and a send is already what leaves the rank.
CostModel = dict[str, Callable[[int], float]]
RING: CostModel = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: (n - 1) / n,
    "all_to_all": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
    "barrier": lambda n: 0.0,
    # every rank but the root sends its tensor to the root (gather), or receives its chunk from it (scatter)
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
}
# gloo's reduce-scatter is an all-reduce on the wire (measured in notebook 03).
GLOO = {**RING, "reduce_scatter": RING["all_reduce"]}


def sent_per_rank(op: str, payload: float, n: int, model: CostModel = RING) -> float:
    """Bytes one rank sends for one `op` call on `payload` bytes in a group of `n` ranks (every formula's cost)."""
    return model[op](n) * payload


@dataclass(frozen=True)
class Call:
    """One communication on this rank; nbytes is its payload as _OPS measures it (a collective's full tensor)."""

    op: str  # all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all, send, recv, barrier, ...
    group: tuple[int, ...]  # the global ranks of the process group
    nbytes: int
    dtype: torch.dtype
    phase: str  # "backward" inside autograd's backward pass, else "forward"
    inside: str | None = None  # the from-scratch collective this call is part of
    peer: int | None = None  # the global rank a send goes to or a receive comes from (None: any source)


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _first(tensors: Any) -> torch.Tensor:
    return tensors if isinstance(tensors, torch.Tensor) else _first(tensors[0])


def _group(group: Any) -> dist.ProcessGroup:
    if isinstance(group, str):  # functional collectives carry the group's name
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(cast(Any, group))
    return dist.ProcessGroup.unbox(group)  # c10d ops carry it boxed


def _to_others(input: torch.Tensor, splits: list[int], group: dist.ProcessGroup) -> int:
    """Bytes of an all-to-all's input that leave this rank (equal splits when `splits` is empty)."""
    n, me = group.size(), group.rank()
    rows = splits or [input.shape[0] // n] * n
    per_row = input[0].numel() * input.element_size() if len(input) else 0  # a rank may have no rows to send
    return (sum(rows) - rows[me]) * per_row


# dispatched op -> (the course's name, the index of its process group, payload in bytes from the op's arguments)
_OPS: dict[str, tuple[str, int, Callable[[tuple], int]]] = {
    "c10d.allreduce_": ("all_reduce", 1, lambda a: _nbytes(a[0])),
    "c10d.allreduce_coalesced_": ("all_reduce", 1, lambda a: _nbytes(a[0])),
    "c10d._allgather_base_": ("all_gather", 2, lambda a: _nbytes(a[0])),
    "c10d.allgather_": ("all_gather", 2, lambda a: _nbytes(a[0][0])),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", 2, lambda a: _nbytes(a[0])),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 2, lambda a: _nbytes(a[1])),
    "c10d.reduce_scatter_": ("reduce_scatter", 2, lambda a: _nbytes(a[1][0])),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", 2, lambda a: _nbytes(a[1])),
    "c10d.broadcast_": ("broadcast", 1, lambda a: _nbytes(a[0])),
    "c10d.reduce_": ("reduce", 1, lambda a: _nbytes(a[0])),
    "c10d.alltoall_base_": ("all_to_all", 2, lambda a: _to_others(a[1], list(a[4]), _group(a[2]))),
    "c10d.alltoall_": (
        "all_to_all",
        2,
        lambda a: sum(_nbytes(t) for i, t in enumerate(a[1]) if i != _group(a[2]).rank()),
    ),
    "c10d.send": ("send", 1, lambda a: _nbytes(a[0])),
    "c10d.recv_": ("recv", 1, lambda a: _nbytes(a[0])),
    "c10d.recv_any_source_": ("recv", 1, lambda a: _nbytes(a[0])),
    "c10d.gather_": ("gather", 2, lambda a: _nbytes(a[1])),  # a non-root rank has no output tensors
    "c10d.scatter_": ("scatter", 2, lambda a: _nbytes(a[0])),
    "c10d.barrier": ("barrier", 1, lambda a: 0),
    "_c10d_functional.all_reduce": ("all_reduce", 2, lambda a: _nbytes(a[0])),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", 2, lambda a: _nbytes(a[0]) * a[1]),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 3, lambda a: _nbytes(a[0])),
    "_c10d_functional.all_to_all_single": ("all_to_all", 3, lambda a: _to_others(a[0], list(a[2]), _group(a[3]))),
    "_c10d_functional.broadcast": ("broadcast", 2, lambda a: _nbytes(a[0])),
}

_recording: list[Recorder] = []  # the recorders inside their `with`, for collective() to reach


class Recorder(TorchDispatchMode):
    """``with Recorder() as rec:`` ... then ``rec.calls``, ``rec.counts()``, ``rec.sent_bytes()`` on this rank."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []
        self._inside: list[str] = []

    def __enter__(self) -> Recorder:
        _recording.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _recording.remove(self)
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from torch.distributed.tensor import DTensor

        if DTensor in types:  # let DTensor run first: its op becomes plain ops and collectives, dispatched back here
            return NotImplemented
        known = _OPS.get(f"{func.namespace}.{func._opname}")
        if known is not None:
            op, group_at, payload = known
            group = _group(args[group_at])
            peer = dist.get_global_rank(group, args[2]) if func._opname in ("send", "recv_") else None
            tensor = _first(args[1] if op == "gather" else args[0])
            self.record(op, tensor, group, payload(args), peer)
        return func(*args, **(kwargs or {}))

    def record(
        self, op: str, tensor: torch.Tensor, group: dist.ProcessGroup | None, nbytes: int, peer: int | None = None
    ) -> None:
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        # autograd's engine runs a graph task while it computes gradients, hooks and backward functions included
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        inside = self._inside[-1] if self._inside else None
        self.calls.append(Call(op, ranks, nbytes, tensor.dtype, phase, inside, peer))

    def counts(self, phase: str | None = None) -> dict[str, int]:
        return counts(self.calls, phase)

    def sent_bytes(self, model: CostModel = RING) -> float:
        return sent_bytes(self.calls, model)

    def wire_bytes(self) -> int:
        return wire_bytes(self.calls)

    def per_group(self) -> dict[tuple[str, tuple[int, ...]], tuple[int, int]]:
        return per_group(self.calls)

    def by_dimension(self, mesh: Any, model: CostModel = RING) -> dict[str, float]:
        return by_dimension(self.calls, mesh, model)


# What a record says. Each takes the calls (a Recorder's, or a list pulled from the ranks); the Recorder's methods of
# the same names apply them to its own.


def outermost(calls: list[Call], phase: str | None = None) -> list[Call]:
    """The calls that are not part of a from-scratch collective (in `phase` only, if given)."""
    return [c for c in calls if c.inside is None and phase in (None, c.phase)]


def counts(calls: list[Call], phase: str | None = None) -> dict[str, int]:
    """{op: calls}, a from-scratch collective counted once (not its sends), sorted by op."""
    table: dict[str, int] = {}
    for call in outermost(calls, phase):
        table[call.op] = table.get(call.op, 0) + 1
    return dict(sorted(table.items()))


def sent_bytes(calls: list[Call], model: CostModel = RING) -> float:
    """Bytes this rank sends for the calls, under the cost model `model` (RING or GLOO)."""
    return sum(sent_per_rank(c.op, c.nbytes, len(c.group), model) for c in outermost(calls))


def wire_bytes(calls: list[Call]) -> int:
    """Bytes this rank's own sends carried, those inside from-scratch collectives included: counted, no model."""
    return sum(c.nbytes for c in calls if c.op == "send")


def per_group(calls: list[Call]) -> dict[tuple[str, tuple[int, ...]], tuple[int, int]]:
    """{(op, group ranks): (calls, payload bytes)}: what each group communicated."""
    table: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = {}
    for c in outermost(calls):
        k, b = table.get((c.op, c.group), (0, 0))
        table[(c.op, c.group)] = (k + 1, b + c.nbytes)
    return table


def by_dimension(calls: list[Call], mesh: Any, model: CostModel = RING) -> dict[str, float]:
    """Bytes this rank sent per DeviceMesh dimension, each call charged to the dimension whose group it ran on."""
    names = mesh.mesh_dim_names if mesh is not None else ()
    groups = {name: tuple(dist.get_process_group_ranks(mesh[name].get_group())) for name in names}
    sent = dict.fromkeys(names, 0.0)
    for c in outermost(calls):
        dim = next((name for name, ranks in groups.items() if ranks == c.group), None)
        if dim is None:
            raise ValueError(f"{c.op} on ranks {c.group} ran on no dimension of the mesh {groups}")
        sent[dim] += model[c.op](len(c.group)) * c.nbytes
    return sent


@contextlib.contextmanager
def collective(op: str, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Announce a from-scratch collective: recorders count one `op` of `tensor` and mark the sends inside as its."""
    for rec in _recording:
        rec.record(op, tensor, group, _nbytes(tensor))
        rec._inside.append(op)
    try:
        yield
    finally:
        for rec in _recording:
            rec._inside.pop()
