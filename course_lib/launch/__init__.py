"""The kernel side of a fresh world per cell, and the rank side it starts.

    magic      `%%torchrun`: its flags, defined once -> a RunSpec
    spec       RunSpec: the run, described and checked once; RunDir: the files kernel and ranks share; 'auto' ->
               gloo or nccl, in one place
    launcher   launch(): writes the run directory, starts torchrun, waits, reports rank output (grouped or
               streamed) and --out values; standalone_script
    processes  the torchrun agent and the ranks: started, watched, every one ended
    failures   what a run returns (RunResult) and which rank failed and how: RankFailedError, RunTimeoutError
    worker     what torchrun starts on each rank (not imported here: torchrun runs it as __main__)
    runtime    the process group inside a rank

Importing this package does not import torch (a rank imports it before recording its pid).
"""

from course_lib.launch.failures import RankFailedError, RankFailure, RunResult, RunTimeoutError
from course_lib.launch.launcher import launch, standalone_script
from course_lib.launch.processes import torchrun_env
from course_lib.launch.spec import LaunchError, RunSpec, available_gpus, resolve_backend
