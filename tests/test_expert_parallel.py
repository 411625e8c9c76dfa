"""course_lib.expert_parallel: the router (top-k, capacity, dropped assignments, load-balancing loss), the MoE
against a token-by-token loop, expert parallelism on 2-4 gloo ranks against the MoE on one process (outputs and
gradients, ours and torch's all-to-all), the bytes against the formula, EP x DP on a 2 x 2 mesh, the load balance
over training, and the exercise's checker against its solution and wrong answers.

The multi-rank programs are functions of this file sent to the ranks as source (tests.rank_programs.run_source), each
self-contained (imports inside).
"""

import re
import runpy
import tempfile
from pathlib import Path

import pytest
import torch

from course_lib import expert_parallel as ep
from tests.rank_programs import assert_checker, judge, run_source, world_sizes

# The prediction reads the notebook's `routed` (each rank's assignments per expert): a copy of the solutions defines
# it first, as the notebook has, so the ranks can run the file too (tests.rank_programs.judge runs it there).
NOTEBOOK_NAMES = """import torch
from course_lib import expert_parallel as ep

routed = [ep.TopKRouter(16, 12, 2, 1.0)(ep.token_batch(32, 16, 0)).routed_per_expert()]  # rank 0's, notebook 11
"""
SOLUTIONS_FILE = Path(tempfile.mkdtemp(prefix="solutions-11-")) / "11_expert_parallel.py"
SOLUTIONS_FILE.write_text(
    NOTEBOOK_NAMES + (Path(__file__).parent.parent / "notebooks" / "solutions" / "11_expert_parallel.py").read_text()
)
SOLUTIONS = runpy.run_path(str(SOLUTIONS_FILE))


def test_predicted_dropped_is_what_the_router_drops():
    assert SOLUTIONS["predicted_dropped"] == ep.TopKRouter(16, 12, 2, 1.5)(ep.token_batch(32, 16, 0)).dropped()


# ---- one process -------------------------------------------------------------------------------------


def test_capacity_and_priority():
    assert ep.capacity(32, 12, 2, 1.0) == 6
    assert ep.capacity(32, 8, 2, 1.25) == 10  # exactly 10, not 11
    experts = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 1]])  # expert 0: first choice of tokens 0, 1, 3
    kept = ep.keep_within_capacity(experts, 3, cap=2)
    # expert 0 takes tokens 0 and 1 (first choices): token 3's first and token 2's second choice drop; expert 1
    # takes token 2 (first choice) before token 0 (second choice), then is full: token 3's second choice drops
    assert kept.tolist() == [[True, True], [True, True], [True, False], [False, False]]
    assert ep.dropped(torch.bincount(experts.flatten(), minlength=3), 2) == int((~kept).sum()) == 3


def test_load_balancing_loss_and_balanced_batch():
    probs = torch.full((24, 12), 1 / 12)
    experts = torch.arange(48).view(24, 2) % 12
    assert ep.load_balancing_loss(probs, experts).item() == pytest.approx(1.0)
    skewed = torch.zeros(24, 2, dtype=torch.long)
    skewed[:, 1] = 1
    assert ep.load_balancing_loss(probs, skewed).item() == pytest.approx(1.0)  # uniform P: the loss cannot see
    peaked = torch.softmax(torch.tensor([5.0] + [0.0] * 11).expand(24, 12), -1)
    assert ep.load_balancing_loss(peaked, skewed).item() > 5
    router = ep.TopKRouter(16, 12, top_k=2, capacity_factor=1.0)
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(12, 16))
    routing = router(ep.balanced_batch(48, 12, 16))
    assert routing.routed_per_expert().tolist() == [8] * 12 and routing.dropped() == 0
    assert ep.imbalance(routing.routed_per_expert()) == 1.0
    assert ep.all_to_all_bytes_balanced(48, 2, 4, 16, 4) == 48 * 2 * 3 / 4 * 16 * 4
    with pytest.raises(ValueError, match="top_k"):
        ep.TopKRouter(16, 4, top_k=5)


def test_moe_equals_a_loop_over_tokens():
    torch.manual_seed(0)
    moe = ep.MoE(ep.TopKRouter(8, 6, top_k=2, capacity_factor=0.75), ep.make_experts(6, 8, 16))
    x = torch.randn(20, 8) + 1.0
    y, routing = moe(x)
    assert routing.dropped() > 0
    expected = torch.zeros_like(x)
    for t in range(20):
        for i in range(2):
            if routing.kept[t, i]:
                e = int(routing.experts[t, i])
                expected[t] += routing.gates[t, i] * moe.experts[e](x[t : t + 1])[0]
    assert torch.allclose(y, expected, atol=1e-6)


# ---- on the ranks ------------------------------------------------------------------------------------


