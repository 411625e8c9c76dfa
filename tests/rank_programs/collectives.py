"""Rank programs for tests/test_collectives.py: the from-scratch ring against torch's collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist


def against_torch(rank: int, world_size: int) -> dict:
    """Every size (one launch per world size) and operation of the ring against torch; traffic
    against the formula; a subgroup; the benchmark's rows."""
    from course_lib import collectives as C
    from course_lib import comms

    problems: list[str] = []

    def expect(cond: bool, what: str) -> None:
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
        with comms.Recorder() as rec:
            run(t)
        sent = rec.wire_bytes()
        want = (
            C.bytes_sent_per_rank(name, t.numel() * 4, world_size)
            if (name == "ring_all_reduce" or rank == 0)
            else t.numel() * 4
        )
        expect(sent == want, f"{name} sent {sent} bytes, formula {want}")
    with comms.Recorder() as rec:
        C.ring_reduce_scatter(torch.ones(60 * world_size))
    expect(rec.wire_bytes() == C.bytes_sent_per_rank("reduce_scatter", 240 * world_size, world_size), "reduce_scatter")
    expect(rec.wire_bytes() == rec.sent_bytes(), "the ring sends what the cost model says")
    expect(rec.counts() == {"reduce_scatter": 1}, f"one reduce-scatter announced: {rec.counts()}")
    sends = [c for c in rec.calls if c.op == "send"]
    expect(len(sends) == world_size - 1 and all(c.inside == "reduce_scatter" for c in sends), "its N-1 sends")

    # A subgroup: the ring on ranks 1..N-1 only (group ranks differ from global ranks).
    if world_size >= 3:
        members = list(range(1, world_size))
        group = dist.new_group(members)
        if rank in members:
            t = torch.full((10,), float(rank))
            C.ring_all_reduce(t, group=group)
            expect(torch.equal(t, torch.full((10,), float(sum(members)))), "subgroup all-reduce")
            part = C.ring_reduce_scatter(torch.arange(10.0), group=group)
            expect(
                torch.equal(
                    part, torch.tensor_split(torch.arange(10.0) * len(members), len(members))[dist.get_rank(group)]
                ),
                "subgroup reduce-scatter",
            )

    # The benchmark's rows, on tiny sizes.
    rows = C.benchmark(
        [4096, 65536], ["all_reduce", "ring_all_reduce", "all_gather", "reduce_scatter", "broadcast"], repeats=2
    )
    expect(len(rows) == 10 and all(r["seconds"] > 0 and r["busbw"] > 0 for r in rows), "benchmark rows")
    ar = next(r for r in rows if r["name"] == "all_reduce")
    expect(abs(ar["busbw"] / ar["algbw"] - 2 * (world_size - 1) / world_size) < 1e-9, "bus factor")
    return {"problems": problems}
