"""Notebook 03's exercises, checked on every rank: shard a parameter and its Adam state; the fixed `reduce_gradient`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comms
from course_lib.exercises import ExerciseFailed, expect_equal
from course_lib.launch.runtime import rank_device


def _my_chunk(t: torch.Tensor) -> torch.Tensor:
    """This rank's chunk, ZeroModel's cut: flattened, torch.tensor_split into world_size chunks."""
    return torch.tensor_split(t.reshape(-1), dist.get_world_size())[dist.get_rank()]


def check_shard_with_adam_state(fn: Callable[..., Sequence[torch.Tensor]]) -> None:
    """fn(param, exp_avg, exp_avg_sq) -> this rank's tensor_split chunks; Adam on them must match the full step."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for shape in [(4 * n, 3), (2 * n + 1,), (5, 2 * n + 1), (n - 1 or 1, 1)]:
        gen = torch.Generator().manual_seed(sum(shape))
        full = nn.Parameter(torch.randn(shape, generator=gen))
        full.grad = torch.randn(shape, generator=gen)
        opt = torch.optim.Adam([full], lr=0.1)
        opt.step()  # Adam state now holds real numbers
        state = opt.state[full]
        got = fn(full.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone())
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            raise ExerciseFailed(f"shape {shape}: return three tensors (param, exp_avg, exp_avg_sq)")
        expected = [_my_chunk(t) for t in (full.detach(), state["exp_avg"], state["exp_avg_sq"])]
        for what, g, e in zip(("param", "exp_avg", "exp_avg_sq"), got, expected):
            expect_equal(f"full shape {shape}, {n} ranks: {what} shard", g, e, atol=0, rtol=0)
        # Adam is elementwise: stepping the shard with the shard of the state is the full step, sliced.
        shard = nn.Parameter(got[0].clone())
        shard_opt = torch.optim.Adam([shard], lr=0.1)
        shard_opt.state[shard] = {
            "step": state["step"].clone(),
            "exp_avg": got[1].clone(),
            "exp_avg_sq": got[2].clone(),
        }
        shard.grad = torch.tensor_split(full.grad.reshape(-1), n)[rank].clone()
        full.grad = full.grad.clone()
        opt.step()
        shard_opt.step()
        expect_equal(
            f"full shape {shape}: shard after one more Adam step",
            shard.detach(),
            torch.tensor_split(full.detach().reshape(-1), n)[rank],
            atol=1e-6,
            rtol=1e-5,
        )


def check_reduce_gradient(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """fn(full_grad) -> this rank's chunk of the averaged gradient; over half an all-reduce's bytes is refused."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for shape in [(4 * n, 3), (2 * n, 5), (2 * n + 1,), (5, 2 * n + 1)]:
        grads = [torch.randn(shape, generator=torch.Generator().manual_seed(100 * r + sum(shape))) for r in range(n)]
        mine = grads[rank].clone().to(rank_device())
        with comms.Recorder() as recorder:
            got = fn(mine)
        got = got.cpu() if isinstance(got, torch.Tensor) else got
        expected = _my_chunk(torch.stack(grads).mean(0))
        failure = None
        try:
            if not isinstance(got, torch.Tensor):
                raise ExerciseFailed(f"gradient of shape {shape}: return a tensor, got {type(got).__name__}")
            if got.dim() != 1:
                raise ExerciseFailed(
                    f"gradient of shape {shape}: return this rank's flat 1-D chunk, got {tuple(got.shape)}"
                )
            what = f"gradient of shape {shape} on {n} ranks, this rank's chunk of the average"
            expect_equal(what, got, expected, atol=1e-5)
            _expect_reduce_scatter_traffic(shape, recorder, mine.numel() * mine.element_size())
        except ExerciseFailed as wrong:
            failure = wrong
        # every rank stops at the same shape: a rank that went on alone would wait for the others forever
        wrong_somewhere = torch.tensor([float(failure is not None)], device=mine.device)
        dist.all_reduce(wrong_somewhere)
        if failure is not None:
            raise failure
        if wrong_somewhere.item():
            raise ExerciseFailed(f"gradient of shape {shape}: right on this rank, wrong on another")


def _expect_reduce_scatter_traffic(shape: tuple[int, ...], recorder: comms.Recorder, nbytes: int) -> None:
    n, sent = dist.get_world_size(), recorder.sent_bytes(comms.RING)
    reduce_scatter = comms.RING["reduce_scatter"](n) * nbytes
    if sent > 1.5 * reduce_scatter:
        why = (
            "dist.reduce of the whole gradient to each rank in turn sends all of it once per rank, where each rank "
            "needs only its chunk's sum"
            if recorder.counts().get("reduce")
            else "Reducing the whole gradient and keeping one chunk is DDP's traffic"
        )
        raise ExerciseFailed(
            f"gradient of shape {shape}: right numbers, but this rank sent {sent:,.0f} bytes of a {nbytes:,}-byte "
            f"gradient where a reduce-scatter sends {reduce_scatter:,.0f}. {why}; ZeRO-2 reduce-scatters, so each "
            "rank receives only its own chunk's sum"
        )
