"""Notebook 12: remote procedure calls (torch.distributed.rpc).

- :mod:`.agent`: `start`, init_rpc under the course's worker names ("server", "trainer<r>");
- :mod:`.remote_functions`: the small remote functions and the remote model of the first examples;
- :mod:`.train`: the model, data and data-parallel reference the parameter servers are compared with;
- :mod:`.parameter_server`: the batching (sync) and lock-per-update (async) servers and their driver;
- :mod:`.distributed_autograd`: a forward across three workers, backward and step on every owner;
- :mod:`.lab`: round trips timed on a worker, the alpha-beta fit; the servers' loss curves against the reference
  (kernel-only);
- :mod:`.checkers`: the exercises' checkers (a counter behind an RRef; a rendezvous on its owner).
- :mod:`.monarch_actors`: section 9, a single controller with Monarch (imported on its own: it loads monarch).
"""

from course_lib.rpc.agent import start
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
    wait_for_slow_call,
    who_am_i,
)
from course_lib.rpc.train import data_parallel_reference, full_data_loss, make_model, snapshot, trainer_batch
