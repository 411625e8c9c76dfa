"""Notebook 14: debugging and monitoring distributed training."""

from course_lib.debugging.checkers import check_gradients_in_sync, check_mean_finite_loss
from course_lib.debugging.debugger import (
    DistributedDebugger,
    GradientDesyncError,
    NonFiniteError,
    NonFiniteEvent,
    checksum_range,
    gradient_checksums,
)
from course_lib.debugging.environment import differing_keys, environment_report, mismatch_fingerprints
from course_lib.debugging.hang import arm_for_diagnosis, diagnose_hang, settled_stacks
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
from course_lib.debugging.stragglers import straggler_steps, train_monitored
