"""course_lib.tensor_parallel: from-scratch layers against the unsharded block and parallelize_module, the exercises."""

import runpy
from pathlib import Path

import pytest

from course_lib import tensor_parallel as tp
from course_lib.models import TransformerBlock
from tests.rank_programs import assert_checker, judge, run, run_source, world_sizes
from tests.rank_programs import tensor_parallel as rank_programs

SOLUTION_FILE = str(Path(__file__).parent.parent / "notebooks" / "solutions" / "08_tensor_parallel.py")
SOLUTIONS = runpy.run_path(SOLUTION_FILE, init_globals={"NPROC": 2, "TransformerBlock": TransformerBlock})


@pytest.mark.parametrize("n", world_sizes(2, 3, 4))
def test_from_scratch_equals_unsharded_and_parallelize_module(n):
    for rank, per_rank in enumerate(run(rank_programs.against_torch, n)):
        for r in per_rank["results"]:
            assert r["scratch_vs_full"] < 1e-5, (n, rank, r)
            assert r["scratch_vs_torch"] < 1e-5, (n, rank, r)
            assert r["sp_vs_full"] < 1e-5, (n, rank, r)
            assert r["shared_vs_full"] < 1e-5, (n, rank, r)
            assert r["scratch_fwd"] == r["scratch_bwd"] == {"all_reduce": 2}
            assert r["scratch_groups"] == {tuple(range(n))}  # on the whole tensor-parallel group
            assert r["torch_fwd"] == {"all_reduce": 2} and r["torch_bwd"] == {"all_reduce": 4}
            # torchtitan's layout (separate q/k/v reading one DTensor): one all-reduce per attention and per MLP
            assert r["shared_fwd"] == r["shared_bwd"] == {"all_reduce": 2}
            assert r["sp_fwd"] == r["sp_bwd"] == {"all_gather": 2, "reduce_scatter": 2}
            mine, theirs, full = r["params"]
            replicated = 4 * 48 * 4 + 2 * 48 * 4  # two LayerNorms (weight+bias), o and down biases
            assert mine == theirs == replicated + (full - replicated) // n


def test_sizes_that_do_not_divide_fail_clearly():
    with pytest.raises(ValueError, match=r"12 does not split evenly over 5 ranks.*\[1, 2, 3, 4, 6, 12\]"):
        tp.shard_size(12, 5, "attention heads")
    assert tp.shard_size(192, 4, "hidden") == 48
    heads, hidden = run(rank_programs.refusals, 2)[0]["messages"]
    assert "attention heads: 3 does not split evenly over 2 ranks" in heads and "[1, 3]" in heads
    assert "191 does not split evenly over 2 ranks" in hidden and "output features of a column-parallel" in hidden


def wrong_passthrough(grad_slice):
    return grad_slice  # forgets to gather: wrong shape


def wrong_pad_own_slice(grad_slice):
    import torch
    import torch.distributed as dist

    n, r = dist.get_world_size(), dist.get_rank()
    out = torch.zeros(*grad_slice.shape[:-1], grad_slice.shape[-1] * n)
    out[..., r * grad_slice.shape[-1] : (r + 1) * grad_slice.shape[-1]] = grad_slice  # other ranks' parts missing
    return out


def wrong_reversed_order(grad_slice):
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(grad_slice) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, grad_slice.contiguous())
    return torch.cat(parts[::-1], dim=-1)


def wrong_the_course_gather(grad_slice):  # the shortcut: the course's all-gather of slices, called
    from course_lib.tensor_parallel import operators

    return operators.gather_last_dim(grad_slice)


def wrong_zero_padded_all_reduce(grad_slice):  # right numbers, twice an all-gather's bytes
    import torch
    import torch.distributed as dist

    n, r, width = dist.get_world_size(), dist.get_rank(), grad_slice.shape[-1]
    out = torch.zeros(*grad_slice.shape[:-1], width * n)
    out[..., r * width : (r + 1) * width] = grad_slice
    dist.all_reduce(out)
    return out


def wrong_autograd_all_gather(grad_slice):  # the shortcut: torch's ready-made autograd gather
    import torch
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(grad_slice.contiguous()), dim=-1)


def stub_split_backward(grad_slice):
    raise NotImplementedError


def test_split_backward_checker():
    wrong = {
        wrong_passthrough: "whole input's shape",
        wrong_pad_own_slice: "got 0 (72 of 108 elements wrong)",  # only its own features' gradient
        wrong_reversed_order: "is computed on rank",
        wrong_the_course_gather: "this calls the course's own gather (gather_last_dim)",
        # 3 ranks: the gradient is 3 x 36 floats (432 bytes); an all-gather sends 2/3 of it, an all-reduce twice that
        wrong_zero_padded_all_reduce: "this rank sent 576 bytes where an all-gather of the slices' gradients sends 288",
        wrong_autograd_all_gather: "this calls torch.distributed.nn.functional.all_gather",
    }
    assert_checker(tp.check_split_backward, SOLUTIONS["split_backward"], wrong, stub=stub_split_backward)


def broken_row_parallel_forward(x_slice, weight_slice, bias):
    import torch.distributed as dist

    y = x_slice @ weight_slice.T + bias  # the notebook's broken version: the bias on every rank
    dist.all_reduce(y)
    return y


