"""course_lib.tensor_parallel (notebook 08): column- and row-parallel layers from scratch, and torch's DTensor plans.

One linear layer y = x Wᵀ + b is split over the N ranks of a tensor-parallel group. Autograd is told
where the communication goes by conjugate operators (operators.py); the layers and the parallel
TransformerBlock built from them are in layers.py; torch's parallelize_module plan in torch_plan.py;
async TP (the all-gather cut into chunks that overlap the matmul) in async_tp.py; the explorer of
which slice lives where in lab.py;
the exercises' checkers in checkers.py
(solutions: notebooks/solutions/08_tensor_parallel.py). The names below are those the notebook, tests and other
modules use.
"""

from course_lib.tensor_parallel.async_tp import all_gather_matmul, gather_then_matmul, time_overlap
from course_lib.tensor_parallel.checkers import check_row_parallel_forward, check_split_backward
from course_lib.tensor_parallel.lab import LAYERS, draw_async_tp, draw_fg_block, draw_shards
from course_lib.tensor_parallel.layers import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelTransformerBlock,
    RowParallelLinear,
    shard_of,
)
from course_lib.tensor_parallel.operators import CopyToParallel, ReduceFromParallel, shard_size
from course_lib.tensor_parallel.torch_plan import torch_parallel_block, tp_plan
