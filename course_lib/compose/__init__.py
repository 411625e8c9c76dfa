"""Notebook 13: data, tensor and pipeline parallelism composed on one DeviceMesh, one function per mesh dimension."""

from course_lib.compose import runs
from course_lib.compose.checkers import check_accumulate, check_micro_batches, check_my_coordinates
from course_lib.compose.lab import (
    compare_traffic,
    counted_accumulation,
    draw_plan,
    draw_rank_grid,
    format_plan,
    plan_options,
    plot_held,
    predicted_bytes_by_dimension,
    predicted_collectives,
)
from course_lib.compose.parallelize import (
    DIMS,
    Dims,
    apply_fsdp,
    apply_tp,
    loss_fn,
    make_batch,
    make_model,
    new_groups_by_hand,
    quiet_full_tensor,
    rank_grid,
    reference_grads,
    shard_loss,
    stage_blocks,
    unsharded_gradients,
)
from course_lib.compose.planner import (
    H100_NODES,
    LLAMA_70B,
    Cluster,
    ModelShape,
    activation_bytes_per_layer,
    collectives_per_step,
    fsdp_collectives,
    microbatches,
    plan,
    step_time,
)
from course_lib.compose.simulate import Shard, shard_shapes, stage_step, step_collectives
