"""Notebook 00: process groups and torchrun.

health    health_check: an all-reduce of ones that every rank must see sum to the world size
checkers  the exercises' checkers and reference solutions
"""

from course_lib.process_groups.checkers import (
    check_gather_ranks,
    check_rank_sum,
    solution_gather_ranks,
    solution_rank_sum,
)
from course_lib.process_groups.health import health_check

__all__ = ["check_gather_ranks", "check_rank_sum", "health_check", "solution_gather_ranks", "solution_rank_sum"]
