"""Notebook 13: composing data, tensor and pipeline parallelism on one DeviceMesh.

- :mod:`.mesh`: the rank grid, by hand (:func:`rank_grid`, dist.new_group) and as one DeviceMesh (:class:`Dims`);
- :mod:`.parallelize`: each parallelism as a function over a mesh dimension (:func:`apply_tp`, :func:`apply_fsdp`,
  :func:`stage_blocks`), and the single-process reference the composed model must equal;
- :mod:`.planner`: memory, bytes and time per GPU for a (dp, tp, pp, cp, v) choice on a real cluster, micro-batches and
  FSDP's reshard/defer choices included (kernel-only); :mod:`.shapes` the models and clusters it prices;
- :mod:`.runs`: a step-time model, its predicted MFU beside published runs (Megatron, torchtitan);
- :mod:`.simulate`: layouts of 8 to 64 ranks in one process (torch's fake backend, each rank played in turn):
  every rank's shards and the collectives of a step, against the planner's counts;
- :mod:`.lab`: the planner's prediction of the bytes each rank sends for the notebook's model, against what
  ``comms.Recorder`` counted; what each simulated rank holds, and the planner's explorer (kernel-only);
- :mod:`.checkers`: the exercises' checkers (coordinates, deferred gradient sync, agreed micro-batches).
"""

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
    predicted_collectives,
    predicted_traffic,
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
