"""course_lib.collectives: the from-scratch ring against torch's collectives on real gloo ranks,
the cost model, the ring schedule the explorer draws, and the exercise checkers."""

import runpy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from course_lib import collectives
from course_lib.exercises import check, check_prediction
from tests.rank_programs import collectives as rank_programs
from tests.rank_programs import run
from tests.rank_programs.process_groups import judge


# One launch per world size: every size and operation is checked inside it (a launch costs seconds).
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_matches_torch(world_size):
    results = run(rank_programs.against_torch, world_size, timeout=120)
    problems = [p for per_rank in results for p in per_rank["problems"]]
    assert problems == []


def test_chunk_sizes_match_tensor_split():
    for numel in range(0, 30):
        for n in range(1, 9):
            expected = [len(c) for c in torch.tensor_split(torch.arange(numel), n)]
            assert collectives.chunk_sizes(numel, n) == expected, (numel, n)
    assert collectives.chunk_offsets([3, 3, 2]) == [0, 3, 6, 8]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_ring_schedule_states(n):
    states = collectives.ring_all_reduce_states(n)
    assert len(states) == 1 + 2 * (n - 1)
    everyone = frozenset(range(n))
    after_rs = states[n - 1]["holds"]
    for r in range(n):
        assert after_rs[r][r] == everyone, f"after reduce-scatter rank {r} must hold the full chunk {r}"
    assert all(cell == everyone for row in states[-1]["holds"] for cell in row)
    if n > 2:
        # first step of reduce-scatter: rank r sends chunk r-1, so rank 1 adds rank 0's chunk N-1 to its own
        assert states[1]["holds"][1][n - 1] == frozenset({0, 1})
        assert states[1]["holds"][1][0] == frozenset({1})


def test_ring_step_pairs_sends_with_receives():
    for n in range(2, 9):
        for phase in ("reduce_scatter", "all_gather"):
            for step in range(n - 1):
                for r in range(n):
                    sent, _ = collectives.ring_step(r, n, step, phase)
                    _, received = collectives.ring_step((r + 1) % n, n, step, phase)
                    assert sent == received
    with pytest.raises(ValueError):
        collectives.ring_step(0, 2, 0, "broadcast")


def test_cost_model():
    assert collectives.bytes_sent_per_rank("all_reduce", 1000, 4) == 1500
    assert collectives.bytes_sent_per_rank("all_gather", 1000, 4) == 750
    assert collectives.bytes_sent_per_rank("reduce_scatter", 1000, 4) == 750
    assert collectives.bytes_sent_per_rank("broadcast", 1000, 4) == 1000
    assert collectives.bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert collectives.bus_factor("broadcast", 8) == 1.0
    sizes = [4e3, 6.4e4, 1e6, 1.6e7]
    times = [collectives.alpha_beta_time("all_reduce", s, 4, 50e-6, 1 / 2e9) for s in sizes]
    alpha, beta = collectives.fit_alpha_beta("all_reduce", sizes, times, 4)
    assert alpha == pytest.approx(50e-6, rel=1e-6) and beta == pytest.approx(1 / 2e9, rel=1e-6)


def test_draw_ring_step_runs():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = collectives.draw_ring_step(4, 3)
    assert "reduce-scatter step 3 of 3" in ax.get_title()
    plt.close("all")


# ---- exercises: the solutions pass, wrong answers fail with the expected message -------------------

SOLUTIONS = str(Path(__file__).parents[1] / "notebooks" / "solutions" / "01_collectives.py")
SOLVED = [
    ("my_reduce_scatter", "check_reduce_scatter"),
    ("my_all_gather", "check_all_gather"),
    ("pass_right", "check_pass_right"),
]


def solutions(nproc):
    return runpy.run_path(SOLUTIONS, init_globals={"NPROC": nproc})


def reduce_scatter_without_reducing(tensor):
    return torch.tensor_split(tensor, dist.get_world_size())[dist.get_rank()]


