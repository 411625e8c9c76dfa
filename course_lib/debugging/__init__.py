"""Notebook 14: debugging and monitoring distributed training.

- :mod:`.environment`: what each rank runs on, where ranks disagree, the readable part of a DETAIL mismatch;
- :mod:`.checksums`: one checksum per gradient tensor, compared across ranks with MAX and MIN;
- :mod:`.debugger`: `DistributedDebugger`, the desync check and the NaN/Inf hooks;
- :mod:`.train`: the monitored training run;
- :mod:`.stacks`, :mod:`.flight`, :mod:`.hang`: a hang diagnosed from outside: py-spy stack dumps of every rank,
  the flight recorder's last collectives, the job ended with nothing left behind;
- :mod:`.stragglers`: each rank's step split into its own work and its wait for the slowest rank;
- :mod:`.lab`: what TORCH_CPP_LOG_LEVEL, TORCH_DISTRIBUTED_DEBUG and NCCL_DEBUG print, filtered and sanitized;
  NCCL only, a collective that times out under each error-handling mode; time, throughput and memory per step
  (StepMonitor); what a chrome trace written by torch.profiler holds; the live per-step plot, the straggler figure
  and the throughput explorer (kernel-only);
- :mod:`.checkers`: the exercises' checkers (gradients in sync; a rank that skips a collective).
"""

from course_lib.debugging.checkers import check_gradients_in_sync, check_mean_finite_loss
from course_lib.debugging.checksums import checksum_range, gradient_checksums
from course_lib.debugging.debugger import DistributedDebugger, GradientDesyncError, NonFiniteError, NonFiniteEvent
from course_lib.debugging.environment import differing_keys, environment_report, mismatch_fingerprints
from course_lib.debugging.hang import arm_for_diagnosis, diagnose_hang, processes_of, settled_stacks
from course_lib.debugging.lab import (
    LiveStepPlot,
    allreduce_sizes,
    c10d_log,
    draw_hang,
    draw_throughput,
    is_allreduce,
    memory_mb,
    nccl_log,
    nccl_timeout,
    plot_stragglers,
    rank_lines,
    sanitize,
    trace_event_names,
)
from course_lib.debugging.stacks import describe, dump_stack, main_thread, parse_dump
from course_lib.debugging.stragglers import straggler_steps
from course_lib.debugging.train import train_monitored
