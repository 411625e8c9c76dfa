"""course_lib.rpc: the parameter server against data-parallel training, error cases, distributed autograd,
the exercise checker. Real gloo/TensorPipe runs on 2-4 processes."""

import runpy
import warnings
from pathlib import Path

import pytest
import torch

from course_lib import rpc as rpc_lib
from course_lib.compare import max_difference
from course_lib.exercises import check, check_prediction
from course_lib.launch import launch
from course_lib.rpc.remote_functions import _is_torch_internal_backend_notice
from tests.rank_programs import rpc as programs
from tests.rank_programs import world_sizes

SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions" / "12_rpc.py"
QUIET = dict(write=lambda text, stream: None)
STEPS = 20


def run_rpc(program, nproc, **kwargs):
    """Launch a program of tests/rank_programs/rpc.py without a process group (RPC makes its own).

    The launch result (for stderr) and each rank's dict, by rank.
    """
    body = (
        f"from tests.rank_programs.rpc import {program.__name__}\n"
        f"result = {program.__name__}(rank, world_size, **program_kwargs)\n"
    )
    done = launch(body, nproc, backend="gloo", init=False, out=["result"], push={"program_kwargs": kwargs}, **QUIET)
    return done, done.values["result"]


# ---- no processes ------------------------------------------------------------------------


def test_trainer_batches_are_disjoint_slices_of_one_global_batch():
    for n_trainers in (1, 2, 3, 4):
        for step in (0, 7):
            xs = [rpc_lib.trainer_batch(step, t, n_trainers)[0] for t in range(n_trainers)]
            rows = torch.cat(xs)
            assert rows.shape == (16 * n_trainers, 32)
            assert torch.unique(rows, dim=0).shape[0] == rows.shape[0]  # no row twice
    # the same trainer gets different data at different steps
    assert not torch.equal(rpc_lib.trainer_batch(0, 0, 2)[0], rpc_lib.trainer_batch(1, 0, 2)[0])


def test_latency_fit_recovers_alpha_and_beta():
    alpha, beta = 2e-4, 1 / 3e9  # beta in seconds per byte, as notebook 01 defines it
    latency = {n: alpha + 2 * n * beta for n in (8, 512, 32768, 4194304)}
    fit_alpha, fit_beta = rpc_lib.fit_latency_model(latency)
    assert fit_alpha == pytest.approx(alpha + 16 * beta)
    assert fit_beta == pytest.approx(beta, rel=1e-4)


def test_only_torchs_backend_notice_is_recognised():
    def record(message, category=UserWarning, filename="/x/torch/distributed/distributed_c10d.py"):
        return warnings.WarningMessage(message, category, filename, 1)

    notice = (
        "You are using a Backend <class 'torch.distributed.distributed_c10d.ProcessGroupGloo'> as a "
        "ProcessGroup. This usage is deprecated since PyTorch 2.0."
    )
    assert _is_torch_internal_backend_notice(record(notice))
    assert not _is_torch_internal_backend_notice(record(notice, category=FutureWarning))
    assert not _is_torch_internal_backend_notice(record(notice, filename="/x/my_code.py"))
    assert not _is_torch_internal_backend_notice(record("something else is deprecated"))


# ---- parameter server on 2, 3 and 4 processes ---------------------------------------------


@pytest.mark.parametrize("nproc", world_sizes(2, 3, 4))
def test_parameter_server_sync_equals_data_parallel_async_converges(nproc):
    result, ranks = run_rpc(programs.parameter_server, nproc, steps=STEPS)
    runs = ranks[0]["runs"]
    for n_trainers in sorted({nproc - 1, 4}):
        reference, reference_losses = rpc_lib.data_parallel_reference(n_trainers, steps=STEPS)
        sync = runs["sync", n_trainers]
        assert max_difference(sync["parameters"], reference) < 1e-5, (nproc, n_trainers)
        assert sync["losses"] == pytest.approx(reference_losses, abs=1e-5)
        assert sync["losses"][-1] < sync["losses"][0]
        theta = sum(p.numel() for p in rpc_lib.make_model().parameters())
        # counted by the trainers on the tensors they sent and received: a gradient and the parameters per step
        assert sync["values_moved"] == runs["async", n_trainers]["values_moved"] == 2 * n_trainers * theta * STEPS
        initial = max_difference(reference, rpc_lib.snapshot(rpc_lib.make_model()))
        assert initial > 1e-2  # the comparison is not trivially true: training moved the parameters

        asynchronous = runs["async", n_trainers]
        assert len(asynchronous["staleness"]) == n_trainers * STEPS
        assert all(0 <= s < n_trainers * STEPS for s in asynchronous["staleness"])  # steps taken in between
        # converges: measured on the whole data set, free of mini-batch noise (staleness varies run to run)
        start = rpc_lib.full_data_loss(rpc_lib.snapshot(rpc_lib.make_model()))
        assert rpc_lib.full_data_loss(asynchronous["parameters"]) < 0.75 * start
        if n_trainers == 1:  # alone, a trainer is never stale and both servers take the same steps
            assert set(asynchronous["staleness"]) == {0}
            assert max_difference(asynchronous["parameters"], sync["parameters"]) < 1e-6
        else:  # one step per gradient instead of one per round: a different trajectory
            assert max_difference(asynchronous["parameters"], sync["parameters"]) > 1e-4
    # every rank hid exactly torch's one notice, nothing else
    assert all(len(r["hidden"]) <= 1 for r in ranks)
    assert not any("Warning" in text for text in result.attempts[-1].stderr.values())


