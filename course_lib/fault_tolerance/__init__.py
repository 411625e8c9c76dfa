"""Notebook 07: fault tolerance: elastic membership, torchft's replica groups, LocalSGD and DiLoCo."""

from course_lib.fault_tolerance.checkers import check_agreed_resume_step, check_diloco_outer_step
from course_lib.fault_tolerance.elastic import train_elastic
from course_lib.fault_tolerance.lab import (
    Segment,
    agent_messages,
    compare_sync,
    draw_rendezvous_rounds,
    draw_replica_groups,
    plot_elastic,
    run_elastic,
    run_torchft,
    segments,
)
from course_lib.fault_tolerance.replicas import (
    LIGHTHOUSE,
    SYNC_RUNS,
    reference_losses,
    step_losses,
    synchronised,
    torchft_step,
)
