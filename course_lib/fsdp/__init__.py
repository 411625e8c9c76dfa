"""Notebook 03: ZeRO stages 0-3 from scratch, compared with torch's FSDP2 `fully_shard`.

    zero       ZeroModel: every unit's parameters flattened and sharded, stages 0-3 (what the notebook shows)
    counting   collective calls per step: the formula, and torch's counts (CommDebugMode) by the same names
    train      the notebook's model, data and training loop, for one process and for every rank
    wire       bytes on the wire per step: the collectives FSDP2 calls, per group, under a ring or gloo cost
    checkers   the exercises' checkers (solutions: notebooks/solutions/03_fsdp2.py)

Memory per rank (counted and predicted) is in :mod:`course_lib.memory`, comparisons in :mod:`course_lib.compare`.
"""

from course_lib.fsdp.checkers import check_reduce_gradient, check_shard_with_adam_state
from course_lib.fsdp.counting import collectives_per_step, comm_counts
from course_lib.fsdp.train import global_batches, make_model, train
from course_lib.fsdp.wire import GLOO, RING, per_group, recorded_collectives, sent_bytes
from course_lib.fsdp.zero import ShardedUnit, ZeroModel, calls, reset_calls

__all__ = [
    "GLOO",
    "RING",
    "ShardedUnit",
    "ZeroModel",
    "calls",
    "check_reduce_gradient",
    "check_shard_with_adam_state",
    "collectives_per_step",
    "comm_counts",
    "global_batches",
    "make_model",
    "per_group",
    "recorded_collectives",
    "reset_calls",
    "sent_bytes",
    "train",
]