# ---- error cases ---------------------------------------------------------------------------


def test_error_cases_raise_what_the_notebook_says():
    assert not hasattr(torch.distributed.rpc, "RPCError") and not hasattr(torch.distributed.rpc, "TimeoutError")
    result, ranks = run_rpc(programs.errors, 2)
    remote, in_future, timeout, unknown, after = ranks[1]["caught"]
    assert remote[0] == "ValueError" and "On WorkerInfo(id=0, name=server)" in remote[1] and "bad value" in remote[1]
    assert in_future[0] == "ValueError" and "in a future" in in_future[1]
    assert timeout[0] == "RuntimeError" and "RPC ran for more than set timeout (200 ms)" in timeout[1]
    assert unknown[0] == "RuntimeError" and "could not find destination name nobody" in unknown[1]
    assert after[0] == "RuntimeError" and "RPC has not been initialized" in after[1]
    assert ranks[0]["caught"] == [after]  # the server only hit the after-shutdown case
    assert ranks[0]["server_log"].count("On WorkerInfo(id=0, name=server)") == 2
    assert "On WorkerInfo" not in ranks[1]["server_log"]  # the trainer served no failing call
    # nothing leaked: no warnings, no dropped-reply complaint from the slow call
    stderr = "\n".join(result.attempts[-1].stderr.values())
    assert "Warning" not in stderr and "won't send response" not in stderr, stderr


# ---- distributed autograd ------------------------------------------------------------------


@pytest.mark.parametrize("nproc", world_sizes(2, 3))
def test_distributed_autograd_and_optimizer_match_local_training(nproc):
    # with 2 workers, stages 0 and 2 are both built on worker0 by concurrent RPC threads
    result, ranks = run_rpc(programs.autograd, nproc)
    distributed = ranks[0]["distributed"]
    torch.manual_seed(3)
    x, y = torch.randn(8, 32), torch.randn(8, 8)
    local = rpc_lib.local_training_step(x, y, lr=0.5)
    assert distributed["owners"] == ["worker0", "worker1", f"worker{2 % nproc}"]
    assert distributed["loss"] == pytest.approx(local["loss"], abs=1e-6)
    assert max_difference(distributed["gradients"], local["gradients"]) < 1e-6
    assert max_difference(distributed["parameters"], local["parameters"]) < 1e-6
    before = [p.detach() for p in torch.nn.Sequential(*rpc_lib.three_stage_model()).parameters()]
    assert max_difference(distributed["parameters"], before) > 1e-3  # the optimizer did step
    assert distributed["local_grads_here"] == 2 * distributed["owners"].count("worker0")  # weight and bias
    stderr = "\n".join(result.attempts[-1].stderr.values())
    assert "Warning" not in stderr and "TorchScript" not in stderr, stderr


# ---- exercises: the solutions of notebooks/solutions/12_rpc.py pass, wrong answers fail -------------------


def solutions(nproc=2):
    return runpy.run_path(str(SOLUTIONS), init_globals={"NPROC": nproc})


def add_without_lock(counter_rref, amount):
    counter = counter_rref.local_value()
    total = counter.read() + amount
    counter.write(total)
    return total


def add_in_place(counter_rref, amount):  # the lock-free shortcut: += on the value, no read/write, no lock
    counter = counter_rref.local_value()
    counter.value += amount
    return counter.value


def add_to_the_private_value(counter_rref, amount):  # the shortcut: += on the stored attribute, no lock
    counter = counter_rref.local_value()
    counter._value += amount
    return counter._value


def add_returning_amount(counter_rref, amount):
    counter = counter_rref.local_value()
    with counter.lock:
        counter.write(counter.read() + amount)
    return amount


