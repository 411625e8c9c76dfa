"""course_lib.tensor_parallel: from-scratch layers against the unsharded block and parallelize_module, the exercise."""

import pytest

from course_lib import tensor_parallel as tp
from course_lib.exercises import check
from course_lib.launcher import launch

QUIET = dict(write=lambda text, stream: None)

# One launch per world size: from scratch vs unsharded vs parallelize_module (TP and TP+SP), collective counts.
AGAINST_TORCH = r"""
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from course_lib import tensor_parallel as tp
from course_lib.models import TransformerBlock

def counts(mode):
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}

mesh = init_device_mesh("cpu", (world_size,))
results = []
for seed, shape in ((1, (2, 12, 48)), (2, (3, 24, 48))):
    torch.manual_seed(seed)
    x = torch.randn(*shape)
    full = TransformerBlock(seed=seed)
    x_full = x.clone().requires_grad_()
    y_full = full(x_full)
    y_full.pow(2).sum().backward()

    mine = tp.ParallelTransformerBlock(TransformerBlock(seed=seed))
    x_mine = x.clone().requires_grad_()
    tp.COMMS.clear()
    y_mine = mine(x_mine)
    y_mine.pow(2).sum().backward()

    theirs = tp.torch_parallel_block(mesh, seed=seed)
    x_theirs = x.clone().requires_grad_()
    with CommDebugMode() as fwd:
        y_theirs = theirs(x_theirs)
    with CommDebugMode() as bwd:
        y_theirs.pow(2).sum().backward()

    s = shape[1] // world_size
    sp = tp.torch_parallel_block(mesh, sequence_parallel=True, seed=seed)
    x_sp = x[:, rank * s:(rank + 1) * s].clone().requires_grad_()
    with CommDebugMode() as sp_fwd:
        y_sp = sp(x_sp)
    with CommDebugMode() as sp_bwd:
        y_sp.pow(2).sum().backward()

    full_grads = {n: p.grad for n, p in full.named_parameters()}
    theirs_local = {n: tp.local_tensor(p.grad) for n, p in theirs.named_parameters()}
    sp_full = tp.full_gradients(sp)
    err = tp.relative_error
    results.append(dict(
        scratch_vs_full=max(err(y_mine, y_full), err(x_mine.grad, x_full.grad),
                            max(err(p.grad, tp.shard_of(full_grads[n], n, rank, world_size))
                                for n, p in mine.named_parameters())),
        scratch_vs_torch=max(err(y_mine, y_theirs), err(x_mine.grad, x_theirs.grad),
                             max(err(p.grad, theirs_local[n]) for n, p in mine.named_parameters())),
        sp_vs_full=max(err(y_sp, y_full[:, rank * s:(rank + 1) * s]),
                       err(x_sp.grad, x_full.grad[:, rank * s:(rank + 1) * s]),
                       max(err(sp_full[n], full_grads[n]) for n in full_grads)),
        scratch_comms=dict(tp.COMMS), torch_fwd=counts(fwd), torch_bwd=counts(bwd),
        sp_fwd=counts(sp_fwd), sp_bwd=counts(sp_bwd),
        params=(tp.param_bytes_per_rank(mine), tp.param_bytes_per_rank(theirs), tp.param_bytes_per_rank(full)),
    ))
"""


@pytest.mark.parametrize("n", [2, 3, 4])
def test_from_scratch_equals_unsharded_and_parallelize_module(n):
    run = launch(AGAINST_TORCH, n, backend="gloo", out=["results"], **QUIET)
    for rank, per_rank in enumerate(run.values["results"]):
        for r in per_rank:
            assert r["scratch_vs_full"] < 1e-5, (n, rank, r)
            assert r["scratch_vs_torch"] < 1e-5, (n, rank, r)
            assert r["sp_vs_full"] < 1e-5, (n, rank, r)
            assert r["scratch_comms"] == {"forward all_reduce": 2, "backward all_reduce": 2}
            assert r["torch_fwd"] == {"all_reduce": 2} and r["torch_bwd"] == {"all_reduce": 4}
            assert r["sp_fwd"] == r["sp_bwd"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
            mine, theirs, full = r["params"]
            replicated = 4 * 48 * 4 + 2 * 48 * 4  # two LayerNorms (weight+bias), o and down biases
            assert mine == theirs == replicated + (full - replicated) // n


def test_sizes_that_do_not_divide_fail_clearly():
    with pytest.raises(ValueError, match=r"12 does not split evenly over 5 ranks.*\[1, 2, 3, 4, 6, 12\]"):
        tp.shard_size(12, 5, "attention heads")
    assert tp.shard_size(192, 4, "hidden") == 48
    body = r"""
from course_lib import tensor_parallel as tp
from course_lib.models import TransformerBlock
messages = []
for kwargs in (dict(d_model=48, n_heads=3, d_ff=192), dict(d_model=48, n_heads=12, d_ff=191)):
    try:
        tp.ParallelTransformerBlock(TransformerBlock(**kwargs))
    except ValueError as error:
        messages.append(str(error))
"""
    run = launch(body, 2, backend="gloo", out=["messages"], **QUIET)
    heads, hidden = run.values["messages"][0]
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


def stub_split_backward(grad_slice):
    raise NotImplementedError


def test_exercise_checker(capsys):
    checker = "course_lib.tensor_parallel:check_split_backward"
    assert check(stub_split_backward, checker, nproc=2, backend="gloo") is None
    assert "not attempted yet" in capsys.readouterr().out
    assert check(tp.split_backward, checker, nproc=3, backend="gloo") is True  # the library's reference
    for wrong, says in (
        (wrong_passthrough, "whole input's shape"),
        (wrong_pad_own_slice, "expected"),
        (wrong_reversed_order, "is computed on rank"),
    ):
        assert check(wrong, checker, nproc=2, backend="gloo") is False, wrong.__name__
        out = capsys.readouterr().out
        assert "rank " in out and says in out, out
