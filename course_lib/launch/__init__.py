"""The kernel side of a fresh world per cell, and the rank side it starts.

    magic     `%%torchrun`: flags -> a RunSpec
    spec      the run, described once, validated once, shared with the worker through the run directory
    backend   'auto' -> gloo or nccl, in one place
    launcher  starts torchrun, waits, ends every process, reports
    worker    what torchrun starts on each rank; runtime: the process group inside a rank
    runner    executes whole notebooks with papermill

Importing this package does not import torch (a rank imports it before recording its pid).
"""

from course_lib.launch.backend import BACKENDS, LaunchError, available_gpus, resolve_backend
from course_lib.launch.launcher import (
    DEFAULT_TIMEOUT_S,
    RankFailedError,
    RankFailure,
    RunResult,
    RunTimeoutError,
    launch,
    standalone_script,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT_S",
    "LaunchError",
    "RankFailedError",
    "RankFailure",
    "RunResult",
    "RunTimeoutError",
    "available_gpus",
    "launch",
    "resolve_backend",
    "standalone_script",
]
