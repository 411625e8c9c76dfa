"""Notebook 07: fault tolerance: elastic membership, torchft's replica groups, LocalSGD and DiLoCo.

The runs themselves (run_elastic, run_torchft, compare_sync and their rank side) live in course_lib.checkpoint,
whose DCP checkpoints and training steps they resume from. This package holds what notebook 07 adds:

    lab         the pictures: the rendezvous rounds of an elastic run, the lighthouse and its replica groups
    checkers    the exercises: DiLoCo's outer step (one all-reduce); every rank resumes from rank 0's choice
"""

from course_lib.fault_tolerance.checkers import check_agreed_resume_step, check_diloco_outer_step
from course_lib.fault_tolerance.lab import draw_rendezvous, draw_replica_groups
