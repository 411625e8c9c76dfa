"""course_lib.collectives: the from-scratch ring against torch's collectives on real gloo ranks,
the ring stepped one step at a time against the schedule the explorer draws, the collectives the live
explorer runs, the cost model, and the exercise checkers."""

import runpy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from course_lib import collectives
from course_lib.exercises import check, check_prediction
from course_lib.launch import launch
from tests.rank_programs import assert_judged, judge, quiet, run, world_sizes
from tests.rank_programs import collectives as rank_programs


# One launch per world size: every size and operation is checked inside it (a launch costs seconds).
@pytest.mark.parametrize("world_size", world_sizes(2, 3, 4))
def test_ring_matches_torch(world_size):
    results = run(rank_programs.against_torch, world_size, timeout=120)
    problems = [p for per_rank in results for p in per_rank["problems"]]
    assert problems == []


def stepped_ring_and_explorer(rank, world_size):
    """On the ranks: the ring one step at a time (the notebook's 2^r buffers) against the simulated
    states and dist.all_reduce, and every collective of the live explorer at two sizes."""
    from course_lib import collectives as C

    problems = []
    states = C.ring_all_reduce_states(world_size)
    for numel in (world_size, 2 * world_size + 1):  # one element per chunk, and uneven chunks
        buf = torch.full((numel,), 2.0**rank)
        offsets = C.chunk_offsets(C.chunk_sizes(numel, world_size))
        steps = [("reduce_scatter", C.reduce_scatter_step_), ("all_gather", C.all_gather_step_)]
        k = 0
        for phase, step_ in steps:
            for step in range(world_size - 1):
                step_(buf, offsets, step)
                k += 1
                chunks = [buf[offsets[c] : offsets[c + 1]] for c in range(world_size)]
                held = [C.contributors(chunk[0].item(), world_size) for chunk in chunks]
                if any(len(set(chunk.tolist())) != 1 for chunk in chunks) or held != states[k]["holds"][rank]:
                    problems.append(f"rank {rank}: {phase} step {step} of {numel} elements holds {held}")
        expected = torch.full((numel,), 2.0**rank)
        dist.all_reduce(expected)
        if not torch.equal(buf, expected):
            problems.append(f"rank {rank}: the stepped ring of {numel} elements differs from dist.all_reduce")
    ran = {(name, k): C.run_collective(name, k) for name in C.EXPLORER_COLLECTIVES for k in (1, 3)}
    return {"problems": problems, "ran": ran}


def expected_collective(name, k, n):
    """What run_collective leaves on each rank, from the example data alone: [(before, after)] by rank."""
    xs = [collectives.example_data(r, n, k) for r in range(n)]
    total = torch.stack(xs).sum(0)
    shares = [x[:k] for x in xs]
    return [
        {
            "broadcast": (xs[r], xs[0]),
            "reduce": (xs[r], total if r == 0 else None),
            "all_reduce": (xs[r], total),
            "gather": (shares[r], torch.cat(shares) if r == 0 else None),
            "scatter": (xs[0] if r == 0 else None, xs[0][r * k : (r + 1) * k]),
            "all_gather_single": (shares[r], torch.cat(shares)),
            "reduce_scatter_single": (xs[r], total[r * k : (r + 1) * k]),
            "all_to_all_single": (xs[r], torch.cat([x[r * k : (r + 1) * k] for x in xs])),
        }[name]
        for r in range(n)
    ]


@pytest.mark.parametrize("world_size", world_sizes(3, 4))
def test_stepped_ring_and_live_explorer(world_size):
    # by its importable name: pytest imports this file as `test_collectives`, which a rank cannot import
    body = "from tests.test_collectives import stepped_ring_and_explorer as f\nresult = f(rank, world_size)\n"
    results = launch(body, world_size, backend="gloo", out=["result"], timeout=120, write=quiet).values["result"]
    assert [p for per_rank in results for p in per_rank["problems"]] == []
    for (name, k), _ in results[0]["ran"].items():
        expected = expected_collective(name, k, world_size)
        for r in range(world_size):
            for got, want in zip(results[r]["ran"][name, k], expected[r]):
                assert (got is None and want is None) or torch.equal(got, want), (name, k, r, got, want)


def test_contributions_decode_and_label():
    assert collectives.contributors(2**0 + 2**2, 3) == {0, 2}
    assert collectives.contribution_label({2, 0}, 3) == "0+2"
    assert collectives.contribution_label({0, 1, 2}, 3) == "Σ"
    assert collectives.describe_chunks(torch.tensor([7.0, 2.0]), 3) == "chunk 0: Σ      chunk 1: 1"
    assert collectives.example_data(1, 2, 2).tolist() == [10, 11, 12, 13]
    assert collectives.example_data(1, 4, 3)[0] == 100  # past 10 elements: 100r + i, values stay distinct
    with pytest.raises(ValueError, match="unknown collective"):
        collectives.run_collective("all_reduce_everything", 1)


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
    held = [(torch.arange(4.0), None), (None, torch.arange(2.0))]
    fig = collectives.draw_before_after(held, "reduce")
    assert [ax.get_title() for ax in fig.axes] == ["reduce: before", "after"]
    plt.close("all")


