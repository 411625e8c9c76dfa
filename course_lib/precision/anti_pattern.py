"""The anti-pattern notebook 04 takes apart: a hand-managed loss scale next to GradScaler."""

from __future__ import annotations

import torch
from torch import nn

from course_lib.compare import grad_of


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
