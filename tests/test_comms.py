"""course_lib.comms: the one recorder of communication, on real gloo ranks (every op it knows, the
from-scratch collectives, DDP's C++ reducer, a subgroup, the backward phase), and the cost models."""

import pytest
import torch

from course_lib import comms
from tests.rank_programs import run_source, world_sizes


def every_op(rank, world_size):
    """On the ranks: one call of each kind, recorded; what each Call says, and what the readers make of it."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.nn.parallel import DistributedDataParallel

    from course_lib import collectives, comms

    n, peer = world_size, (rank + 1) % world_size
    x = torch.ones(4 * n)
    with comms.Recorder() as rec:
        dist.all_reduce(x.clone())
        dist.all_gather_single(torch.empty(4 * n * n), x)
        dist.reduce_scatter_single(torch.empty(4), x.clone())
        dist.broadcast(x.clone(), 0)
        dist.reduce(x.clone(), 0)
        dist.gather(x.clone(), [torch.empty(4 * n) for _ in range(n)] if rank == 0 else None, dst=0)
        dist.scatter(torch.empty(4), [torch.ones(4)] * n if rank == 0 else None, src=0)
        splits = [rank + 1] * n  # rows this rank sends to each rank: uneven on purpose
        received = [r + 1 for r in range(n)]
        dist.all_to_all_single(torch.empty(sum(received), 2), torch.ones(sum(splits), 2), received, splits)
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, torch.empty(4 * n), (rank - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        funcol.wait_tensor(funcol.all_reduce(x.double(), "sum", dist.group.WORLD))
        collectives.ring_all_reduce(x.clone())
    pairs = [(c.op, c.nbytes, c.dtype, c.phase, c.inside, c.group) for c in rec.calls if c.inside is None]
    peers = [(c.op, c.peer) for c in rec.calls if c.inside is None and c.peer is not None]
    ring_sends = [c for c in rec.calls if c.inside == "all_reduce"]

    # DDP's bucket all-reduce runs in its C++ reducer, in backward
    model = DistributedDataParallel(torch.nn.Linear(3, 2))
    with comms.Recorder() as ddp:
        model(torch.ones(5, 3)).sum().backward()

    # a subgroup: its ranks, not the world's
    group = dist.new_group([0, n - 1]) if n > 1 else None
    sub = None
    if n > 1 and rank in (0, n - 1):
        with comms.Recorder() as sub_rec:
            dist.all_reduce(torch.ones(3), group=group)
        sub = sub_rec.calls[0].group
    return {
        "pairs": pairs,
        "peers": peers,
        "ring_sends": [(c.op, c.nbytes) for c in ring_sends],
        "counts": rec.counts(),
        "wire": rec.wire_bytes(),
        "ddp": [(c.op, c.nbytes, c.phase) for c in ddp.calls],
        "sub": sub,
    }


@pytest.mark.parametrize("world_size", world_sizes(2, 3))
def test_every_op_is_recorded_with_its_payload_group_and_phase(world_size):
    n = world_size
    results = run_source(every_op, n)
    world = tuple(range(n))
    f32, f64 = torch.float32, torch.float64
    for rank, got in enumerate(results):
        assert got["pairs"] == [
            ("all_reduce", 16 * n, f32, "forward", None, world),
            ("all_gather", 16 * n * n, f32, "forward", None, world),  # the gathered output
            ("reduce_scatter", 16 * n, f32, "forward", None, world),  # the reduced input
            ("broadcast", 16 * n, f32, "forward", None, world),
            ("reduce", 16 * n, f32, "forward", None, world),
            ("gather", 16 * n, f32, "forward", None, world),  # this rank's tensor, on the root and off it
            ("scatter", 16, f32, "forward", None, world),  # this rank's chunk
            ("all_to_all", (rank + 1) * (n - 1) * 2 * 4, f32, "forward", None, world),  # to the other ranks only
            ("send", 16 * n, f32, "forward", None, world),
            ("recv", 16 * n, f32, "forward", None, world),
            ("all_reduce", 32 * n, f64, "forward", None, world),  # a functional collective, by its group's name
            ("all_reduce", 16 * n, f32, "forward", None, world),  # the ring, announced once
        ]
        assert got["peers"] == [("send", (rank + 1) % n), ("recv", (rank - 1) % n)]  # the batch's, global ranks
        # the ring's own messages: 2(N-1) sends of a chunk each, marked as the all-reduce's
        assert [op for op, _ in got["ring_sends"] if op == "send"] == ["send"] * 2 * (n - 1)
        assert got["counts"]["all_reduce"] == 3 and got["counts"]["send"] == 1
        assert got["wire"] == 16 * n + 2 * (n - 1) * 16  # the batch's send plus the ring's chunks of 4 floats
        assert got["ddp"] == [("all_reduce", (3 * 2 + 2) * 4, "backward")]  # one bucket, weight and bias
        assert got["sub"] == ((0, n - 1) if rank in (0, n - 1) else None)


def test_cost_models_and_readers():
    f = torch.float32
    calls = [
        comms.Call("all_gather", (0, 1, 2, 3), 400, f, "forward"),
        comms.Call("reduce_scatter", (0, 1), 200, f, "backward"),
        comms.Call("all_reduce", (0, 2), 100, f, "backward"),
        comms.Call("send", (0, 2), 8, f, "backward", inside="all_reduce"),  # part of the call above
    ]
    assert comms.sent_bytes(calls) == 300 + 100 + 100
    assert comms.sent_bytes(calls, comms.GLOO) == 300 + 200 + 100  # gloo's reduce-scatter costs an all-reduce
    assert comms.counts(calls) == {"all_gather": 1, "all_reduce": 1, "reduce_scatter": 1}
    assert comms.counts(calls, "backward") == {"all_reduce": 1, "reduce_scatter": 1}
    assert comms.wire_bytes(calls) == 8
    assert comms.per_group(calls + calls[:1]) == {
        ("all_gather", (0, 1, 2, 3)): (2, 800),
        ("reduce_scatter", (0, 1)): (1, 200),
        ("all_reduce", (0, 2)): (1, 100),
    }
    assert comms.RING["all_reduce"](4) == 1.5 and comms.RING["broadcast"](4) == 1.0
    assert comms.RING["reduce"](4) == comms.RING["reduce_scatter"](4) == 0.75


def test_bus_factors_are_nccl_tests_and_bytes_sent_are_the_ring_costs():
    """nccl-tests' bus factors (doc/PERFORMANCE.md) where they differ from the bytes one rank sends: a reduce's busbw
    is its algbw, an all-to-all's (N-1)/N of it; a rank of a reduce sends (N-1)/N on average, of an all-to-all its
    payload."""
    from course_lib.collectives import bus_factor, bytes_sent_per_rank

    n = 8
    factors = {c: bus_factor(c, n) for c in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")}
    assert factors == {"all_reduce": 1.75, "all_gather": 0.875, "reduce_scatter": 0.875, "broadcast": 1, "reduce": 1}
    assert bus_factor("all_to_all", n) == 0.875 and bytes_sent_per_rank("all_to_all", 64.0, n) == 64.0
    assert bytes_sent_per_rank("reduce", 64.0, n) == 56.0 and bytes_sent_per_rank("ring_all_reduce", 64.0, n) == 112.0