def reduce_scatter_with_torch(tensor):
    out = torch.empty(tensor.numel() // dist.get_world_size())
    dist.reduce_scatter_single(out, tensor)
    return out


def reduce_scatter_even_split_only(tensor):
    from course_lib.collectives import ring_reduce_scatter

    n = dist.get_world_size()
    size = tensor.numel() // n  # drops the remainder: wrong when N does not divide numel
    return ring_reduce_scatter(tensor.clone())[:size]


def all_gather_own_chunk_only(chunk, sizes):
    return chunk


def all_gather_reversed(chunk, sizes):
    from course_lib.collectives import ring_all_gather

    parts = torch.split(ring_all_gather(chunk, sizes), sizes)
    return torch.cat(parts[::-1])


def all_gather_with_torch(chunk, sizes):
    out = [torch.empty(size) for size in sizes]
    dist.all_gather(out, chunk)
    return torch.cat(out)


def pass_right_receive_first(token):
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    incoming = torch.empty_like(token)
    dist.recv(incoming, src=(rank - 1) % n)  # the notebook's broken version: every rank waits here
    dist.send(token, dst=(rank + 1) % n)
    return incoming


def pass_right_send_first(token):
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    incoming = torch.empty_like(token)
    dist.send(token, dst=(rank + 1) % n)  # every rank sends first: fine only where sends are buffered
    dist.recv(incoming, src=(rank - 1) % n)
    return incoming


def pass_right_nonblocking(token):
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    incoming = torch.empty_like(token)
    requests = [dist.isend(token, (rank + 1) % n), dist.irecv(incoming, (rank - 1) % n)]
    for request in requests:
        request.wait()
    return incoming


def pass_right_wrong_direction(token):
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    incoming = torch.empty_like(token)
    if rank % 2 == 0:  # right at N = 2 only, where left and right are the same rank
        dist.send(token, dst=(rank - 1) % n)
        dist.recv(incoming, src=(rank + 1) % n)
    else:
        dist.recv(incoming, src=(rank + 1) % n)
        dist.send(token, dst=(rank - 1) % n)
    return incoming


def pass_right_local(token):
    return token - 100  # as if the neighbours' tokens followed a pattern


# Each fails on every rank at the same call, so one launch can judge them all in turn.
WRONG = [
    ("reduce_scatter_without_reducing", "check_reduce_scatter", "reduce_scatter of 12 elements on 3 ranks"),
    ("reduce_scatter_with_torch", "check_reduce_scatter", "dist.reduce_scatter_single is not allowed"),
    ("all_gather_own_chunk_only", "check_all_gather", "expected shape (12,)"),
    ("all_gather_reversed", "check_all_gather", "all_gather of 12 elements on 3 ranks"),
    ("all_gather_with_torch", "check_all_gather", "dist.all_gather is not allowed"),
    ("pass_right_nonblocking", "check_pass_right", "dist.isend is not allowed here: the exercise is to fix the order"),
    ("pass_right_wrong_direction", "check_pass_right", "(the token of rank"),
    ("pass_right_local", "check_pass_right", "(the token of rank"),
]


def test_solutions_pass_and_wrong_answers_fail_on_3_ranks():
    cases = [(f"solution:{name}", f"course_lib.collectives:{checker}") for name, checker in SOLVED]
    cases += [(f"tests.test_collectives:{wrong}", f"course_lib.collectives:{checker}") for wrong, checker, _ in WRONG]
    results = run(judge, 3, kwargs={"cases": cases, "solutions": SOLUTIONS}, timeout=300)
    for per_rank in results:
        messages = per_rank["messages"]
        assert messages[: len(SOLVED)] == ["ok"] * len(SOLVED), messages
        for (wrong, _, fragment), message in zip(WRONG, messages[len(SOLVED) :]):
            assert message != "ok" and fragment in message, (wrong, message)


@pytest.mark.parametrize("nproc", [2, 4])
def test_solutions_pass_through_check(nproc, capsys):
    answers = solutions(nproc)
    for name, checker in SOLVED:
        assert check(answers[name], getattr(collectives, checker), nproc=nproc, backend="gloo", timeout=120)
    assert capsys.readouterr().out.count(f"correct on {nproc} ranks") == len(SOLVED)


@pytest.mark.parametrize(
    "wrong, checker, message",
    [
        # rank 0 fails at the second size while the others pass it: not for a shared launch
        (reduce_scatter_even_split_only, collectives.check_reduce_scatter, "expected shape"),
        # a real deadlock: the checker's timeout ends it and names the ranks left waiting
        (pass_right_receive_first, collectives.check_pass_right, "deadlock: ranks [0, 1, 2] still waited after 8 s"),
        # gloo makes a send wait for its receiver too, so this one deadlocks here; where small sends are buffered
        # it finishes, and the replay with waiting sends rejects it ("... ranks [0, 1, 2] wait forever")
        (pass_right_send_first, collectives.check_pass_right, "ranks [0, 1, 2]"),
    ],
)
def test_checkers_reject_through_check(wrong, checker, message, capsys):
    assert check(wrong, checker, nproc=3, backend="gloo", timeout=90) is False
    out = capsys.readouterr().out
    assert "✗" in out and "rank " in out and message in out, out


def test_waiting_forever_replays_blocking_order():
    def ring(n, first):
        second = "recv" if first == "send" else "send"
        return [[(kind, (r + 1) % n if kind == "send" else (r - 1) % n) for kind in (first, second)] for r in range(n)]

    assert collectives.waiting_forever(ring(3, "send")) == [0, 1, 2]
    assert collectives.waiting_forever(ring(3, "recv")) == [0, 1, 2]
    for n in range(2, 9):
        even_odd = [ring(n, "send" if r % 2 == 0 else "recv")[r] for r in range(n)]
        assert collectives.waiting_forever(even_odd) == [], n
    assert collectives.waiting_forever([[("send", 1)], []]) == [0]


@pytest.mark.parametrize("nproc", [1, 2, 3, 4, 8])
def test_ring_bytes_prediction(nproc, capsys):
    S = 4 * 2**20
    measured = collectives.bytes_sent_per_rank("all_reduce", S, nproc)  # asserted equal to the count in the notebook
    assert check_prediction("bytes", solutions(nproc)["predicted_ring_bytes"], measured, rtol=0.02) is True
    wrong = {"2S (the factor (N-1)/N forgotten)": 2 * S, "(N-1)/N S (one phase)": (nproc - 1) / nproc * S}
    wrong["2(N-1) S (whole tensors)"] = 2 * (nproc - 1) * S
    for reasoning, value in wrong.items():
        if value != measured:
            assert check_prediction("bytes", value, measured, rtol=0.02) is False, reasoning
    capsys.readouterr()


def test_stub_is_not_attempted(capsys):
    def reduce_scatter_stub(tensor):
        raise NotImplementedError

    assert check(reduce_scatter_stub, collectives.check_reduce_scatter, nproc=2) is None
    assert "not attempted yet" in capsys.readouterr().out
