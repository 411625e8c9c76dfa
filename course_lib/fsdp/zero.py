"""Notebook 03: ZeRO stages 0-3 from scratch, on the ring collectives of notebook 01.

:class:`ZeroModel` wraps a model. Every module that owns parameters (a *unit*: here each
``nn.Linear``) has its parameters concatenated into one flat vector, cut with
``torch.tensor_split(flat, N)`` (the first ``numel % N`` chunks one element longer, no padding),
and rank r keeps chunk r as an ``nn.Parameter`` called ``shard``. The optimizer is built on
``model.parameters()``, i.e. on the shards only, so it steps (and keeps Adam state for) 1/N of the
model. What else a rank holds depends on the stage:

======  ================================  ====================================  =========================
stage   parameters held                   gradients held                        communication per unit
======  ================================  ====================================  =========================
0       full (the shard *is* the whole)   full, all-reduced                     1 all-reduce
1       full copy + shard                 full, all-reduced; shard's slice      1 all-reduce + 1 all-gather
2       full copy + shard                 shard only (reduce-scattered)         1 reduce-scatter + 1 all-gather
3       shard only; full only while used  shard only (reduce-scattered)         2 all-gathers + 1 reduce-scatter
======  ================================  ====================================  =========================

Stages 1 and 2 refresh their full copy with one all-gather at the start of each forward (the
updated shards of the last step); stage 3 all-gathers a unit right before its forward and again
right before its backward, and drops the full parameters after each.

The collectives are :func:`course_lib.collectives.ring_reduce_scatter` and
:func:`~course_lib.collectives.ring_all_gather`: their chunking is exactly ``tensor_split``, so
uneven sizes need no padding and no exchange of sizes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from course_lib.collectives import chunk_sizes, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from course_lib.exercises import ExerciseFailed, expect_equal

# Collective calls made by ZeroModel on this rank since reset_calls(): {"all_gather": k, ...}.
calls: Counter = Counter()


def reset_calls() -> None:
    calls.clear()


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

    # -- the two collectives, counted --------------------------------------------------------

    def gather(self) -> torch.Tensor:
        """All ranks' shards, concatenated: the unit's full flat parameters."""
        calls["all_gather"] += 1
        return ring_all_gather(self.shard.detach(), self.sizes, group=self.group)

    def reduce_gradient(self, flat_grad: torch.Tensor) -> torch.Tensor:
        """Average the full flat gradient over ranks; return the part this rank's shard needs."""
        n = self.world_size
        if self.stage in (0, 1):
            calls["all_reduce"] += 1
            averaged = ring_all_reduce(flat_grad.contiguous(), group=self.group).div_(n)
            if self.stage == 0:
                return averaged
            self.full_grad = averaged  # stage 1 keeps the full gradient...
            return torch.tensor_split(averaged, n)[self.rank]  # ...and the shard's is a view into it
        calls["reduce_scatter"] += 1
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
    """ZeRO stage 0-3 data parallelism of `module`: every parameter-owning submodule becomes a
    :class:`ShardedUnit`. Build the optimizer *after* wrapping, on ``ZeroModel.parameters()``.

    All ranks must start from the same weights (seeded models do); each rank feeds its own
    micro-batch, and gradients are averaged over ranks, as in DDP.
    """

    def __init__(self, module: nn.Module, stage: int = 3, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
        self.stage = stage
        self.module = module
        self.units: list[ShardedUnit] = []
        self._wrap(module, group)

    def _wrap(self, parent: nn.Module, group) -> None:
        for name, child in list(parent.named_children()):
            if any(True for _ in child.parameters(recurse=False)):
                unit = ShardedUnit(child, self.stage, group)
                setattr(parent, name, unit)
                self.units.append(unit)
            else:
                self._wrap(child, group)

    def forward(self, *args, **kwargs):
        for unit in self.units:
            unit.refresh_full_params()
        return self.module(*args, **kwargs)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ for sharded gradients: each rank sums the squares of its
        own shard, one all-reduce adds them up (the shards partition the model), same factor everywhere."""
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
        """Every unit's full parameters by their original names (all-gathers: call on every rank)."""
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


def collectives_per_step(stage: int, units: int) -> dict[str, int]:
    """The formula the counts are checked against: collective calls per training step."""
    return {
        0: {"all_reduce": units},
        1: {"all_reduce": units, "all_gather": units},
        2: {"reduce_scatter": units, "all_gather": units},
        3: {"reduce_scatter": units, "all_gather": 2 * units},
    }[stage]


# ---- training, for the comparisons ------------------------------------------------------------


def global_batches(steps: int, global_batch: int, seed: int = 0, pool: int = 1024):
    """The first `steps` batches of one fixed regression data set (32 -> 7 features): the same
    data set whatever `steps` is, so a run can be continued (train(..., first_step=k))."""
    from course_lib.data import regression

    if steps * global_batch > pool:
        raise ValueError(f"{steps} batches of {global_batch} need more than the {pool} samples")
    x, y = regression(n=pool, d_out=7, seed=seed).tensors
    return [
        (x[s * global_batch : (s + 1) * global_batch], y[s * global_batch : (s + 1) * global_batch])
        for s in range(steps)
    ]


def make_model() -> nn.Module:
    """The notebook's MLP: 32 -> 45 -> 45 -> 7. Unit sizes 1485, 2070 and 322 elements: none
    divisible by 4, the first not by 2, the last not by 3, so every N in 2, 3, 4 cuts unevenly."""
    from course_lib.models import MLP

    return MLP(d_in=32, d_hidden=45, d_out=7, n_layers=2, seed=0)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    micro_batch: int = 8,
    world_size: int = 1,
    rank: int = 0,
    clip: Callable[[], object] | None = None,
    device: torch.device | str = "cpu",
    first_step: int = 0,
) -> list[float]:
    """`steps` optimizer steps. Each global batch has micro_batch x world_size samples; rank r trains
    on its r-th slice (world_size=1: one process, the whole batch: the reference run).
    `clip()` is called between backward and step (gradient clipping); `first_step` continues a run
    (global batch number `first_step` comes next). Returns rank-local losses."""
    losses = []
    for x, y in global_batches(first_step + steps, micro_batch * world_size)[first_step:]:
        lo = rank * micro_batch
        x, y = x[lo : lo + micro_batch].to(device), y[lo : lo + micro_batch].to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip is not None:
            clip()
        optimizer.step()
        losses.append(loss.item())
    return losses


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters by name of a plain, ZeroModel or fully_shard model (collective for the last two)."""
    from torch.distributed.tensor import DTensor

    if isinstance(model, ZeroModel):
        return {k: v.cpu() for k, v in model.full_state().items()}
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu() for name, p in model.named_parameters()
    }


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise ValueError(f"different parameter names: {sorted(a)} vs {sorted(b)}")
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ---- exercise: shard a parameter and its Adam state ---------------------------------------------


def solution_shard_with_adam_state(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    return tuple(torch.tensor_split(t.reshape(-1), n)[rank].clone() for t in (param, exp_avg, exp_avg_sq))


def check_shard_with_adam_state(fn) -> None:
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


# ---- counting torch's collectives -------------------------------------------------------------------

_FRIENDLY = {
    "allgather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "allreduce": "all_reduce",
    "broadcast": "broadcast",
    "all_to_all": "all_to_all",
}


def comm_counts(comm) -> dict[str, int]:
    """CommDebugMode's counts under the names used in this course (all_gather, reduce_scatter, ...).

    FSDP2 calls the c10d ops behind all_gather_single / reduce_scatter_single (`_allgather_base_`,
    `_reduce_scatter_base_`): one call per unit per gather or reduction."""
    counts: Counter = Counter()
    for op, k in comm.get_comm_counts().items():
        name = str(op).split(".")[-1]
        friendly = next((v for key, v in _FRIENDLY.items() if key in name), name)
        counts[friendly] += k
    return dict(sorted(counts.items()))
