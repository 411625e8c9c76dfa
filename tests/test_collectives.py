"""course_lib.collectives: the from-scratch ring against torch's collectives on real gloo ranks,
the cost model, the ring schedule the explorer draws, and the exercise checkers."""

import pytest
import torch
import torch.distributed as dist

from course_lib import collectives
from course_lib.exercises import check
from tests.rank_programs import collectives as rank_programs
from tests.rank_programs import run


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


# ---- exercise checkers: the reference passes, wrong answers fail and name the rank -------------


def reduce_scatter_without_reducing(tensor):
    return torch.tensor_split(tensor, dist.get_world_size())[dist.get_rank()]


def reduce_scatter_with_torch(tensor):
    out = torch.empty(tensor.numel() // dist.get_world_size())
    dist.reduce_scatter_single(out, tensor)
    return out


def reduce_scatter_even_split_only(tensor):
    from course_lib.collectives import ring_reduce_scatter

    n = dist.get_world_size()
    full = tensor.clone()
    size = tensor.numel() // n  # drops the remainder: wrong when N does not divide numel
    chunk = ring_reduce_scatter(full)
    return chunk[:size]


def all_gather_own_chunk_only(chunk, sizes):
    return chunk


def all_gather_reversed(chunk, sizes):
    from course_lib.collectives import ring_all_gather

    out = ring_all_gather(chunk, sizes)
    parts = torch.split(out, sizes)
    return torch.cat(parts[::-1])


def reduce_scatter_stub(tensor):
    raise NotImplementedError


def test_checkers_accept_reference_on_3_ranks(capsys):
    assert check(collectives.solution_reduce_scatter, collectives.check_reduce_scatter, nproc=3, backend="gloo") is True
    assert check(collectives.solution_all_gather, collectives.check_all_gather, nproc=3, backend="gloo") is True
    assert "correct on 3 ranks" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, checker, message",
    [
        (reduce_scatter_without_reducing, "check_reduce_scatter", "expected"),
        (reduce_scatter_with_torch, "check_reduce_scatter", "dist.reduce_scatter_single is not allowed"),
        (reduce_scatter_even_split_only, "check_reduce_scatter", "expected shape"),
        (all_gather_own_chunk_only, "check_all_gather", "expected shape"),
        (all_gather_reversed, "check_all_gather", "expected"),
    ],
)
def test_checkers_reject_wrong_answers(wrong, checker, message, capsys):
    assert check(wrong, getattr(collectives, checker), nproc=2, backend="gloo") is False
    out = capsys.readouterr().out
    assert "✗" in out and "rank " in out and message in out, out


def test_stub_is_not_attempted(capsys):
    assert check(reduce_scatter_stub, collectives.check_reduce_scatter, nproc=2) is None
    assert "not attempted yet" in capsys.readouterr().out
