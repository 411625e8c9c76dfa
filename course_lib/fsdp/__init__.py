"""Notebook 03: ZeRO stages 0-3 from scratch, compared with torch's FSDP2 `fully_shard`.

    zero       ZeroModel: every unit's parameters flattened and sharded, stages 0-3 (what the notebook shows);
               collectives_per_step, the formula its calls (counted by course_lib.comms.Recorder) follow
    lab        the notebook's model, data and training loop, for one process and for every rank; what an FSDP2 step
               issues, in order (issue_order); the figures (ZeRO stages, prefetch timeline, HSDP mesh)
    compiled   torch.compile with FSDP2: each block compiled then sharded (torchtitan's order), or the whole model
               sharded then compiled; compared with eager by course_lib.ddp.compiled_against_eager
    checkers   the exercises' checkers (solutions: notebooks/solutions/03_fsdp2.py)

Memory per rank (counted and predicted) is in :mod:`course_lib.memory`, comparisons in :mod:`course_lib.compare`.
"""

from course_lib.fsdp.checkers import check_reduce_gradient, check_shard_with_adam_state
from course_lib.fsdp.compiled import COMPILE_ORDERS, compile_blocks_then_shard, shard_then_compile
from course_lib.fsdp.lab import (
    dataset,
    draw_hsdp_mesh,
    draw_prefetch_timeline,
    draw_zero_stages,
    issue_order,
    make_model,
    train,
)
from course_lib.fsdp.zero import ShardedUnit, ZeroModel, collectives_per_step
