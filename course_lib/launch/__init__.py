"""Kernel side of a fresh world per cell (magic, spec, launcher, processes, failures); rank side (worker, runtime).

Importing this package does not import torch: a rank imports it before recording its pid."""

from course_lib.launch.failures import RankFailedError, RankFailure, RunResult, RunTimeoutError
from course_lib.launch.launcher import launch, standalone_script
from course_lib.launch.processes import torchrun_env
from course_lib.launch.spec import LaunchError, RunSpec, available_gpus, resolve_backend
