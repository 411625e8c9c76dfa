"""course_lib.tensor_parallel (notebook 08): column- and row-parallel layers from scratch, and torch's DTensor plans."""

from course_lib.tensor_parallel.checkers import check_row_parallel_forward, check_split_backward
from course_lib.tensor_parallel.lab import LAYERS, draw_async_tp, draw_fg_block, draw_weight_shards
from course_lib.tensor_parallel.layers import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelTransformerBlock,
    RowParallelLinear,
    shard_of,
    torch_parallel_block,
    tp_plan,
)
from course_lib.tensor_parallel.operators import (
    CopyToParallel,
    ReduceFromParallel,
    all_gather_matmul,
    gather_then_matmul,
    shard_size,
    time_overlap,
)
