"""Notebook 02: data parallelism from scratch, next to torch's DistributedDataParallel."""

from course_lib.ddp.checkers import check_accumulate_step, check_average_gradient, check_mean_allreduce_hook
from course_lib.ddp.comm_hooks import (
    COMM_HOOKS,
    gradient_error,
    payload_bytes,
    recording_hook,
    timed_allreduce_hook,
    train_with_hook,
)
from course_lib.ddp.compiled import compile_then_ddp, compiled_against_eager, graphs_and_buckets, recording_backend
from course_lib.ddp.lab import (
    ddp_bytes_per_rank,
    draw_buckets,
    draw_graph_cuts,
    draw_hooks,
    draw_join,
    draw_overlap,
    draw_runs,
    draw_shards,
    low_precision_mean,
    overlap_fraction,
    simulate_buckets,
)
from course_lib.ddp.minimal_ddp import MB, MinimalDDP, assign_buckets, on_host_clock, stamp
from course_lib.ddp.train import (
    bytes_written,
    check_gradient_sync,
    load_snapshot,
    rank_loader,
    save_snapshot,
    shuffled_order,
    train,
)
from course_lib.ddp.uneven import (
    MLPWithBranches,
    branch_indices,
    shadow_all_reduce,
    train_with_join,
    uneven_batches,
    uneven_reference,
)
