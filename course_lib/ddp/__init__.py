"""Notebook 02: data parallelism from scratch, next to torch's DistributedDataParallel.

- minimal_ddp: MinimalDDP, the algorithm (broadcast, buckets, asynchronous all-reduce, no_sync); stamps on the
  GPU's clock (CUDA events) or the host's
- replicas: the gradient-sync check and the rank-0 snapshot
- train: the training harness, single-process or data-parallel over the same batches
- compiled: torch.compile under DDP: the graphs Dynamo captures against DDP's buckets, compiled against eager
- comm_hooks: torch DDP's compression hooks (fp16, bf16, PowerSGD), a timing hook and a bucket-recording hook
- unused: a model with branches a step may not take; collectives counted per step; step times measured in turns
- uneven: ranks with uneven numbers of batches: Join from scratch for MinimalDDP, and the reference run
- figures: ring bytes, the bucket/overlap simulator, memory per rank
- checkers: the exercises' checkers (the solutions are in notebooks/solutions/02_ddp.py)
"""

from course_lib.ddp.checkers import check_accumulate_step, check_average_gradient, check_mean_allreduce_hook
from course_lib.ddp.comm_hooks import (
    COMM_HOOKS,
    attach_comm_hook,
    bf16_compress_hook_any_backend,
    gradient_error,
    payload_bytes,
    recording_hook,
    timed_allreduce_hook,
    train_with_hook,
)
from course_lib.ddp.compiled import compile_then_ddp, compiled_against_eager, graphs_and_buckets, recording_backend
from course_lib.ddp.figures import (
    ddp_bytes_per_rank,
    low_precision_mean,
    overlap_fraction,
    simulate_buckets,
)
from course_lib.ddp.minimal_ddp import MB, Bucket, MinimalDDP, assign_buckets, on_host_clock, stamp, unwrap
from course_lib.ddp.replicas import check_gradient_sync, load_snapshot, save_snapshot
from course_lib.ddp.train import TrainLog, bytes_written, global_loader, rank_loader, shuffled_order, train
from course_lib.ddp.uneven import shadow_all_reduce, train_with_join, uneven_batches, uneven_reference
from course_lib.ddp.unused import MLPWithBranches, branch_indices

__all__ = [
    "COMM_HOOKS",
    "MB",
    "Bucket",
    "MLPWithBranches",
    "MinimalDDP",
    "TrainLog",
    "assign_buckets",
    "attach_comm_hook",
    "bf16_compress_hook_any_backend",
    "branch_indices",
    "bytes_written",
    "check_accumulate_step",
    "check_average_gradient",
    "check_gradient_sync",
    "check_mean_allreduce_hook",
    "compile_then_ddp",
    "compiled_against_eager",
    "ddp_bytes_per_rank",
    "global_loader",
    "gradient_error",
    "graphs_and_buckets",
    "load_snapshot",
    "low_precision_mean",
    "on_host_clock",
    "overlap_fraction",
    "payload_bytes",
    "rank_loader",
    "recording_backend",
    "recording_hook",
    "save_snapshot",
    "shadow_all_reduce",
    "shuffled_order",
    "simulate_buckets",
    "stamp",
    "timed_allreduce_hook",
    "train",
    "train_with_hook",
    "train_with_join",
    "uneven_batches",
    "uneven_reference",
    "unwrap",
]
