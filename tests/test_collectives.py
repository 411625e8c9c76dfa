"""course_lib.collectives: the from-scratch ring against torch's collectives on real gloo ranks,
the cost model, the ring schedule the explorer draws, and the exercise checkers."""

import pytest
import torch

from course_lib import collectives, launcher
from course_lib.exercises import check


def quiet(text, stream):
    pass


# One launch per world size: every size and operation is checked inside it (a launch costs seconds).
AGAINST_TORCH = r"""
from course_lib import collectives as C
problems = []
def expect(cond, what):
    if not cond:
        problems.append(f"rank {rank}: {what}")

gen = torch.Generator().manual_seed(rank)
sizes = sorted({1, world_size - 1, world_size, 7, 4 * world_size + 1, 1000, 1001})
for numel in [s for s in sizes if s > 0]:
    ints = torch.randint(-50, 50, (numel,), generator=gen).float()  # exact sums in any order
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
        ours, theirs = ints.clone(), ints.clone()
        C.ring_all_reduce(ours, op=op)
        dist.all_reduce(theirs, op=op)
        expect(torch.allclose(ours, theirs), f"ring_all_reduce {op} numel {numel}")
    total = ints.clone()
    dist.all_reduce(total)
    before = ints.clone()
    chunk = C.ring_reduce_scatter(ints, op=dist.ReduceOp.SUM)
    expect(torch.equal(chunk, torch.tensor_split(total, world_size)[rank]), f"ring_reduce_scatter numel {numel}")
    expect(torch.equal(ints, before), "ring_reduce_scatter leaves its input unchanged")
    sizes_ = C.chunk_sizes(numel, world_size)
    gathered = C.ring_all_gather(chunk, sizes_)
    expect(torch.equal(gathered, total), f"ring_all_gather(ring_reduce_scatter) numel {numel}")
    naive = ints.clone()
    C.naive_all_reduce(naive)
    expect(torch.equal(naive, total), f"naive_all_reduce numel {numel}")

# Floats in a 2-D and a non-contiguous tensor: same values up to summation order, shape kept.
x = torch.randn(33, 5, generator=gen)
ours, theirs = x.clone(), x.clone()
dist.all_reduce(theirs)
expect(C.ring_all_reduce(ours) is ours and ours.shape == (33, 5), "in place, shape kept")
expect(torch.allclose(ours, theirs, atol=1e-5), "float 2-D")
nc = x.clone().t()
C.ring_all_reduce(nc)
expect(torch.allclose(nc, theirs.t(), atol=1e-5), "non-contiguous")

# all_gather with equal chunks (sizes default) against torch's all_gather_single.
mine = torch.arange(6.0) + 100 * rank
out = torch.empty(6 * world_size)
dist.all_gather_single(out, mine)
expect(torch.equal(C.ring_all_gather(mine), out), "ring_all_gather equal chunks")

# Bytes each rank sends: the formula, exactly, when N divides the size.
for name, run in (("ring_all_reduce", C.ring_all_reduce), ("naive_all_reduce", C.naive_all_reduce)):
    t = torch.ones(240 * world_size)
    C.reset_traffic()
    run(t)
    sent = C.traffic()["bytes_sent"]
    want = C.bytes_sent_per_rank(name, t.numel() * 4, world_size) if (name == "ring_all_reduce" or rank == 0) \
        else t.numel() * 4
    expect(sent == want, f"{name} sent {sent} bytes, formula {want}")
C.reset_traffic()
C.ring_reduce_scatter(torch.ones(60 * world_size))
expect(C.traffic()["bytes_sent"] == C.bytes_sent_per_rank("reduce_scatter", 240 * world_size, world_size),
       "reduce_scatter traffic")
expect(C.traffic()["messages"] == world_size - 1, "reduce_scatter messages")

# A subgroup: the ring on ranks 1..N-1 only (group ranks differ from global ranks).
if world_size >= 3:
    members = list(range(1, world_size))
    group = dist.new_group(members)
    if rank in members:
        t = torch.full((10,), float(rank))
        C.ring_all_reduce(t, group=group)
        expect(torch.equal(t, torch.full((10,), float(sum(members)))), "subgroup all-reduce")
        part = C.ring_reduce_scatter(torch.arange(10.0), group=group)
        expect(torch.equal(part, torch.tensor_split(torch.arange(10.0) * len(members), len(members))[dist.get_rank(group)]),
               "subgroup reduce-scatter")

# The benchmark's rows, on tiny sizes.
rows = C.benchmark([4096, 65536], ["all_reduce", "ring_all_reduce", "all_gather", "reduce_scatter", "broadcast"],
                   repeats=2)
expect(len(rows) == 10 and all(r["seconds"] > 0 and r["busbw"] > 0 for r in rows), "benchmark rows")
ar = [r for r in rows if r["name"] == "all_reduce"][0]
expect(abs(ar["busbw"] / ar["algbw"] - 2 * (world_size - 1) / world_size) < 1e-9, "bus factor")
ok = problems
"""


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_matches_torch(world_size):
    result = launcher.launch(AGAINST_TORCH, world_size, backend="gloo", out=["ok"], write=quiet, timeout=120)
    problems = [p for rank_problems in result.values["ok"] for p in rank_problems]
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


def reduce_scatter(tensor):
    from course_lib.collectives import ring_reduce_scatter

    return ring_reduce_scatter(tensor)


def all_gather(chunk, sizes):
    from course_lib.collectives import ring_all_gather

    return ring_all_gather(chunk, sizes)


def reduce_scatter_without_reducing(tensor):
    return torch.tensor_split(tensor, dist.get_world_size())[dist.get_rank()]


def reduce_scatter_with_torch(tensor):
    out = torch.empty(tensor.numel() // dist.get_world_size())
    dist.reduce_scatter_single(out, tensor)
    return out


def reduce_scatter_even_split_only(tensor):
    from course_lib.collectives import ring_reduce_scatter

    n, r = dist.get_world_size(), dist.get_rank()
    full = tensor.clone()
    size = tensor.numel() // n  # drops the remainder: wrong when N does not divide numel
    chunk = ring_reduce_scatter(full)
    return chunk[:size]


def all_gather_own_chunk_only(chunk, sizes):
    return chunk


def all_gather_reversed(chunk, sizes):
    from course_lib.collectives import ring_all_gather

    n = dist.get_world_size()
    out = ring_all_gather(chunk, sizes)
    parts = torch.split(out, sizes)
    return torch.cat(parts[::-1])


def reduce_scatter_stub(tensor):
    raise NotImplementedError


def test_checkers_accept_reference_on_3_ranks(capsys):
    assert check(reduce_scatter, "course_lib.collectives:check_reduce_scatter", nproc=3, backend="gloo") is True
    assert check(all_gather, "course_lib.collectives:check_all_gather", nproc=3, backend="gloo") is True
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
    assert check(wrong, f"course_lib.collectives:{checker}", nproc=2, backend="gloo") is False
    out = capsys.readouterr().out
    assert "✗" in out and "rank " in out and message in out, out


def test_stub_is_not_attempted(capsys):
    assert check(reduce_scatter_stub, "course_lib.collectives:check_reduce_scatter", nproc=2) is None
    assert "not attempted yet" in capsys.readouterr().out
