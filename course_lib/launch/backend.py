"""The one place that turns a requested backend into the one the ranks use.

'auto' means nccl with one GPU per rank where CUDA GPUs exist, gloo on the CPU. The kernel calls
:func:`resolve_backend` with the number of ranks per node, to refuse impossible requests before
anything starts; a rank calls it without, for scripts run by plain torchrun.
"""

from __future__ import annotations

BACKENDS = ("auto", "gloo", "nccl")


class LaunchError(ValueError):
    """The request cannot run; the message says what to change. Raised before anything starts."""

    def _render_traceback_(self) -> list[str]:  # IPython shows this instead of kernel frames
        return [f"{type(self).__name__}: {self}"]


def available_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(requested: str = "auto", nproc: int | None = None) -> str:
    """'gloo' or 'nccl' for `requested`; LaunchError when it cannot work with `nproc` ranks per node."""
    if requested not in BACKENDS:
        raise LaunchError(f"unknown backend {requested!r}: use one of {', '.join(BACKENDS)}")
    gpus = available_gpus() if requested in ("auto", "nccl") else 0
    backend = ("nccl" if gpus else "gloo") if requested == "auto" else requested
    if backend == "nccl":
        if gpus == 0:
            raise LaunchError("--backend nccl needs CUDA GPUs and this machine has none: use --backend gloo")
        if nproc is not None and nproc > gpus:
            raise LaunchError(
                f"{nproc} ranks with nccl need {nproc} GPUs, this node has {gpus}: "
                f"use -n {gpus} or less, or --backend gloo"
            )
    return backend
