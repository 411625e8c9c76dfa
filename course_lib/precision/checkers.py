"""Notebook 04's exercise checkers: a found-inf check that agrees across ranks, and a GradScaler step with clipping."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from course_lib.exercises import ExerciseFailed, refusing
from course_lib.launch.runtime import rank_device
from course_lib.precision.loss_scaler import found_inf_across_ranks


def _found_inf_cases(world_size: int) -> list[tuple[str, dict[int, float]]]:
    """(description, {rank: bad value}) cases; ranks not listed hold finite gradients."""
    last = world_size - 1
    return [
        ("no overflow anywhere", {}),
        (f"inf on rank {last} only", {last: math.inf}),
        ("nan on rank 0 only", {0: math.nan}),
        ("-inf on every rank", {r: -math.inf for r in range(world_size)}),
        (f"inf on ranks 0 and {last}", {0: math.inf, last: math.inf}),
    ]


_WRITE_IT = "this calls the course's found_inf_across_ranks (section 3 shows it): combine the ranks' flags yourself"


def check_found_inf(fn: Callable[[list[torch.Tensor]], torch.Tensor]) -> None:
    """Runs on every rank: `fn(grads)` must return 1.0 on every rank iff some rank has a non-finite gradient."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    for description, bad in _found_inf_cases(world_size):
        grads = [torch.randn(4, 3).to(device), torch.randn(3).to(device)]
        if rank in bad:
            grads[1][2] = bad[rank]
        originals = [g.clone() for g in grads]
        expected = 1.0 if bad else 0.0
        wrong = None
        try:
            with refusing(found_inf_across_ranks, why=_WRITE_IT):
                got = fn(grads)
            got = got.detach().cpu() if isinstance(got, torch.Tensor) else torch.tensor(float(got))
            if got.numel() != 1 or float(got) != expected:
                shown = got.flatten().tolist() if got.numel() > 1 else float(got)
                wrong = f"case '{description}': expected {expected}, got {shown}"
            elif not all(torch.equal(g.nan_to_num(), o.nan_to_num()) for g, o in zip(grads, originals)):
                wrong = f"case '{description}': the check changed the gradients; it should only read them"
        except ExerciseFailed as refused:
            wrong = str(refused)
        except Exception as error:
            wrong = f"case '{description}': your function raised {type(error).__name__}: {error}"
        anyone_wrong = torch.tensor(1.0 if wrong else 0.0, device=device)
        dist.all_reduce(anyone_wrong, op=dist.ReduceOp.MAX)
        if wrong:
            raise ExerciseFailed(wrong)
        if anyone_wrong.item():
            return  # another rank's answer was wrong; that rank reports it


_WRITE_THE_STEP = (
    "this calls the course's amp_training_loop, the checker's own reference: write the step yourself, in the order "
    "that lets clipping see the true gradients"
)
CLIP_STEPS, CLIP_MAX_NORM = 4, 0.05  # small enough that every step is clipped at its true gradient norm


def check_clipped_scaler_step(train_step: Callable[..., object]) -> None:
    """Runs on every rank: `train_step(model, optimizer, scaler, x, y, max_norm)` on an FSDP2-sharded MLP."""
    from torch import nn

    from course_lib.compare import local_tensor
    from course_lib.models import MLP, shard_layers_then_root
    from course_lib.precision.train import amp_training_loop, rank_batches

    device = rank_device()
    batches = rank_batches(CLIP_STEPS, 48, device, seed=3)

    def setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
        model = shard_layers_then_root(MLP(seed=1).to(device))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        return model, optimizer, torch.amp.GradScaler(device.type, growth_interval=2)

    model, optimizer, scaler = setup()
    reference, reference_optimizer, reference_scaler = setup()
    amp_training_loop(reference, reference_optimizer, reference_scaler, batches, max_norm=CLIP_MAX_NORM)
    with refusing(amp_training_loop, why=_WRITE_THE_STEP):
        try:
            for x, y in batches:
                train_step(model, optimizer, scaler, x, y, CLIP_MAX_NORM)
        except Exception as error:
            raise ExerciseFailed(f"your train_step raised {type(error).__name__}: {error}") from None
    for (name, parameter), reference_parameter in zip(model.named_parameters(), reference.parameters()):
        got, expected = local_tensor(parameter.detach()), local_tensor(reference_parameter.detach())
        wrong = ~torch.isclose(got, expected, rtol=1e-4, atol=1e-6)
        if wrong.any():
            index = [int(i) for i in wrong.nonzero()[0]]
            raise ExerciseFailed(
                f"after {CLIP_STEPS} steps, {name} (this rank's shard) element {index} is "
                f"{got[tuple(index)].item():.6g}, expected {expected[tuple(index)].item():.6g}: the update "
                f"is not that of gradients clipped to norm {CLIP_MAX_NORM} at their true (unscaled) size"
            )
    if scaler.get_scale() != reference_scaler.get_scale():
        raise ExerciseFailed(
            f"after {CLIP_STEPS} steps the loss scale is {scaler.get_scale():g}, expected "
            f"{reference_scaler.get_scale():g}: the scaler never adjusted its scale"
        )
