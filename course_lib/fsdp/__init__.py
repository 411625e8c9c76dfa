"""Notebook 03: ZeRO stages 0-3 from scratch, compared with torch's FSDP2 `fully_shard`.

    zero       ZeroModel: every unit's parameters flattened and sharded, stages 0-3 (what the notebook shows)
    counting   collective calls per step: the formula, and torch's counts (CommDebugMode) by the same names
    train      the notebook's model, data and training loop, for one process and for every rank
    checkers   the exercise (shard a parameter and its Adam state) and its reference answer

Memory per rank (counted and predicted) is in :mod:`course_lib.memory`, comparisons in :mod:`course_lib.compare`.
"""

from course_lib.fsdp.checkers import check_shard_with_adam_state, solution_shard_with_adam_state
from course_lib.fsdp.counting import collectives_per_step, comm_counts
from course_lib.fsdp.train import global_batches, make_model, train
from course_lib.fsdp.zero import ShardedUnit, ZeroModel, calls, reset_calls

__all__ = [
    "ShardedUnit",
    "ZeroModel",
    "calls",
    "check_shard_with_adam_state",
    "collectives_per_step",
    "comm_counts",
    "global_batches",
    "make_model",
    "reset_calls",
    "solution_shard_with_adam_state",
    "train",
]
