"""Rank programs of tests/test_tensor_parallel.py: from scratch against the unsharded block and parallelize_module."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from course_lib import comms, compare
from course_lib import tensor_parallel as tp
from course_lib.models import TransformerBlock


def against_torch(rank: int, world_size: int) -> dict:
    """From scratch vs unsharded vs parallelize_module (TP and TP+SP), with collective counts, for two inputs."""
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
        with comms.Recorder() as scratch:
            y_mine = mine(x_mine)
            y_mine.pow(2).sum().backward()

        theirs = tp.torch_parallel_block(mesh, seed=seed)
        x_theirs = x.clone().requires_grad_()
        with comms.Recorder() as torch_rec:
            y_theirs = theirs(x_theirs)
            y_theirs.pow(2).sum().backward()

        # torchtitan's layout: the attention's and MLP's input one DTensor that q, k, v (up) share
        shared = tp.torch_parallel_block(mesh, shared_input=True, seed=seed)
        x_shared = x.clone().requires_grad_()
        with comms.Recorder() as shared_rec:
            y_shared = shared(x_shared)
            y_shared.pow(2).sum().backward()

        s = shape[1] // world_size
        mine_rows = slice(rank * s, (rank + 1) * s)
        sp = tp.torch_parallel_block(mesh, sequence_parallel=True, seed=seed)
        x_sp = x[:, mine_rows].clone().requires_grad_()
        with comms.Recorder() as sp_rec:
            y_sp = sp(x_sp)
            y_sp.pow(2).sum().backward()

        full_grads = compare.full_gradients(full)
        theirs_local = {n: compare.local_tensor(p.grad) for n, p in theirs.named_parameters() if p.grad is not None}
        mine_grads = compare.full_gradients(mine)
        sp_full = compare.full_gradients(sp)
        err = compare.relative_error
        assert x_mine.grad is not None and x_full.grad is not None and x_theirs.grad is not None
        assert x_sp.grad is not None and x_shared.grad is not None
        shared_full = compare.full_gradients(shared)
        results.append(
            dict(
                scratch_vs_full=max(
                    err(y_mine, y_full),
                    err(x_mine.grad, x_full.grad),
                    max(err(g, tp.shard_of(full_grads[n], n, rank, world_size)) for n, g in mine_grads.items()),
                ),
                scratch_vs_torch=max(
                    err(y_mine, y_theirs),
                    err(x_mine.grad, x_theirs.grad),
                    max(err(g, theirs_local[n]) for n, g in mine_grads.items()),
                ),
                sp_vs_full=max(
                    err(y_sp, y_full[:, mine_rows]),
                    err(x_sp.grad, x_full.grad[:, mine_rows]),
                    max(err(sp_full[n], full_grads[n]) for n in full_grads),
                ),
                shared_vs_full=max(
                    err(y_shared, y_full),
                    err(x_shared.grad, x_full.grad),
                    max(err(shared_full[n], full_grads[n]) for n in full_grads),
                ),
                scratch_fwd=scratch.counts("forward"),
                scratch_bwd=scratch.counts("backward"),
                scratch_groups={c.group for c in scratch.calls},
                torch_fwd=torch_rec.counts("forward"),
                torch_bwd=torch_rec.counts("backward"),
                sp_fwd=sp_rec.counts("forward"),
                sp_bwd=sp_rec.counts("backward"),
                shared_fwd=shared_rec.counts("forward"),
                shared_bwd=shared_rec.counts("backward"),
                params=tuple(compare.bytes_per_rank(block.parameters()) for block in (mine, theirs, full)),
            )
        )
    return {"results": results}


def refusals(rank: int, world_size: int) -> dict:
    """The messages of blocks whose heads or hidden units do not split over the ranks."""
    messages = []
    for kwargs in (dict(d_model=48, n_heads=3, d_ff=192), dict(d_model=48, n_heads=12, d_ff=191)):
        try:
            tp.ParallelTransformerBlock(TransformerBlock(**kwargs))
        except ValueError as error:
            messages.append(str(error))
    return {"messages": messages}
