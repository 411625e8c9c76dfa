"""Notebook 09: composing data, tensor and pipeline parallelism on one DeviceMesh.

- :mod:`.mesh`: the rank grid, by hand (:func:`rank_grid`, dist.new_group) and as a DeviceMesh (:func:`build_mesh`);
- :mod:`.parallelize`: each parallelism as a function over a mesh dimension (:func:`apply_tp`, :func:`apply_fsdp`,
  :func:`stage_blocks`), and the single-process reference the composed model must equal;
- :mod:`.planner`: memory and communication per GPU for a (dp, tp, pp) choice on a real cluster (kernel-only);
- :mod:`.checkers`: the exercise (a rank's coordinates) and its checker.
"""

from course_lib.compose.checkers import check_my_coordinates, solution_my_coordinates
from course_lib.compose.mesh import DIMS, build_mesh, coordinates, new_groups_by_hand, rank_grid
from course_lib.compose.parallelize import (
    apply_fsdp,
    apply_tp,
    loss_fn,
    make_batch,
    make_model,
    quiet_full_tensor,
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
    format_plan,
    plan,
    plan_options,
)

__all__ = [
    "DIMS",
    "H100_NODES",
    "LLAMA_70B",
    "Cluster",
    "ModelShape",
    "activation_bytes_per_layer",
    "apply_fsdp",
    "apply_tp",
    "build_mesh",
    "check_my_coordinates",
    "coordinates",
    "format_plan",
    "loss_fn",
    "make_batch",
    "make_model",
    "new_groups_by_hand",
    "plan",
    "plan_options",
    "quiet_full_tensor",
    "rank_grid",
    "reference_grads",
    "shard_loss",
    "solution_my_coordinates",
    "stage_blocks",
    "unsharded_gradients",
]
