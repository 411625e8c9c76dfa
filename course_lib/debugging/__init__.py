"""Notebook 12: debugging and monitoring distributed training.

- :mod:`.environment`: what each rank runs on, where ranks disagree, the readable part of a DETAIL mismatch;
- :mod:`.checksums`: one checksum per gradient tensor, compared across ranks with MAX and MIN;
- :mod:`.debugger`: `DistributedDebugger`, the desync check and the NaN/Inf hooks;
- :mod:`.monitor`, :mod:`.train`: time, throughput and memory per step, and the monitored training run;
- :mod:`.traces`: what a chrome trace written by torch.profiler holds;
- :mod:`.figures`: the live per-step plot (kernel-only);
- :mod:`.checkers`: the exercises' checkers (gradients in sync; a rank that skips a collective).
"""

from course_lib.debugging.checkers import check_gradients_in_sync, check_mean_finite_loss
from course_lib.debugging.checksums import checksum_range, gradient_checksums
from course_lib.debugging.debugger import DistributedDebugger, GradientDesyncError, NonFiniteError, NonFiniteEvent
from course_lib.debugging.environment import differing_keys, environment_report, mismatch_fingerprints
from course_lib.debugging.figures import LiveStepPlot, plot_steps
from course_lib.debugging.monitor import StepMonitor, memory_mb
from course_lib.debugging.traces import allreduce_sizes, is_allreduce, trace_event_names
from course_lib.debugging.train import train_monitored

__all__ = [
    "DistributedDebugger",
    "GradientDesyncError",
    "LiveStepPlot",
    "NonFiniteError",
    "NonFiniteEvent",
    "StepMonitor",
    "allreduce_sizes",
    "check_gradients_in_sync",
    "check_mean_finite_loss",
    "checksum_range",
    "differing_keys",
    "environment_report",
    "gradient_checksums",
    "is_allreduce",
    "memory_mb",
    "mismatch_fingerprints",
    "plot_steps",
    "trace_event_names",
    "train_monitored",
]
