"""course_lib.context_parallel: layouts, the online-softmax merge, ring attention on 2-4 gloo ranks against full
attention on one process (outputs and gradients, lengths not divisible by N), the bytes against the formula, the
context-parallel TransformerBlock, torch's layout, and the exercise's checker against its solution and wrong answers.

The multi-rank programs are functions of this file sent to the ranks as source (tests.rank_programs.run_source), each
self-contained (imports inside).
"""

import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from course_lib import context_parallel as cp
from course_lib.exercises import check_prediction
from tests.rank_programs import assert_checker, judge, run_source, world_sizes

SOLUTIONS_FILE = str(Path(__file__).parent.parent / "notebooks" / "solutions" / "10_context_parallel.py")
SOLUTIONS = runpy.run_path(SOLUTIONS_FILE, init_globals={"NPROC": 2})


def predicted_forward_bytes(n: int) -> int:
    """Exercise 2's solution, an expression of the notebook's NPROC, at NPROC = n."""
    return runpy.run_path(SOLUTIONS_FILE, init_globals={"NPROC": n})["predicted_forward_bytes"]


# ---- one process -------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("seq_len", [12, 48, 50, 53])
def test_layouts_partition_the_sequence(layout, n, seq_len):
    held = cp.all_positions(layout, seq_len, n)
    assert sorted(torch.cat(held).tolist()) == list(range(seq_len))
    sizes = [len(h) for h in held]
    assert max(sizes) - min(sizes) <= (1 if layout == "contiguous" else 2)
    x = torch.randn(2, seq_len, 3)
    shards = [cp.shard_sequence(x, h, 1) for h in held]
    assert torch.equal(cp.unshard_sequence(shards, held, 1), x)


def test_zigzag_balances_the_causal_work():
    for n in (2, 3, 4, 6):
        s, c = 48, 48 // n
        assert [sum(w) for w in cp.causal_work("zigzag", s, n)] == [s * (s + 1) // (2 * n)] * n
        assert [sum(w) for w in cp.causal_work("contiguous", s, n)] == [c * (c + 1) // 2 + r * c * c for r in range(n)]
        slowest = {layout: sum(max(step) for step in zip(*cp.computed_work(layout, s, n))) for layout in cp.LAYOUTS}
        assert slowest == {"contiguous": n * c * c, "zigzag": c * c + (n - 1) * c * c // 2}
    assert cp.positions("zigzag", 50, 2, 0).tolist() == list(range(13)) + list(range(38, 50))
    assert cp.describe_positions(cp.positions("zigzag", 50, 2, 0)) == "0-12, 38-49"
    with pytest.raises(ValueError, match="at least 8 tokens"):
        cp.positions("zigzag", 7, 4, 0)
    with pytest.raises(ValueError, match="layout must be one of"):
        cp.positions("striped", 8, 2, 0)


def test_blocks_merged_equal_full_causal_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 4, dtype=torch.float64) for _ in range(3))
    positions = torch.arange(10)
    out = lse = None
    for block in (torch.arange(0, 4), torch.arange(4, 7), torch.arange(7, 10)):  # later blocks mask whole rows
        o, s = cp.block_attention(q, k[:, :, block], v[:, :, block], positions, positions[block])
        out, lse = (o, s) if out is None else cp.merge_partials(out, lse, o, s)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-12)
    rows, cols = cp.visible_rectangle(torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5]))
    assert rows.tolist() == [2, 3] and cols.tolist() == [0, 1, 2, 3]


def test_cost_formulas():
    for n in (2, 3, 4):
        every = [cp.ring_bytes("zigzag", 48, n, r, 2, 4, 8, 4) for r in range(n)]
        assert all(sum(b.values()) == cp.ring_bytes_even(48, n, 2, 4, 8, 4) for b in every)
        assert every[0]["forward K/V"] == predicted_forward_bytes(n)
    assert cp.ring_bytes("zigzag", 48, 1, 0, 2, 4, 8, 4) == {"forward K/V": 0, "backward K/V": 0, "backward dK/dV": 0}
    assert cp.saved_bytes(10, 2, 4, 8, 4) == (4 * 8 + 1) * 2 * 4 * 10 * 4
    assert cp.overlap_tokens(400e12, 450e9, 2) == pytest.approx(1777.8, rel=1e-4)


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_forward_bytes_prediction(n, capsys):
    measured = cp.ring_bytes("zigzag", 48, n, 0, 2, 4, 8, 4)["forward K/V"]
    assert check_prediction("forward bytes", predicted_forward_bytes(n), measured, rtol=0.01) is True
    for wrong in (measured / 2, measured * n / (n - 1), 2 * 2 * 4 * 48 * 8 * 4):  # K only; N steps; whole S
        assert check_prediction("forward bytes", wrong, measured, rtol=0.01) is False
    assert check_prediction("forward bytes", None, measured) is None
    capsys.readouterr()