def join_round_replacing_the_future(rendezvous, value):  # the broken function the notebook shows
    import torch

    with rendezvous.lock:
        rendezvous.values.append(value)
        if len(rendezvous.values) == rendezvous.expected:
            rendezvous.round_done = torch.futures.Future()
            rendezvous.round_done.set_result(sorted(rendezvous.values))
            rendezvous.values = []
    return rendezvous.round_done


def join_round_never_reset(rendezvous, value):
    with rendezvous.lock:
        rendezvous.values.append(value)
        this_round = rendezvous.round_done
        if len(rendezvous.values) == rendezvous.expected:
            this_round.set_result(sorted(rendezvous.values))  # the next round gets this finished future
    return this_round


def join_round_alone(rendezvous, value):
    import torch

    future = torch.futures.Future()
    future.set_result([value])  # no waiting for the others
    return future


def join_round_waiting_in_the_thread(rendezvous, value):
    import torch

    with rendezvous.lock:
        rendezvous.values.append(value)
        this_round = rendezvous.round_done
        if len(rendezvous.values) == rendezvous.expected:
            values, rendezvous.values = sorted(rendezvous.values), []
            rendezvous.round_done = torch.futures.Future()
            this_round.set_result(values)
    return this_round.wait()  # holds an RPC thread per waiting caller, and returns a list, not the future


@pytest.mark.parametrize("nproc", world_sizes(2, 3))
def test_reference_solutions_pass(nproc, capsys):
    solved = solutions()
    assert check(solved["add_on_owner"], rpc_lib.check_counter, nproc=nproc, backend="gloo") is True
    assert check(solved["join_round"], rpc_lib.check_join_round, nproc=nproc, backend="gloo") is True
    assert capsys.readouterr().out.count(f"correct on {nproc} ranks") == 2


@pytest.mark.parametrize(
    "wrong, checker, says",
    [
        (add_without_lock, rpc_lib.check_counter, "without holding counter.lock"),
        (add_in_place, rpc_lib.check_counter, "without holding counter.lock"),
        (add_to_the_private_value, rpc_lib.check_counter, "the exercise is to hold the lock across the read"),
        (add_returning_amount, rpc_lib.check_counter, "each call must return the total"),
        (join_round_replacing_the_future, rpc_lib.check_join_round, "was never completed"),
        (join_round_never_reset, rpc_lib.check_join_round, "round 1: expected the 2 values of the round, sorted"),
        (join_round_alone, rpc_lib.check_join_round, "round 0: expected the 2 values of the round, sorted"),
        (join_round_waiting_in_the_thread, rpc_lib.check_join_round, "must return a torch.futures.Future, got list"),
    ],
)
def test_checkers_reject_wrong_answers(wrong, checker, says, capsys):
    assert check(wrong, checker, nproc=2, backend="gloo", timeout=90) is False
    out = capsys.readouterr().out
    assert "rank 0" in out and says in out, out


def test_stubs_report_not_attempted(capsys):
    def add_on_owner(counter_rref, amount):
        raise NotImplementedError

    def join_round(rendezvous, value):
        raise NotImplementedError  # your code here

    assert check(add_on_owner, rpc_lib.check_counter, nproc=2) is None
    assert check(join_round, rpc_lib.check_join_round, nproc=2) is None
    assert capsys.readouterr().out.count("not attempted yet") == 2


def test_server_values_prediction(capsys):
    theta = sum(p.numel() for p in rpc_lib.make_model().parameters())
    measured = 2 * 3 * theta  # what run_parameter_server counts per sync step with 3 trainers (test above)
    assert check_prediction("values", solutions()["predicted_server_values"], measured, rtol=0.01)
    wrong = {
        "a ring all-reduce's 2 (N-1)/N, N = 4 processes": 2 * 3 / 4 * theta,
        "one way only": 3 * theta,
        "N = 4 processes instead of N - 1 = 3 trainers": 2 * 4 * theta,
        "bytes instead of values": 4 * 2 * 3 * theta,
    }
    for why, value in wrong.items():
        assert check_prediction("values", value, measured, rtol=0.01) is False, why
    assert capsys.readouterr().out.count("✗") == len(wrong)


def test_single_controller_figure_has_a_controller_a_mesh_and_one_actor_per_process():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rpc_lib.draw_single_controller(3)
    texts = [t.get_text() for t in plt.gcf().axes[0].texts]
    plt.close("all")
    assert "controller (this notebook)" in texts
    assert [t for t in texts if t.startswith("process procs=")] == [f"process procs={p}" for p in range(3)]
    assert sum(t.startswith("Worker actor") for t in texts) == 3