def expert_parallel_against_one_process(rank, world_size):
    import torch
    import torch.distributed as dist

    from course_lib import comms, compare
    from course_lib import expert_parallel as ep

    n_experts, d, tokens = 12, 16, 32
    reference = ep.MoE(ep.TopKRouter(d, n_experts, 2, 1.0), ep.make_experts(n_experts, d, 32))
    batches = [ep.token_batch(tokens, d, j).requires_grad_() for j in range(world_size)]
    total = 0
    for j, batch in enumerate(batches):
        y_j, routing_j = reference(batch)
        total = total + y_j.pow(2).sum() + 0.1 * routing_j.aux_loss
        if j == rank:
            y_reference = y_j.detach()
    total.backward()
    grads = dict(reference.named_parameters())
    result = {}
    for exchange in (ep.all_to_all, ep.torch_all_to_all):
        moe = ep.ExpertParallelMoE(
            ep.TopKRouter(d, n_experts, 2, 1.0), ep.make_experts(n_experts, d, 32), exchange=exchange
        )
        x = ep.token_batch(tokens, d, rank).requires_grad_()
        with comms.Recorder() as rec:
            y, routing = moe(x)
            (y.pow(2).sum() + 0.1 * routing.aux_loss).backward()
        sent = ep.all_to_all_bytes_by_kind(rec)
        for p in moe.router.parameters():
            dist.all_reduce(p.grad)
        splits = moe.last["send_splits"].tolist()
        result[exchange.__name__] = dict(
            output=compare.relative_error(y, y_reference),
            input_grad=compare.relative_error(x.grad, batches[rank].grad),
            grads=max(
                compare.relative_error(p.grad, grads[moe.global_name(n)].grad) for n, p in moe.named_parameters()
            ),
            dispatch=sent["dispatch"] == sum(r for j, r in enumerate(splits) if j != rank) * d * 4,
            bound=sent["dispatch"] <= ep.all_to_all_bytes_bound(routing.capacity, n_experts, world_size, d, 4),
            # the gradients go back the way the rows came
            backward=sent["combine backward"] == sent["dispatch"] and sent["dispatch backward"] == sent["combine"],
        )
    balanced = ep.ExpertParallelMoE(ep.TopKRouter(d, n_experts, 2, 1.0), ep.make_experts(n_experts, d, 32))
    with torch.no_grad():
        balanced.router.gate.weight.copy_(torch.eye(n_experts, d))
    with comms.Recorder() as rec:
        balanced(ep.balanced_batch(48, n_experts, d))
    result["balanced"] = ep.all_to_all_bytes_by_kind(rec)
    return result


@pytest.mark.parametrize("n", world_sizes(2, 3, 4))
def test_expert_parallel_equals_one_process(n):
    for rank, result in enumerate(run_source(expert_parallel_against_one_process, n)):
        for name in ("all_to_all", "torch_all_to_all"):
            r = result[name]
            assert max(r["output"], r["input_grad"], r["grads"]) < 1e-5, (n, rank, name, r)
            assert r["dispatch"] and r["bound"] and r["backward"], (n, rank, name, r)
        expected = ep.all_to_all_bytes_balanced(48, 2, n, 16, 4)
        assert result["balanced"]["dispatch"] == result["balanced"]["combine"] == expected


def ep_by_dp(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from course_lib import compare
    from course_lib import expert_parallel as ep

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    ep_group, dp_group = mesh["ep"].get_group(), mesh["dp"].get_group()
    moe = ep.ExpertParallelMoE(ep.TopKRouter(16, 12, 2, 1.0), ep.make_experts(12, 16, 32), group=ep_group)
    y, routing = moe(ep.token_batch(32, 16, rank))
    (y.pow(2).sum() + 0.1 * routing.aux_loss).backward()
    for p in moe.router.parameters():
        dist.all_reduce(p.grad)
    for p in moe.experts.parameters():
        dist.all_reduce(p.grad, group=dp_group)
    reference = ep.MoE(ep.TopKRouter(16, 12, 2, 1.0), ep.make_experts(12, 16, 32))
    total = 0
    for j in range(world_size):
        y_j, routing_j = reference(ep.token_batch(32, 16, j))
        total = total + y_j.pow(2).sum() + 0.1 * routing_j.aux_loss
        if j == rank:
            y_reference = y_j.detach()
    total.backward()
    grads = dict(reference.named_parameters())
    return dict(
        output=compare.relative_error(y, y_reference),
        grads=max(compare.relative_error(p.grad, grads[moe.global_name(n)].grad) for n, p in moe.named_parameters()),
        first=moe.first,
    )


def test_ep_by_dp_on_a_2d_mesh():
    results = run_source(ep_by_dp, 4)
    assert [r["first"] for r in results] == [0, 6, 0, 6]
    for r in results:
        assert max(r["output"], r["grads"]) < 1e-5, r


def load_balance(rank, world_size):
    from course_lib import expert_parallel as ep

    late = {}
    for weight in (0.0, 0.1):
        moe = ep.ExpertParallelMoE(ep.TopKRouter(16, 12, 2, 1.25), ep.make_experts(12, 16, 32))
        history = ep.train_load_balance(moe, steps=30, aux_weight=weight, tokens=64)
        late[weight] = [sum(h[key] for h in history[-10:]) / 10 for key in ("imbalance", "dropped")]
        late[f"first {weight}"] = history[0]["imbalance"]
    return late


def test_balancing_loss_spreads_the_tokens():
    late = run_source(load_balance, 2)[0]
    assert late["first 0.0"] > 2
    assert late[0.1][0] < 0.75 * late[0.0][0] and late[0.1][1] < 0.5 * late[0.0][1], late


# ---- the exercise ------------------------------------------------------------------------------------


def stub_dispatch(tokens, expert_of_token, n_experts):
    raise NotImplementedError  # your code here


def broken_dispatch(tokens, expert_of_token, n_experts):
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    destination = expert_of_token // (n_experts // n)
    send_counts = torch.bincount(destination, minlength=n)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    rows = tokens.new_empty((sum(recv), tokens.shape[1]))
    dist.all_to_all_single(rows, tokens, recv, send)  # the notebook's bug: rows not sorted by destination
    experts = expert_of_token.new_empty(sum(recv))
    dist.all_to_all_single(experts, expert_of_token, recv, send)
    return rows, experts


def local_dispatch(tokens, expert_of_token, n_experts):
    import torch.distributed as dist

    mine = expert_of_token // (n_experts // dist.get_world_size()) == dist.get_rank()
    return tokens[mine], expert_of_token[mine]  # keeps its own tokens, never receives the others'


def gathered_dispatch(tokens, expert_of_token, n_experts):
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (tokens, expert_of_token))
    raise AssertionError("unreachable: all_gather_object is switched off")


