"""course_lib.pipeline (notebook 09): pipeline parallelism from scratch.

A model is cut into *stages* (stages.py), one per rank, or several per rank ("virtual stages", for the
interleaved schedule). A batch is cut into *micro-batches*. A *schedule* is, for every rank, an
explicit list of actions ``Action("F" or "B", microbatch, stage)`` (schedules.py; zero-bubble schedules add "W",
the weight gradient of a backward split in two: stages.py); :func:`simulate`
computes its ideal timeline or finds its deadlock without running anything (timeline.py), and
:func:`execute` runs it with point-to-point send/recv (execution.py). lab.py holds one training
step, ours and torch.distributed.pipelining's, against single-process training; torch's two-stages-per-rank
schedules (zero bubble, DualPipeV, looped BFS) and their action lists as ours; the Gantt chart and the schedule
explorer; checkers.py the exercises' checkers
(solutions: notebooks/solutions/09_pipeline_parallel.py). The names below are those the notebook, tests and
benchmark use.
"""

from course_lib.pipeline.checkers import check_one_f_one_b, check_pipeline_step
from course_lib.pipeline.execution import execute, naive_model_parallel, run_action
from course_lib.pipeline.lab import (
    TORCH_SCHEDULES,
    draw_schedule,
    draw_v_placement,
    gradients_by_stage,
    loss_fn,
    max_gradient_error,
    pipeline_step,
    plot_timeline,
    reference_stage_gradients,
    stages_of_rank,
    torch_schedule_order,
    torch_schedule_step,
)
from course_lib.pipeline.schedules import (
    SCHEDULES,
    ZERO_BUBBLE,
    Action,
    Overlapped,
    Unit,
    actions_of,
    dualpipev_bubble,
    gpipe_actions,
    ideal_bubble,
    interleaved_actions,
    peak_in_flight,
    published_bubble,
    schedule_actions,
    simultaneous_peak,
    stages_per_rank,
    validate,
    zero_bubble_actions,
    zero_bubble_ideal,
)
from course_lib.pipeline.stages import (
    backward_input,
    backward_weight,
    course_model,
    local_stages,
    recording_layer_outputs,
    split_into_stages,
    stage_boundaries,
)
from course_lib.pipeline.timeline import Deadlock, bubble_fraction, simulate