def local_row_parallel_forward(x_slice, weight_slice, bias):
    return x_slice @ weight_slice.T + bias  # skips the all-reduce: only this rank's partial product


def no_bias_row_parallel_forward(x_slice, weight_slice, bias):
    import torch.distributed as dist

    y = x_slice @ weight_slice.T
    dist.all_reduce(y)
    return y


def averaged_row_parallel_forward(x_slice, weight_slice, bias):
    import torch.distributed as dist

    y = x_slice @ weight_slice.T + bias
    dist.all_reduce(y)
    return y / dist.get_world_size()  # averages the partial products instead of summing them


def gathered_row_parallel_forward(x_slice, weight_slice, bias):
    import torch
    import torch.distributed as dist

    def gather(t):  # every rank's slice of the feature dimension, side by side
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=1)

    return gather(x_slice) @ gather(weight_slice).T + bias  # the whole layer on every rank: right, no split


def stub_row_parallel_forward(x_slice, weight_slice, bias):
    raise NotImplementedError  # your code here


def test_row_parallel_forward_checker():
    wrong = {
        broken_row_parallel_forward: "off by 2 times its column's bias",
        local_row_parallel_forward: "elements wrong",
        no_bias_row_parallel_forward: "off by -1 times its column's bias",
        averaged_row_parallel_forward: "(18 of 18 elements wrong)",
        # 3 ranks, 3 rows: gathering x (3 x 4 floats a slice) and W (6 x 4) sends 2/3 of 3 x (48 + 96) = 288 bytes,
        # where a ring all-reduce of y (3 x 6 floats) sends 2 x 2/3 x 72 = 96
        gathered_row_parallel_forward: "right numbers, but this rank sent 288 bytes where one all-reduce of the "
        "partial output sends 96",
    }
    assert_checker(
        tp.check_row_parallel_forward, SOLUTIONS["row_parallel_forward"], wrong, stub=stub_row_parallel_forward
    )


@pytest.mark.parametrize("nproc", world_sizes(2, 4))
def test_solutions_pass_at_other_world_sizes(nproc):
    cases = [
        (SOLUTIONS["split_backward"], tp.check_split_backward),
        (SOLUTIONS["row_parallel_forward"], tp.check_row_parallel_forward),
    ]
    assert judge(cases, nproc) == [["ok"] * nproc] * len(cases)


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_parameter_bytes_prediction(n, capsys):
    from course_lib.exercises import check_prediction

    full = TransformerBlock()
    replicated = sum(
        p.numel() * 4
        for name, p in full.named_parameters()
        if name.startswith("norm") or name in ("attention.o.bias", "feed_forward.down.bias")
    )
    total = sum(p.numel() * 4 for p in full.parameters())
    measured = replicated + (total - replicated) // n  # what the notebook measures (asserted there)
    notebook = {"NPROC": n, "TransformerBlock": TransformerBlock}  # the names the notebook defines above the prompt
    predicted = runpy.run_path(SOLUTION_FILE, init_globals=notebook)["predicted_parameter_bytes"]
    assert check_prediction("bytes", predicted, measured, rtol=0.002) is True
    for wrong in (total / n, total, (total - replicated) / n, replicated * n + (total - replicated) / n):
        assert check_prediction("bytes", wrong, measured, rtol=0.002) is False, (n, wrong)
    assert "too" in capsys.readouterr().out


def test_checkers_build_layer_and_input_on_the_ranks_device(monkeypatch):
    """On a GPU rank the layer and its input live on its GPU (meta stands in for it), where NCCL can reduce them."""
    from course_lib.tensor_parallel import checkers
    from tests.device_fakes import META, Reached, on_meta, recorder

    on_meta(monkeypatch, checkers)
    for checker, arguments in ((checkers.check_split_backward, 1), (checkers.check_row_parallel_forward, 3)):
        devices: list = []
        with pytest.raises(Reached):
            checker(recorder(devices))
        assert devices == [META] * arguments, checker.__name__


def chunked_against_plain(rank, world_size):
    import torch

    from course_lib import comms
    from course_lib import tensor_parallel as tp

    torch.manual_seed(rank)
    x, weight = torch.randn(5, 16, dtype=torch.float64), torch.randn(7, 16, dtype=torch.float64)
    with comms.Recorder() as chunked_calls:
        chunked = tp.all_gather_matmul(x, weight)
    with comms.Recorder() as plain_calls:
        plain = tp.gather_then_matmul(x, weight)
    return {
        "equal": torch.equal(chunked, plain),
        "counts": (chunked_calls.counts(), plain_calls.counts()),
        "wire": (chunked_calls.wire_bytes(), plain_calls.sent_bytes()),
    }


@pytest.mark.parametrize("n", world_sizes(2, 3))
def test_async_tp_chunks_give_the_gathered_product_and_move_the_gathers_bytes(n):
    for result in run_source(chunked_against_plain, n):
        assert result["equal"]  # same chunks, same matmuls: bit for bit
        assert list(result["counts"]) == [{"all_gather": 1}] * 2
        assert list(result["wire"]) == [(n - 1) * 5 * 16 * 8] * 2  # (N-1)/N of the gathered input, each way
