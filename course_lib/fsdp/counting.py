"""Collective calls per training step: the formula, and torch's counts under the same names.

ZeroModel counts its own calls in :data:`course_lib.fsdp.zero.calls`; torch's fully_shard is counted
by ``CommDebugMode``, whose op names :func:`comm_counts` translates, so both compare with one formula.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a rank that never counts does not import torch's debug tools
    from torch.distributed.tensor.debug import CommDebugMode


def collectives_per_step(stage: int, units: int) -> dict[str, int]:
    """The formula the counts are checked against: collective calls per training step."""
    return {
        0: {"all_reduce": units},
        1: {"all_reduce": units, "all_gather": units},
        2: {"reduce_scatter": units, "all_gather": units},
        3: {"reduce_scatter": units, "all_gather": 2 * units},
    }[stage]


# c10d op name fragments -> the names used in this course
_FRIENDLY = {
    "allgather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "allreduce": "all_reduce",
    "broadcast": "broadcast",
    "all_to_all": "all_to_all",
}


def comm_counts(comm: CommDebugMode) -> dict[str, int]:
    """CommDebugMode's counts under the names used in this course (all_gather, reduce_scatter, ...).

    FSDP2 calls the c10d ops behind all_gather_single / reduce_scatter_single (`_allgather_base_`,
    `_reduce_scatter_base_`): one call per unit per gather or reduction."""
    counts: Counter = Counter()
    for op, k in comm.get_comm_counts().items():
        name = str(op).split(".")[-1]
        friendly = next((v for key, v in _FRIENDLY.items() if key in name), name)
        counts[friendly] += k
    return dict(sorted(counts.items()))
