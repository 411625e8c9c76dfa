"""The one rule that turns a requested backend into the one a run of N ranks uses.

'auto' means nccl with one GPU per rank when the ranks fit on this node's GPUs, gloo on CPU
processes otherwise (a laptop, or more ranks than GPUs). 'nccl' insists on one GPU per rank.
The kernel calls :func:`resolve_backend` with the number of ranks per node before anything starts;
a rank run by plain torchrun (a script saved with --save) calls it with its LOCAL_WORLD_SIZE.
gloo ranks on a GPU node see no GPU (launch.processes.agent_env), so they behave as on a laptop.
"""

from __future__ import annotations

import os

BACKENDS = ("auto", "gloo", "nccl")
# One process group serves CPU and CUDA tensors under NCCL: gloo carries the CPU ones.
NCCL_PROCESS_GROUP = "cpu:gloo,cuda:nccl"


class LaunchError(ValueError):
    """The request cannot run; the message says what to change. Raised before anything starts."""

    def _render_traceback_(self) -> list[str]:  # IPython shows this instead of kernel frames
        return [f"{type(self).__name__}: {self}"]


def available_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def visible_gpu(index: int) -> str:
    """The name CUDA_VISIBLE_DEVICES gives the `index`-th GPU this process sees, for a child that should see only
    that one: the index-th entry of an inherited CUDA_VISIBLE_DEVICES (a SLURM job's share of a node: "4,5,6,7"
    makes GPU 1 "5"; UUIDs stay UUIDs), else the index itself."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is None:
        return str(index)
    names = [name.strip() for name in inherited.split(",") if name.strip()]
    if not 0 <= index < len(names):
        raise LaunchError(f"GPU {index} is not among the {len(names)} in CUDA_VISIBLE_DEVICES={inherited!r}")
    return names[index]


def resolve_backend(requested: str = "auto", nproc: int | None = None) -> str:
    """'gloo' or 'nccl' for `requested` with `nproc` ranks per node (None: one); LaunchError if it cannot work."""
    if requested not in BACKENDS:
        raise LaunchError(f"unknown backend {requested!r}: use one of {', '.join(BACKENDS)}")
    if requested == "gloo":
        return "gloo"
    gpus, n = available_gpus(), 1 if nproc is None else nproc
    if requested == "auto":
        return "nccl" if 0 < n <= gpus else "gloo"
    if gpus == 0:
        raise LaunchError("--backend nccl needs CUDA GPUs and this machine has none: use --backend gloo")
    if n > gpus:
        raise LaunchError(
            f"{n} ranks with nccl need {n} GPUs, this node has {gpus}: "
            f"use -n {gpus} or less, or --backend auto (gloo on CPU processes when the ranks do not fit)"
        )
    return "nccl"


def backend_for(nproc: int, requested: str = "auto") -> str:
    """The backend of a cell of `nproc` ranks in a notebook run with BACKEND=`requested`.

    A notebook's own world sizes (a partner for rank 0, a 4-rank grid) may exceed the GPUs that
    NPROC fits: such a cell runs on CPU processes rather than ask nccl for GPUs that are not there.
    """
    return "gloo" if requested == "gloo" else resolve_backend("auto", nproc)


def describe(backend: str, nproc: int, init: bool = True) -> str:
    """One line saying what a run got, on a machine with GPUs ('' without: there gloo is the only choice).

    `init=False` (`--no-init`): no process group is made, so no backend either: the line says which GPUs the ranks
    see, and the cell decides what to use (RPC's cells in notebook 12 use none)."""
    gpus = available_gpus()
    if not gpus:
        return ""
    if not init:
        seen = "the node's GPUs visible to them" if backend == "nccl" else "GPUs hidden from them"
        return f"--no-init: {nproc} ranks, no process group made for them, {seen} ({gpus} on this node)\n"
    if backend == "nccl":
        return f"backend nccl: {nproc} ranks, one GPU each ({gpus} on this node)\n"
    return f"backend gloo: {nproc} ranks as CPU processes, GPUs hidden from them ({gpus} on this node)\n"