def test_section_figures_draw(monkeypatch):
    """The figures the notebook draws in one line each: from the formulas, from what the ranks kept, from a run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "show", lambda: None)
    collectives.draw_bytes_per_rank(8)
    assert len(plt.gcf().axes[0].lines) == 3
    collectives.draw_deadlock(3)
    assert [t.get_text() for t in plt.gca().texts if t.get_text()] == [f"rank {r}\nin recv" for r in range(3)]
    held = [{"broadcast": (torch.tensor([float(r)]), torch.tensor([0.0]))} for r in range(2)]
    collectives.draw_all_holdings(held)
    assert [ax.get_title() for ax in plt.gcf().axes[:2]] == ["broadcast: before", "after"]
    rows = [
        {"name": "all_reduce", "bytes": b, "seconds": 1e-4 + b * 1e-9, "busbw": b / (1e-4 + b * 1e-9)}
        for b in (4096, 2**20)
    ]
    collectives.draw_bandwidth(rows, 5e-5, 1e-9, 2)
    assert plt.gcf().axes[0].get_title() == "bus bandwidth, 2 ranks"
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


def _gather_all(chunk, sizes):  # a ring all-gather: the chunks, in rank order
    rank, n = dist.get_rank(), dist.get_world_size()
    parts = [torch.empty(size) for size in sizes]
    parts[rank] = chunk
    for step in range(n - 1):
        send, receive = (rank - step) % n, (rank - 1 - step) % n
        ops = [
            dist.P2POp(dist.isend, parts[send], (rank + 1) % n),
            dist.P2POp(dist.irecv, parts[receive], (rank - 1) % n),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return parts


def reduce_scatter_even_split_only(tensor):  # sent alone by check(): self-contained
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = [chunk.clone() for chunk in torch.tensor_split(tensor, n)]
    for step in range(n - 1):  # the ring, right
        send, receive = (rank - 1 - step) % n, (rank - 2 - step) % n
        incoming = torch.empty_like(chunks[receive])
        ops = [dist.P2POp(dist.isend, chunks[send], (rank + 1) % n), dist.P2POp(dist.irecv, incoming, (rank - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        chunks[receive] += incoming
    return chunks[rank][: tensor.numel() // n]  # drops the remainder: wrong when N does not divide numel


def all_gather_own_chunk_only(chunk, sizes):
    return chunk


def all_gather_reversed(chunk, sizes):
    return torch.cat(_gather_all(chunk, sizes)[::-1])


def reduce_scatter_by_the_course_ring(tensor):  # the shortcut: section 4's ring, called instead of written
    from course_lib.collectives import ring_reduce_scatter

    return ring_reduce_scatter(tensor.clone())


def all_gather_by_the_course_steps(chunk, sizes):  # the shortcut: section 4's step function, in a loop
    from course_lib.collectives import all_gather_step_, chunk_offsets

    rank, offsets = dist.get_rank(), chunk_offsets(sizes)
    flat = torch.zeros(sum(sizes))
    flat[offsets[rank] : offsets[rank + 1]] = chunk
    for step in range(dist.get_world_size() - 1):
        all_gather_step_(flat, offsets, step)
    return flat


def all_gather_with_torch(chunk, sizes):
    out = [torch.empty(size) for size in sizes]
    dist.all_gather(out, chunk)
    return torch.cat(out)


def reduce_scatter_by_naive_all_reduce(tensor):  # the shortcut: the whole sum through rank 0, then cut
    from course_lib.collectives import naive_all_reduce

    return torch.tensor_split(naive_all_reduce(tensor.clone()), dist.get_world_size())[dist.get_rank()]


def reduce_scatter_direct(tensor):  # chunk c straight to rank c: the bytes of a ring, but no ring
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(tensor, n)
    received = [torch.empty_like(chunks[rank]) for _ in range(n)]
    ops = [dist.P2POp(dist.isend, chunks[r].contiguous(), r) for r in range(n) if r != rank]
    ops += [dist.P2POp(dist.irecv, received[r], r) for r in range(n) if r != rank]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return sum(received[r] for r in range(n) if r != rank) + chunks[rank]


def all_gather_zero_padded_naive(chunk, sizes):  # the shortcut: zero-pad the chunk to the full size, sum all of them
    from course_lib.collectives import chunk_offsets, naive_all_reduce

    rank, offsets = dist.get_rank(), chunk_offsets(sizes)
    full = torch.zeros(sum(sizes))
    full[offsets[rank] : offsets[rank + 1]] = chunk
    return naive_all_reduce(full)


def all_gather_zero_padded_ring(chunk, sizes):  # right peers, but whole zero-padded tensors around the ring
    from course_lib.collectives import chunk_offsets

    rank, n, offsets = dist.get_rank(), dist.get_world_size(), chunk_offsets(sizes)
    full = torch.zeros(sum(sizes))
    full[offsets[rank] : offsets[rank + 1]] = chunk
    passing = full.clone()
    for _ in range(n - 1):
        incoming = torch.empty_like(full)
        ops = [dist.P2POp(dist.isend, passing, (rank + 1) % n), dist.P2POp(dist.irecv, incoming, (rank - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        full += incoming
        passing = incoming
    return full


def _old_fixed_seed_data(numel, rank):  # what the checkers once fed: knowable without communicating
    return torch.randint(-9, 10, (numel,), generator=torch.Generator().manual_seed(1000 * numel + rank)).float()


def reduce_scatter_from_the_seed(tensor):  # every rank's data recomputed here, no message sent
    n = dist.get_world_size()
    total = sum(_old_fixed_seed_data(tensor.numel(), r) for r in range(n))
    return torch.tensor_split(total, n)[dist.get_rank()]


def all_gather_from_the_seed(chunk, sizes):
    return _old_fixed_seed_data(sum(sizes), 0)


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
    ("reduce_scatter_by_the_course_ring", "check_reduce_scatter", "this calls the course's own ring (section 4"),
    ("all_gather_by_the_course_steps", "check_all_gather", "this calls the course's own ring (section 4"),
    ("reduce_scatter_from_the_seed", "check_reduce_scatter", "reduce_scatter of 12 elements on 3 ranks"),
    ("all_gather_from_the_seed", "check_all_gather", "all_gather of 12 elements on 3 ranks"),
    ("reduce_scatter_by_naive_all_reduce", "check_reduce_scatter", "with collectives.naive_all_reduce (every tensor"),
    ("reduce_scatter_direct", "check_reduce_scatter", "in a ring a rank sends only to its right neighbour"),
    ("all_gather_zero_padded_naive", "check_all_gather", "with collectives.naive_all_reduce (every tensor"),
    ("all_gather_zero_padded_ring", "check_all_gather", "whole or zero-padded tensors are not the ring"),
    ("pass_right_nonblocking", "check_pass_right", "dist.isend is not allowed here: the exercise is to fix the order"),
    ("pass_right_wrong_direction", "check_pass_right", "(the token of rank"),
    ("pass_right_local", "check_pass_right", "(the token of rank"),
]


def test_solutions_pass_and_wrong_answers_fail_on_3_ranks():
    answers = solutions(3)
    assert_judged(
        [(answers[name], getattr(collectives, checker)) for name, checker in SOLVED],
        [(globals()[wrong], getattr(collectives, checker), says) for wrong, checker, says in WRONG],
    )


@pytest.mark.parametrize("nproc", world_sizes(2, 4))
def test_solutions_pass_at_other_world_sizes(nproc):
    answers = solutions(nproc)
    verdicts = judge([(answers[name], getattr(collectives, checker)) for name, checker in SOLVED], nproc)
    assert verdicts == [["ok"] * nproc] * len(SOLVED), verdicts


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
    S, npeers = 4 * 2**20, max(2, nproc)  # measured on the session's NPEERS ranks
    measured = collectives.bytes_sent_per_rank("all_reduce", S, npeers)  # asserted equal to the count in the notebook
    assert check_prediction("bytes", solutions(nproc)["predicted_ring_bytes"], measured, rtol=0.02) is True
    wrong = {"2S (the factor (N-1)/N forgotten)": 2 * S, "(N-1)/N S (one phase)": (npeers - 1) / npeers * S}
    wrong["2(N-1) S (whole tensors)"] = 2 * (npeers - 1) * S
    for reasoning, value in wrong.items():
        if value != measured:
            assert check_prediction("bytes", value, measured, rtol=0.02) is False, reasoning
    capsys.readouterr()


def test_stub_is_not_attempted(capsys):
    def reduce_scatter_stub(tensor):
        raise NotImplementedError

    assert check(reduce_scatter_stub, collectives.check_reduce_scatter, nproc=2) is None
    assert "not attempted yet" in capsys.readouterr().out


def test_pass_right_checker_hands_a_cpu_token_to_gloo_even_on_a_gpu_rank(monkeypatch):
    """record_calls bounds a blocking recv only where gloo carries it: on a GPU rank (meta stands in) the token
    stays on the CPU, which the default group's gloo part carries ("cpu:gloo,cuda:nccl")."""
    from course_lib.collectives import checkers
    from tests.device_fakes import Reached, on_meta, recorder

    on_meta(monkeypatch, checkers)
    devices: list = []
    with pytest.raises(Reached):
        checkers.check_pass_right(recorder(devices))
    assert devices == [torch.device("cpu")]