# ---- on the ranks ------------------------------------------------------------------------------------


def ring_against_full_attention(rank, world_size):
    import torch
    import torch.nn.functional as F

    from course_lib import comms
    from course_lib import context_parallel as cp

    errors, traffic_ok, traces = [], [], []
    for seq_len in (48, 50, 53):
        for layout in cp.LAYOUTS:
            for causal in (True, False):
                torch.manual_seed(seq_len)
                q, k, v = (torch.randn(2, 4, seq_len, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
                grad_out = torch.randn(2, 4, seq_len, 8, dtype=torch.float64)
                F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(grad_out)
                reference = F.scaled_dot_product_attention(q, k, v, is_causal=causal).detach()
                held = cp.all_positions(layout, seq_len, world_size)
                mine = [cp.shard_sequence(t.detach(), held[rank], 2).requires_grad_() for t in (q, k, v)]
                trace = []
                with comms.Recorder() as rec:
                    out = cp.ring_attention(*mine, held, causal=causal, trace=trace)
                    out.backward(cp.shard_sequence(grad_out, held[rank], 2))
                got = [out.detach()] + [m.grad for m in mine]
                want = [reference, q.grad, k.grad, v.grad]
                errors.append(
                    max(float((a - cp.shard_sequence(b, held[rank], 2)).abs().max()) for a, b in zip(got, want))
                )
                # float64 elements are 8 bytes
                traffic_ok.append(cp.sent_by_kind(rec) == cp.ring_bytes(layout, seq_len, world_size, rank, 2, 4, 8, 8))
                traces.append([(e["phase"], e["step"], e["owner"]) for e in trace])
    return dict(errors=errors, traffic_ok=traffic_ok, traces=traces)


@pytest.mark.parametrize("n", world_sizes(2, 3, 4))
def test_ring_attention_equals_full_attention(n):
    for rank, result in enumerate(run_source(ring_against_full_attention, n)):
        assert max(result["errors"]) < 1e-12, (n, rank, result["errors"])
        assert all(result["traffic_ok"]), (n, rank)
        for trace in result["traces"]:
            owners = [owner for phase, _, owner in trace if phase == "forward"]
            assert owners == [(rank - t) % n for t in range(n)]
            assert len(trace) == 2 * n


def ulysses_against_full_attention(rank, world_size):
    import torch
    import torch.nn.functional as F

    from course_lib import comms
    from course_lib import context_parallel as cp

    errors, sent = [], {}
    for causal in (True, False):
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 12, 24, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
        full = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        full.pow(2).sum().backward()
        c = 24 // world_size
        mine = [t.detach()[:, :, rank * c : (rank + 1) * c].clone().requires_grad_() for t in (q, k, v)]
        with comms.Recorder() as rec:
            out = cp.ulysses_attention(*mine, causal=causal)
            out.pow(2).sum().backward()
        errors.append((out - full[:, :, rank * c : (rank + 1) * c]).abs().max().item())
        for t, part in zip((q, k, v), mine):
            errors.append((part.grad - t.grad[:, :, rank * c : (rank + 1) * c]).abs().max().item())
        sent = {
            phase: sum(call.nbytes for call in rec.calls if call.phase == phase) for phase in ("forward", "backward")
        }
        assert rec.counts() == {"all_to_all": 8}, rec.counts()
    return {"errors": errors, "sent": sent}


@pytest.mark.parametrize("n", world_sizes(2, 3, 4))
def test_ulysses_equals_full_attention_and_sends_its_formula(n):
    for rank, result in enumerate(run_source(ulysses_against_full_attention, n)):
        assert max(result["errors"]) < 1e-12, (n, rank, result["errors"])
        assert result["sent"] == cp.ulysses_bytes(24, n, batch=2, heads=12, head_dim=8, element_size=8), result
    ring_forward = cp.ring_bytes("contiguous", 24, n, 0, batch=2, heads=12, head_dim=8, element_size=8)["forward K/V"]
    assert cp.ulysses_bytes(24, n, 2, 12, 8, 8)["forward"] * n == 2 * ring_forward  # Ulysses / ring = 2 / N


def test_ulysses_refuses_heads_that_do_not_split():
    def five_ranks_eight_heads(rank, world_size):
        import torch

        from course_lib import context_parallel as cp

        try:
            cp.ulysses_attention(*(torch.zeros(1, 8, 2, 4) for _ in range(3)))
        except ValueError as error:
            return {"said": str(error)}
        return {"said": ""}

    said = run_source(five_ranks_eight_heads, 5)[0]["said"]
    assert said.startswith("Ulysses gives each of the 5 ranks whole heads, but 8 heads do not split 5 ways"), said


def block_and_torch_layout(rank, world_size):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from course_lib import compare
    from course_lib import context_parallel as cp
    from course_lib.models import TransformerBlock

    torch.manual_seed(1)
    x = torch.randn(2, 50, 48)
    full = TransformerBlock()
    x_full = x.clone().requires_grad_()
    full(x_full).pow(2).sum().backward()
    held = cp.all_positions("zigzag", 50, world_size)
    block = cp.ContextParallelBlock(TransformerBlock(), held)
    x_mine = cp.shard_sequence(x, held[rank], 1).requires_grad_()
    y = block(x_mine)
    y.pow(2).sum().backward()
    cp.sum_gradients(block)
    grads = dict(full.named_parameters())
    saved_full = compare.saved_activation_bytes(TransformerBlock(), x.clone().requires_grad_())
    saved_mine = compare.saved_activation_bytes(
        cp.ContextParallelBlock(TransformerBlock(), held), cp.shard_sequence(x, held[rank], 1).requires_grad_()
    )
    mesh = init_device_mesh("cpu", (world_size,))
    try:
        q, k, v, g = (torch.randn(1, 2, 8 * world_size, 4) for _ in range(4))
        cp.torch_ring_attention(q, k, v, g, mesh)
        refusal = "ran"
    except NotImplementedError as error:
        refusal = str(error)
    return dict(
        output=compare.relative_error(y, cp.shard_sequence(full(x), held[rank], 1)),
        input_grad=compare.relative_error(x_mine.grad, cp.shard_sequence(x_full.grad, held[rank], 1)),
        grads=max(compare.relative_error(p.grad, grads[n].grad) for n, p in block.named_parameters()),
        saved=(saved_mine, saved_full * len(held[rank]) / 50),
        torch_48=cp.torch_positions(48, mesh).tolist(),
        ours_48=cp.positions("zigzag", 48, world_size, rank).tolist(),
        refusal=refusal,
    )


def test_block_memory_and_torch_layout():
    for result in run_source(block_and_torch_layout, 3):
        assert max(result["output"], result["input_grad"], result["grads"]) < 1e-5, result
        assert result["saved"][0] == result["saved"][1]
        assert result["torch_48"] == result["ours_48"]
        assert "_scaled_dot_product_flash_attention_for_cpu" in result["refusal"]


# ---- the exercise ------------------------------------------------------------------------------------


def stub_ring_forward(q, k, v):
    raise NotImplementedError  # your code here


def local_ring_forward(q, k, v):
    from course_lib import context_parallel as cp

    return cp.block_attention(q, k, v)[0]  # only this rank's keys


def gathered_ring_forward(q, k, v):
    import torch
    import torch.distributed as dist

    from course_lib import context_parallel as cp

    ks = [torch.empty_like(k) for _ in range(dist.get_world_size())]
    vs = [torch.empty_like(v) for _ in range(dist.get_world_size())]
    dist.all_gather(ks, k)  # not a ring: everyone gets everything
    dist.all_gather(vs, v)
    return cp.block_attention(q, torch.cat(ks, dim=2), torch.cat(vs, dim=2))[0]


def _ring_blocks(k, v):
    """Each rank's stacked K/V block in turn, passed one step round the ring between yields."""
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    kv = torch.stack([k, v])
    for step in range(n):
        yield kv
        if step < n - 1:
            incoming = torch.empty_like(kv)
            ops = [dist.P2POp(dist.isend, kv, (rank + 1) % n), dist.P2POp(dist.irecv, incoming, (rank - 1) % n)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            kv = incoming


def relayed_then_sdpa_forward(q, k, v):  # the blocks go round the ring, but only to be stacked for one SDPA
    import torch
    import torch.nn.functional as F

    whole = torch.cat(list(_ring_blocks(k, v)), dim=3)  # every rank's K and V: no ring, no online softmax
    return F.scaled_dot_product_attention(q, whole[0], whole[1])


def averaged_ring_forward(q, k, v):
    import torch.distributed as dist

    from course_lib import context_parallel as cp

    n = dist.get_world_size()  # averages the blocks' outputs instead of the online softmax
    return sum(cp.block_attention(q, kv[0], kv[1])[0] / n for kv in _ring_blocks(k, v))


def library_ring_forward(q, k, v):  # the shortcut: the course's own ring attention, shown in section 3
    import torch
    import torch.distributed as dist

    from course_lib import context_parallel as cp

    c, n = q.shape[2], dist.get_world_size()
    held = [torch.arange(r * c, (r + 1) * c) for r in range(n)]
    return cp.ring_attention(q, k, v, held, causal=False)


def hoarding_ring_forward(q, k, v):  # the blocks relayed round the ring with messages, every one kept, then merged
    from course_lib import context_parallel as cp

    blocks = list(_ring_blocks(k, v))  # all N blocks held at once: a point-to-point all-gather, not a ring
    out, lse = cp.block_attention(q, blocks[0][0], blocks[0][1])
    for kv in blocks[1:]:
        out, lse = cp.merge_partials(out, lse, *cp.block_attention(q, kv[0], kv[1]))
    return out


def test_ring_forward_checker():
    wrong = {
        hoarding_ring_forward: "held 2 received K/V blocks it had not attended to yet (3 ranks, chunks of 3)",
        local_ring_forward: "sent no message",
        gathered_ring_forward: "dist.all_gather is not allowed",
        averaged_ring_forward: "elements wrong",
        relayed_then_sdpa_forward: "built a tensor spanning all 9 tokens (chunks of 3): you gathered the whole K/V",
        library_ring_forward: "this uses the course's own ring (section 3 shows it): write the ring yourself",
    }
    assert_checker(cp.check_ring_forward, SOLUTIONS["ring_forward"], wrong, stub=stub_ring_forward)


@pytest.mark.parametrize("nproc", world_sizes(2, 4))
def test_solutions_pass_at_other_world_sizes(nproc):
    cases = [
        (SOLUTIONS["ring_forward"], cp.check_ring_forward),
        (SOLUTIONS["heads_to_sequence"], cp.check_heads_to_sequence),
    ]
    assert judge(cases, nproc) == [["ok"] * nproc] * len(cases)


def stub_heads_to_sequence(x):
    raise NotImplementedError  # your code here


def broken_heads_to_sequence(x):  # the notebook's broken program: rows head by head, not chunk by chunk
    import torch.distributed as dist

    from course_lib import expert_parallel as ep

    n = dist.get_world_size()
    b, g, s, d = x.shape
    blocks = x.transpose(0, 1).reshape(n * g, b, s // n, d)
    return ep.all_to_all(blocks, [g] * n, [g] * n, None).transpose(0, 1)


def gathered_heads_to_sequence(x):
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)  # every head of every token on every rank
    c = x.shape[2] // dist.get_world_size()
    return torch.cat(parts, dim=1)[:, :, dist.get_rank() * c : (dist.get_rank() + 1) * c]


def everything_to_everyone(x):  # an all-to-all that sends every rank the whole tensor, then keeps its chunk
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    out = torch.empty((n, *x.shape), dtype=x.dtype)
    dist.all_to_all_single(out, x.expand(n, *x.shape).contiguous())
    c = x.shape[2] // n
    return torch.cat(list(out), dim=1)[:, :, rank * c : (rank + 1) * c]


def library_heads_to_sequence(x):  # the shortcut: the course's own inverse, which section 7's Ulysses calls
    from course_lib import context_parallel as cp

    return cp.heads_to_sequence(x)


def test_heads_to_sequence_checker():
    wrong = {
        broken_heads_to_sequence: "elements wrong",
        gathered_heads_to_sequence: "dist.all_gather is not allowed",
        everything_to_everyone: "send each rank only its own tokens of your heads, once",
        library_heads_to_sequence: "this uses the course's own Ulysses (section 7 calls it)",
    }
    assert_checker(cp.check_heads_to_sequence, SOLUTIONS["heads_to_sequence"], wrong, stub=stub_heads_to_sequence)
