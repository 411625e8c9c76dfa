"""Notebook 03: ZeRO stages 0-3 from scratch, compared with torch's FSDP2 `fully_shard`."""

from course_lib.fsdp.checkers import check_reduce_gradient, check_shard_with_adam_state
from course_lib.fsdp.lab import (
    dataset,
    draw_hsdp_mesh,
    draw_prefetch_timeline,
    draw_zero_stages,
    issue_order,
    make_model,
    train,
)
from course_lib.fsdp.zero import (
    COMPILE_ORDERS,
    ShardedUnit,
    ZeroModel,
    compile_blocks_then_shard,
    fsdp_collectives,
    shard_then_compile,
    zero_collectives,
)
