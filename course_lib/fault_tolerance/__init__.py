"""Notebook 07: fault tolerance: elastic membership, torchft's replica groups, LocalSGD and DiLoCo."""

from course_lib.fault_tolerance.checkers import check_agreed_resume_step, check_diloco_outer_step
from course_lib.fault_tolerance.lab import draw_rendezvous_rounds, draw_replica_groups, plot_elastic
