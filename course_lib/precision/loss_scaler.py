"""Dynamic loss scaling from scratch: :class:`DynamicLossScaler`, what ``torch.amp.GradScaler`` does."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from course_lib.compare import local_tensor


def local_grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradients this rank holds: for FSDP2's DTensor gradients, the local shard."""
    grads = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                grads.append(local_tensor(param.grad))
    return grads


def found_inf_across_ranks(
    grads: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None, sync: bool = True
) -> torch.Tensor:
    """1.0 on every rank if any gradient on any rank is inf or nan, else 0.0.
    An overflow in one rank's shard must make every rank skip the step, or parameters and scales drift apart."""
    grads = list(grads)
    device = grads[0].device if grads else torch.device("cpu")
    found = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        if not torch.isfinite(grad).all():
            found.fill_(1.0)
            break
    if sync and dist.is_initialized():
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return found


class DynamicLossScaler:
    """The dynamic loss scaler of torch.amp.GradScaler, from scratch."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        group: dist.ProcessGroup | None = None,
        sync_found_inf: bool = True,
    ) -> None:
        # fp32 tensors, like GradScaler's, so the arithmetic rounds the same way
        self._scale = torch.tensor(init_scale, dtype=torch.float32)
        self._growth_tracker = 0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.group, self.sync_found_inf = group, sync_found_inf
        self._found_inf: torch.Tensor | None = None  # set by unscale_, consumed by update
        self.skipped_steps: list[int] = []
        self._steps = 0

    def get_scale(self) -> float:
        return self._scale.item()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale.to(loss.device)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self._found_inf is not None:
            raise RuntimeError("unscale_() was already called since the last update()")
        grads = local_grads(optimizer)
        # 1/scale in float64, then fp32: GradScaler does the same, to round identically
        inv_scale = self._scale.double().reciprocal().float()
        self._found_inf = found_inf_across_ranks(grads, self.group, self.sync_found_inf)
        with torch.no_grad():
            torch._foreach_mul_(grads, inv_scale.item())

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._found_inf is None:
            self.unscale_(optimizer)
        assert self._found_inf is not None  # unscale_ set it
        if self._found_inf.item() == 0.0:
            optimizer.step()
        else:
            self.skipped_steps.append(self._steps)  # inf/nan somewhere: the update would poison the weights

    def update(self) -> None:
        if self._found_inf is None:
            raise RuntimeError("update() needs a step() (or unscale_()) first")
        if self._found_inf.item() > 0:
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                grown = self._scale * self.growth_factor
                if torch.isfinite(grown):  # never grow into inf
                    self._scale = grown
                self._growth_tracker = 0
        self._found_inf = None
        self._steps += 1