def rows_without_experts(tokens, expert_of_token, n_experts):
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    destination = expert_of_token // (n_experts // n)
    order = torch.argsort(destination, stable=True)
    send_counts = torch.bincount(destination, minlength=n)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    rows = tokens.new_empty((int(recv_counts.sum()), tokens.shape[1]))
    dist.all_to_all_single(rows, tokens[order], recv_counts.tolist(), send_counts.tolist())
    return rows, expert_of_token[order][: len(rows)]  # its own experts' ids, not those of the rows received


def everywhere_dispatch(tokens, expert_of_token, n_experts):  # every token to every rank, filtered there
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    counts = torch.full((n,), len(tokens), dtype=torch.long)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts)
    rows = tokens.new_empty((int(received.sum()), tokens.shape[1]))
    dist.all_to_all_single(rows, tokens.repeat(n, 1), received.tolist(), counts.tolist())
    experts = expert_of_token.new_empty(int(received.sum()))
    dist.all_to_all_single(experts, expert_of_token.repeat(n), received.tolist(), counts.tolist())
    mine = experts // (n_experts // n) == rank
    return rows[mine], experts[mine]


def test_dispatch_checker():
    wrong = {
        everywhere_dispatch: "send each token only to the rank of its expert (not to every rank, to be filtered there)",
        broken_dispatch: "rows belong to other ranks' experts",
        local_dispatch: "never called dist.all_to_all_single",
        gathered_dispatch: "dist.all_gather_object is not allowed",
        # its own ids, not the rows': a count that differs from the rows', or (when each rank happened to receive as
        # many rows as it holds, as the checker's random tokens once made it) ids of other ranks' experts
        rows_without_experts: re.compile(r"rank \d: \d+ rows but \d+ experts|rows belong to other ranks' experts"),
    }
    assert_checker(ep.check_dispatch, SOLUTIONS["dispatch"], wrong, stub=stub_dispatch)


@pytest.mark.parametrize("nproc", world_sizes(2, 4))
def test_solutions_pass_at_other_world_sizes(nproc):
    cases = [(SOLUTIONS["dispatch"], ep.check_dispatch), (SOLUTIONS["capacity_mask"], ep.check_capacity_mask)]
    assert judge(cases, nproc) == [["ok"] * nproc] * len(cases)


def stub_capacity_mask(experts, n_experts, cap):
    raise NotImplementedError  # your code here


def token_order_mask(experts, n_experts, cap):  # queues token by token: a second choice can push out a first
    import torch

    kept, taken = torch.zeros(experts.shape, dtype=torch.bool), [0] * n_experts
    for token in range(experts.shape[0]):
        for choice in range(experts.shape[1]):
            kept[token, choice] = taken[int(experts[token, choice])] < cap
            taken[int(experts[token, choice])] += 1
    return kept


def library_capacity_mask(experts, n_experts, cap):  # the shortcut: the router's own cut
    from course_lib import expert_parallel as ep

    return ep.keep_within_capacity(experts, n_experts, cap)


def test_capacity_mask_checker():
    wrong = {
        token_order_mask: "elements wrong",
        library_capacity_mask: "this uses the course's own capacity cut (the router calls it)",
    }
    assert_checker(ep.check_capacity_mask, SOLUTIONS["capacity_mask"], wrong, stub=stub_capacity_mask)
