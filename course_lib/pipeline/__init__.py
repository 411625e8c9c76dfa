"""Pipeline parallelism from scratch (notebook 09): a schedule is an action list per rank, simulated before it runs."""

from course_lib.pipeline.checkers import check_one_f_one_b, check_pipeline_step
from course_lib.pipeline.execution import execute, naive_model_parallel, run_action
from course_lib.pipeline.lab import (
    TORCH_SCHEDULES,
    draw_schedule,
    draw_v_placement,
    gradients_by_stage,
    max_gradient_error,
    mse_loss,
    plot_timeline,
    reference_stage_gradients,
    schedule_step,
    stages_of_rank,
    torch_schedule_order,
    torch_schedule_step,
)
from course_lib.pipeline.schedules import (
    SCHEDULES,
    ZERO_BUBBLE,
    Action,
    Overlapped,
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
