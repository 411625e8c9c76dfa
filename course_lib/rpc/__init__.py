"""Notebook 12: remote procedure calls (torch.distributed.rpc)."""

from course_lib.rpc.checkers import Counter, Rendezvous, check_counter, check_join_round
from course_lib.rpc.distributed_autograd import distributed_training_step, local_training_step, three_stage_model
from course_lib.rpc.lab import draw_loss_curves, draw_single_controller, fit_latency_model, rpc_latency
from course_lib.rpc.parameter_server import (
    BatchingParameterServer,
    LockingParameterServer,
    run_parameter_server,
    train_on_trainer,
)
from course_lib.rpc.remote_functions import (
    RemoteModel,
    add,
    captured_stderr,
    fail,
    sleep_then_return,
    start,
    wait_for_slow_call,
    who_am_i,
)
from course_lib.rpc.train import data_parallel_reference, full_data_loss, make_model, snapshot, trainer_batch
