"""ZeRO 0-3 from scratch (notebook 01's rings) and FSDP's collectives per step (the planner's too); compile and FSDP2
in both orders: FSDP2's hooks are dynamo-disabled."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from course_lib.collectives import chunk_sizes, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from course_lib.models import shard_layers_then_root


def fsdp_collectives(
    n_mb: int,
    zero_stage: int = 3,
    reshard_after_forward: bool = True,
    reshard_after_backward: bool = True,
    defer_grad_sync: bool = False,
) -> dict[str, int]:
    """Data-parallel collectives per FSDP unit and step, each moving that unit's parameters (or gradients).

    ZeRO-3 gathers a unit's parameters whenever it runs while resharded: with reshard_after_forward, in
    every micro-batch's forward and again in its backward (2 per micro-batch); without it, once per
    micro-batch. reshard_after_backward=False keeps them gathered after the first backward, so the
    other micro-batches gather them only in the forward that resharded them (n_mb + 1), or never
    again (1), when micro-batches run all forwards then all backwards (GPipe) or one after the other.
    Gradients are reduce-scattered after every micro-batch's backward unless the sync is deferred to
    the last (set_requires_gradient_sync(False) before, as DDP's no_sync). ZeRO-1/2 gather the updated
    parameters once per step; ZeRO-0 (DDP) all-reduces the gradients instead.
    """
    syncs = 1 if defer_grad_sync else n_mb
    if zero_stage == 0:
        return {"all_gather": 0, "reduce_scatter": 0, "all_reduce": syncs}
    if zero_stage in (1, 2):
        return {"all_gather": 1, "reduce_scatter": syncs, "all_reduce": 0}
    if reshard_after_backward:
        gathers = n_mb * (2 if reshard_after_forward else 1)
    else:
        gathers = n_mb + 1 if reshard_after_forward else 1
    return {"all_gather": gathers, "reduce_scatter": syncs, "all_reduce": 0}


def zero_collectives(stage: int, units: int, clip: bool = False) -> dict[str, int]:
    """The formula the counts are checked against: :func:`fsdp_collectives` of one micro-batch for each of the units
    (this ZeRO-1 all-reduces the gradient, which it keeps whole), and clipping's all-reduce of the norm."""
    per_unit = fsdp_collectives(1, stage) | ({"all_reduce": 1, "reduce_scatter": 0} if stage == 1 else {})
    calls = {op: units * n for op, n in per_unit.items() if n}
    if clip and stage > 0:
        calls["all_reduce"] = calls.get("all_reduce", 0) + 1
    return dict(sorted(calls.items()))


class ShardedUnit(nn.Module):
    """One unit of a ZeroModel: the wrapped module without its parameters, plus this rank's flat shard."""

    def __init__(self, inner: nn.Module, stage: int, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.stage, self.group = stage, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.names = [name for name, _ in inner.named_parameters(recurse=False)]
        self.shapes = [p.shape for _, p in inner.named_parameters(recurse=False)]
        flat = torch.cat([p.detach().reshape(-1) for _, p in inner.named_parameters(recurse=False)])
        self.numel = flat.numel()
        self.sizes = chunk_sizes(self.numel, self.world_size)
        for name in self.names:  # the unit's own parameters go; the shard replaces them
            delattr(inner, name)
            setattr(inner, name, None)
        self.inner = inner
        # Stages 1-2 keep the full parameters between steps (and stage 1 the full gradient): the
        # shard is then a view into the full copy, as in real ZeRO, so no element is held twice.
        self.full_params: torch.Tensor | None = None
        self.full_grad: torch.Tensor | None = None
        if stage == 0:
            self.shard = nn.Parameter(flat.clone())  # DDP: "shard" = everything
        elif stage in (1, 2):
            self.full_params = flat.clone()
            self.shard = nn.Parameter(torch.tensor_split(self.full_params, self.world_size)[self.rank])
        else:
            self.shard = nn.Parameter(torch.tensor_split(flat, self.world_size)[self.rank].clone())

    # -- the two collectives (comms.Recorder counts them) ---------------------------------------

    def gather(self) -> torch.Tensor:
        """All ranks' shards, concatenated: the unit's full flat parameters."""
        return ring_all_gather(self.shard.detach(), self.sizes, group=self.group)

    def reduce_gradient(self, flat_grad: torch.Tensor) -> torch.Tensor:
        """Average the full flat gradient over ranks; return the part this rank's shard needs."""
        n = self.world_size
        if self.stage in (0, 1):
            averaged = ring_all_reduce(flat_grad.contiguous(), group=self.group).div_(n)
            if self.stage == 0:
                return averaged
            self.full_grad = averaged  # stage 1 keeps the full gradient...
            return torch.tensor_split(averaged, n)[self.rank]  # ...and the shard's is a view into it
        return ring_reduce_scatter(flat_grad, group=self.group).div_(n)

    # -- forward and backward ---------------------------------------------------------------

    def parameters_for_compute(self) -> torch.Tensor:
        """The unit's full flat parameters for this forward or backward."""
        if self.stage == 0:
            return self.shard.detach()
        if self.stage == 3:
            return self.gather()
        assert self.full_params is not None  # stages 1-2 keep them between steps
        return self.full_params

    def run(self, flat_params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The wrapped module's forward with the given flat parameters put in place as views."""
        views = torch.split(flat_params, [s.numel() for s in self.shapes])
        for name, view, shape in zip(self.names, views, self.shapes):
            setattr(self.inner, name, view.view(shape))
        try:
            return self.inner(x)
        finally:
            for name in self.names:  # drop the references: stage 3 frees the full parameters here
                setattr(self.inner, name, None)

    def refresh_full_params(self) -> None:
        """Stages 1-2: copy the shards every rank updated in the last step into the full copy."""
        if self.full_params is not None:  # stages 1-2
            with torch.no_grad():  # in place: the shard is a view into it
                self.full_params.copy_(self.gather())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _UnitFunction.apply(x, self.shard, self)


class _UnitFunction(torch.autograd.Function):
    """Forward: get full parameters, compute, free. Backward: get them again, recompute the unit's
    forward with autograd on, take the gradients, reduce them to this rank's shard.

    Only the unit's *input* is saved between forward and backward, never its full parameters:
    that is what lets stage 3 free them. (torch's FSDP keeps autograd's saved activations and
    frees the parameter storage underneath instead; recomputing one Linear costs one matmul.)
    """

    @staticmethod
    def forward(ctx, x, shard, unit: ShardedUnit):
        ctx.unit = unit
        ctx.save_for_backward(x)
        with torch.no_grad():
            return unit.run(unit.parameters_for_compute(), x)

    @staticmethod
    def backward(ctx, grad_out):
        unit: ShardedUnit = ctx.unit
        (x,) = ctx.saved_tensors
        flat = unit.parameters_for_compute().detach().requires_grad_(True)
        x = x.detach().requires_grad_(ctx.needs_input_grad[0])
        with torch.enable_grad():
            out = unit.run(flat, x)
            inputs = (flat, x) if ctx.needs_input_grad[0] else (flat,)
            grads = torch.autograd.grad(out, inputs, grad_out)
        grad_shard = unit.reduce_gradient(grads[0])
        del flat  # stage 3: the full parameters go again
        return (grads[1] if ctx.needs_input_grad[0] else None), grad_shard, None


class ZeroModel(nn.Module):
    """ZeRO stage 0-3: a ShardedUnit per parameter owner; build the optimizer after, on ZeroModel.parameters()."""

    def __init__(self, module: nn.Module, stage: int = 3, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
        self.stage = stage
        self.module = module
        self.units: list[ShardedUnit] = []
        self._wrap(module, group)

    def _wrap(self, parent: nn.Module, group: dist.ProcessGroup | None) -> None:
        for name, child in list(parent.named_children()):
            if any(True for _ in child.parameters(recurse=False)):
                unit = ShardedUnit(child, self.stage, group)
                setattr(parent, name, unit)
                self.units.append(unit)
            else:
                self._wrap(child, group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        for unit in self.units:
            unit.refresh_full_params()
        return self.module(*args, **kwargs)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """clip_grad_norm_ for sharded grads: one all-reduce of the shards' squares (they partition the model)."""
        grads = [u.shard.grad for u in self.units if u.shard.grad is not None]
        squares = torch.stack([g.double().pow(2).sum() for g in grads]).sum()
        if self.stage > 0:  # stage 0 holds the whole gradient already
            dist.all_reduce(squares, group=self.units[0].group)
        total_norm = squares.sqrt().float()
        factor = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(factor)
        return total_norm

    def full_state(self) -> dict[str, torch.Tensor]:
        """Full parameters by original names, as compare.full_parameters; all-gathers, so call on every rank."""
        state = {}
        for unit_name, unit in self.module.named_modules():
            if isinstance(unit, ShardedUnit):
                flat = unit.shard.detach() if unit.stage == 0 else unit.gather()
                for name, view in zip(unit.names, torch.split(flat, [s.numel() for s in unit.shapes])):
                    state[f"{unit_name}.{name}"] = view.view(unit.shapes[unit.names.index(name)]).clone()
        return state

    def extra_held(self) -> dict[str, list[torch.Tensor]]:
        """Tensors this rank keeps between steps besides the shards and their gradients."""
        return {
            "params": [u.full_params for u in self.units if u.full_params is not None],
            "grads": [u.full_grad for u in self.units if u.full_grad is not None],
        }


def compile_blocks_then_shard(model: nn.Module, backend: Callable[..., Any] | None) -> nn.Module:
    """torchtitan's order: `block.compile()` on each of `model.blocks`, then `fully_shard` each block and the root.

    Each block's forward is compiled on its own, between the FSDP2 hooks that run around it; the root's own
    modules (embeddings, head) stay eager. `backend=None`: the same sharding, nothing compiled."""
    blocks = list(model.get_submodule("blocks").children())
    if backend is not None:
        for block in blocks:
            block.compile(backend=backend)
    return shard_layers_then_root(model, blocks)


def shard_then_compile(model: nn.Module, backend: Callable[..., Any] | None) -> nn.Module:
    """The whole model: `fully_shard` each of `model.blocks` and the root, then `torch.compile(model)`.

    Dynamo traces from the top and breaks its graph where it meets an FSDP2 hook. `backend=None`: no compile."""
    sharded = shard_layers_then_root(model, list(model.get_submodule("blocks").children()))
    return sharded if backend is None else cast(nn.Module, torch.compile(sharded, backend=backend))


COMPILE_ORDERS: dict[str, Callable[[nn.Module, Callable[..., Any] | None], nn.Module]] = {
    "per block, then fully_shard": compile_blocks_then_shard,
    "fully_shard, then whole model": shard_then_compile,
}
