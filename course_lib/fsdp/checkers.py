"""Notebook 03's exercise: shard a parameter and its Adam state the way ZeroModel does, checked on every rank."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from course_lib.exercises import ExerciseFailed, expect_equal


def solution_shard_with_adam_state(
    param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The reference answer: this rank's chunk of each tensor, flattened and cut by tensor_split."""
    rank, n = dist.get_rank(), dist.get_world_size()
    return tuple(torch.tensor_split(t.reshape(-1), n)[rank].clone() for t in (param, exp_avg, exp_avg_sq))


def check_shard_with_adam_state(fn: Callable[..., Sequence[torch.Tensor]]) -> None:
    """fn(param, exp_avg, exp_avg_sq) -> this rank's flat tensor_split chunk of each, for shapes
    whose element count is and is not divisible by N; then one Adam step on the shards must equal
    the same step on the full tensor, sliced."""
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
        expected = solution_shard_with_adam_state(full.detach(), state["exp_avg"], state["exp_avg_sq"])
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
