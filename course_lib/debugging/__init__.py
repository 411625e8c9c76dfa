"""Notebook 12: debugging and monitoring distributed training.

- :mod:`.environment`: what each rank runs on, where ranks disagree, the readable part of a DETAIL mismatch;
- :mod:`.checksums`: one checksum per gradient tensor, compared across ranks with MAX and MIN;
- :mod:`.debugger`: `DistributedDebugger`, the desync check and the NaN/Inf hooks;
- :mod:`.monitor`, :mod:`.train`: time, throughput and memory per step, and the monitored training run;
- :mod:`.traces`: what a chrome trace written by torch.profiler holds;
- :mod:`.logs`: what TORCH_CPP_LOG_LEVEL, TORCH_DISTRIBUTED_DEBUG and NCCL_DEBUG print, filtered and sanitized;
- :mod:`.stacks`, :mod:`.flight`, :mod:`.hang`: a hang diagnosed from outside: py-spy stack dumps of every rank,
  the flight recorder's last collectives, the job ended with nothing left behind;
- :mod:`.nccl`: NCCL only: a collective that times out under each error-handling mode;
- :mod:`.stragglers`: each rank's step split into its own work and its wait for the slowest rank;
- :mod:`.figures`: the live per-step plot, the straggler figure and the throughput explorer (kernel-only);
- :mod:`.checkers`: the exercises' checkers (gradients in sync; a rank that skips a collective).
"""

from course_lib.debugging.checkers import check_gradients_in_sync, check_mean_finite_loss
from course_lib.debugging.checksums import checksum_range, gradient_checksums
from course_lib.debugging.debugger import DistributedDebugger, GradientDesyncError, NonFiniteError, NonFiniteEvent
from course_lib.debugging.environment import differing_keys, environment_report, mismatch_fingerprints
from course_lib.debugging.figures import LiveStepPlot, draw_throughput, plot_stragglers
from course_lib.debugging.hang import arm_for_diagnosis, diagnose_hang, processes_of, settled_stacks
from course_lib.debugging.logs import c10d_log, nccl_log, rank_lines, sanitize
from course_lib.debugging.monitor import memory_mb
from course_lib.debugging.nccl import nccl_timeout
from course_lib.debugging.stacks import describe, dump_stack, main_thread, parse_dump
from course_lib.debugging.stragglers import straggler_steps
from course_lib.debugging.traces import allreduce_sizes, is_allreduce, trace_event_names
from course_lib.debugging.train import train_monitored
