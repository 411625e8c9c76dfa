"""Notebook 00: process groups and torchrun."""

from course_lib.process_groups.checkers import check_gather_values, check_mean_loss, check_rank_sum
from course_lib.process_groups.health import health_check
from course_lib.process_groups.lab import draw_mesh, draw_ranks_on_nodes, draw_rendezvous
