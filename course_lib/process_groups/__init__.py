"""Notebook 00: process groups and torchrun.

health    health_check: an all-reduce of ones that every rank must see sum to the world size
lab       draw_rank_grid: the global rank of every process of a multi-node job; draw_rendezvous: the store,
          then the backend; draw_mesh: a grid of ranks and its groups along each dimension
checkers  the exercises' checkers (the solutions are in notebooks/solutions/00_torchrun_and_process_groups.py)
"""

from course_lib.process_groups.checkers import check_gather_values, check_mean_loss, check_rank_sum
from course_lib.process_groups.health import health_check
from course_lib.process_groups.lab import draw_mesh, draw_rank_grid, draw_rendezvous
