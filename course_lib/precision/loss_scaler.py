"""Dynamic loss scaling from scratch (what GradScaler does), and notebook 04's anti-pattern: a hand-managed scale."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from course_lib.compare import grad_of, local_tensor


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
    """1.0 on every rank if any rank has an inf/nan gradient, so all skip the step and parameters don't drift."""
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


class MixedPrecisionTrainer:
    """ANTI-PATTERN, do not copy: keeps its own loss scale *and* uses a GradScaler.

    Three things go wrong: (1) the loss is multiplied by both scales, but GradScaler divides out
    only its own, so the optimizer sees gradients `loss_scale` times too large; (2) clipping runs
    on those scaled gradients, so the clip threshold means nothing; (3) `update(new_scale=...)`
    overwrites GradScaler's scale every step, throwing away its backoff after an overflow.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float = 1.0):
        self.model, self.optimizer, self.max_norm = model, optimizer, max_norm
        self.scaler = torch.amp.GradScaler("cpu")
        self.loss_scale = 2.0**8  # "our own" scale, doubled on success, halved on overflow

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(self.model(x), y)
        self.scaler.scale(loss * self.loss_scale).backward()  # (1) scaled twice
        nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)  # (2) clips scaled gradients
        finite = all(torch.isfinite(grad_of(p)).all() for p in self.model.parameters())
        self.loss_scale = self.loss_scale * 2 if finite else self.loss_scale / 2
        self.scaler.step(self.optimizer)
        self.scaler.update(new_scale=2.0**16)  # (3) overrides the backoff
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()
