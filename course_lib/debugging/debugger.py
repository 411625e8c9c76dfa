"""DistributedDebugger: a desync check (per-parameter checksums, MAX vs MIN) and hooks naming where NaN/Inf began."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """Position weights for a checksum: the same on every rank, different for every position."""
    return torch.linspace(1.0, 2.0, n, dtype=torch.float64, device=device)


def gradient_checksums(model: nn.Module) -> torch.Tensor:
    """One float64 number per parameter: the position-weighted sum of its gradient (0 when it has none).

    Position weights make a swap of two entries visible, which a plain sum would miss.
    """
    sums = []
    for p in model.parameters():
        if p.grad is None:
            sums.append(torch.zeros((), dtype=torch.float64, device=p.device))
        else:
            g = p.grad.detach().reshape(-1).to(torch.float64)
            sums.append((g * _weights(g.numel(), g.device)).sum())
    return torch.stack(sums)


def checksum_range(
    model: nn.Module, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(this rank's checksums, their MAX over the ranks, their MIN): a collective, call it on every rank.

    Every rank gets the same MAX and MIN, so every rank reaches the same verdict. A NaN checksum
    counts as +Inf: MAX/MIN may drop a NaN, they keep an Inf.
    """
    mine = gradient_checksums(model)
    mine = torch.where(mine.isnan(), math.inf, mine)
    high, low = mine.clone(), mine.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    return mine, high, low


class GradientDesyncError(RuntimeError):
    """Raised on every rank when the ranks' gradients are not identical."""


class NonFiniteError(FloatingPointError):
    """A NaN or Inf: raised where hooks first see it, and on all ranks by check_gradient_sync if any rank has one."""


@dataclass(frozen=True)
class NonFiniteEvent:
    rank: int
    phase: str  # "forward input", "forward output", "backward", "loss gradient", "gradient"
    where: str  # module or parameter name
    count: int  # non-finite elements in the offending tensor(s)

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.count} non-finite value(s) in the {self.phase} of '{self.where}'"


def _nonfinite(tensors: Any) -> int:
    """Number of NaN/Inf elements in a tensor or a (nested) tuple of tensors; None entries are ignored."""
    if isinstance(tensors, torch.Tensor):
        return int((~torch.isfinite(tensors)).sum()) if tensors.is_floating_point() else 0
    if isinstance(tensors, (tuple, list)):
        return sum(_nonfinite(t) for t in tensors)
    return 0


class DistributedDebugger:
    """Checks for a data-parallel model: are the ranks' gradients identical, and where did a NaN appear?"""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None):
        self.model = getattr(model, "module", model)  # the plain model inside DDP
        self.group = group
        self.rank = dist.get_rank(group)
        self.names = {p: n for n, p in self.model.named_parameters()}
        self.events: list[NonFiniteEvent] = []
        self._handles: list[RemovableHandle] = []
        self._raise = False

    # -- gradient desync --------------------------------------------------------------------------

    def check_gradient_sync(self, rtol: float = 0.0) -> int:
        """Raise GradientDesyncError on every rank unless all ranks hold the same gradients.

        Communication: two all-reduces (MAX and MIN) of one float64 per parameter tensor, instead of
        the gradients themselves. Every rank gets the same verdict, so no rank goes on alone into a
        collective the others skipped. With ``rtol > 0`` differences up to rtol * |checksum| pass
        (for reductions that are not bitwise reproducible). Returns the number of tensors checked.
        """
        mine, high, low = checksum_range(self.model, self.group)  # a NaN counts as Inf there
        broken = high.isinf() | low.isinf()
        if broken.any():
            first = list(self.names.values())[int(broken.nonzero()[0])]
            raise NonFiniteError(
                f"gradients hold NaN/Inf on some rank, first in '{first}': "
                f"watch_nonfinite() names the module where it started"
            )
        bad = (high - low) > rtol * torch.maximum(high.abs(), low.abs())
        if bad.any():
            # Rare path: gather everyone's checksums of the first bad tensor to name the ranks.
            first = int(bad.nonzero()[0])
            value = mine[first : first + 1].clone()
            everyone = [torch.zeros_like(value) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(everyone, value, group=self.group)
            values = [float(v) for v in everyone]
            majority = max(set(values), key=values.count)
            reference = "the majority"
            if 2 * values.count(majority) <= len(values):
                majority, reference = values[0], "rank 0"  # no majority: say who differs from rank 0
            odd = [r for r, v in enumerate(values) if v != majority]
            names = [n for n, b in zip(self.names.values(), bad.tolist()) if b]
            raise GradientDesyncError(
                f"gradients differ between ranks in {len(names)} of {len(bad)} parameter tensors, "
                f"first '{names[0]}': rank(s) {odd} differ from {reference}"
            )
        return len(mine)

    # -- NaN / Inf ----------------------------------------------------------------------------------

    def watch_nonfinite(self, raise_on_nonfinite: bool = False) -> DistributedDebugger:
        """Install hooks that record where a NaN/Inf first appears on this rank.

        Forward: a leaf module whose input is already non-finite (bad data, or an op outside any
        module) or whose output is non-finite from finite input (this module made it). Backward: the
        gradient a module computes for its input (tensor hooks, put on the inputs during forward), the
        gradient arriving at the model's output (from the loss), and each parameter's local gradient
        before DDP all-reduces it and spreads the NaN to every rank.
        """
        self._raise = raise_on_nonfinite
        for name, module in self.model.named_modules():
            if list(module.children()):
                continue  # leaves only: a parent's output is its last child's output
            name = name or type(module).__name__
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))
        self._handles.append(self.model.register_forward_hook(self._output_hook()))
        for p, name in self.names.items():
            if p.requires_grad:
                self._handles.append(p.register_hook(self._gradient_hook("gradient", name)))
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _record(self, phase: str, where: str, count: int) -> None:
        event = NonFiniteEvent(self.rank, phase, where, count)
        self.events.append(event)
        if self._raise and len(self.events) == 1:
            raise NonFiniteError(str(event))

    def _forward_hook(self, name: str):
        def hook(module, inputs, output):
            for t in inputs:  # gradient w.r.t. this input = what this module's backward produced
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._gradient_hook("backward", name))
            if self.events:
                return  # the first appearance is what matters; later ones follow from it
            if bad := _nonfinite(inputs):
                self._record("forward input", name, bad)  # it came in: bad data or an op outside modules
            elif bad := _nonfinite(output):
                self._record("forward output", name, bad)  # finite in, non-finite out: this module

        return hook

    def _output_hook(self):
        def hook(module, inputs, output):
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(self._gradient_hook("loss gradient", "model output"))

        return hook

    def _gradient_hook(self, phase: str, name: str):
        def hook(grad):
            if not self.events and (bad := _nonfinite(grad)):
                self._record(phase, name, bad)

        return hook

    def first_nonfinite(self) -> NonFiniteEvent | None:
        return self.events[0] if self.events else None

    def gather_nonfinite(self) -> list[NonFiniteEvent | None]:
        """Collective: every rank's first event, indexed by rank (None where a rank saw none)."""
        everyone: list[NonFiniteEvent | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, self.first_nonfinite(), group=self.group)
        return everyone

    def reset(self) -> None:
        self.events.clear()
