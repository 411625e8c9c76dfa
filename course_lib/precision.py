"""course_lib.precision: number formats, autocast inspection, and dynamic loss scaling from scratch.

The centre piece is :class:`DynamicLossScaler`, a from-scratch copy of what
``torch.amp.GradScaler`` does, written so every step is visible: multiply the
loss by a scale, divide the gradients by it, skip the optimizer step when a
gradient overflowed (on *any* rank), back off after an overflow and grow the
scale again after ``growth_interval`` clean steps. It has GradScaler's method
names, so the same training loop (:func:`amp_training_loop`) drives both, and
the notebook asserts that both produce the same scales, the same skipped steps
and the same parameters.
"""

from __future__ import annotations

import contextlib
import math
import struct
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib.compare import grad_of, local_tensor
from course_lib.exercises import ExerciseFailed

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# (exponent bits, mantissa bits) of the IEEE-style layouts; 1 sign bit each
LAYOUT = {torch.float32: (8, 23), torch.float16: (5, 10), torch.bfloat16: (8, 7)}


# ---------------------------------------------------------------------------------------------
# Number formats
# ---------------------------------------------------------------------------------------------


def finfo_table() -> list[dict]:
    """Range and precision of fp32, fp16 and bf16, from torch.finfo."""
    rows = []
    for dtype in FLOAT_DTYPES:
        info = torch.finfo(dtype)
        exponent_bits, mantissa_bits = LAYOUT[dtype]
        rows.append(
            {
                "dtype": DTYPE_NAMES[dtype],
                "bits": info.bits,
                "exponent bits": exponent_bits,
                "mantissa bits": mantissa_bits,
                "max": info.max,
                "smallest normal": info.smallest_normal,
                "smallest subnormal": smallest_subnormal(dtype),
                "eps": info.eps,
                "decimal digits": round(math.log10(2) * (mantissa_bits + 1), 1),
            }
        )
    return rows


def smallest_subnormal(dtype: torch.dtype) -> float:
    """The smallest positive number the format stores: 2^(min exponent - mantissa bits)."""
    info = torch.finfo(dtype)
    return info.smallest_normal * 2.0 ** -LAYOUT[dtype][1]


def stored_value(value: float, dtype: torch.dtype) -> float:
    """What `value` becomes when stored in `dtype` (round to nearest even, inf beyond the range)."""
    return torch.tensor(value, dtype=torch.float64).to(dtype).item()


def relative_error(value: float, dtype: torch.dtype) -> float:
    stored = stored_value(value, dtype)
    if math.isinf(stored) or value == 0:
        return math.inf if math.isinf(stored) else 0.0
    return abs(stored - value) / abs(value)


def bit_fields(value: float, dtype: torch.dtype) -> tuple[str, str, str]:
    """(sign, exponent, mantissa) bit strings of `value` stored in `dtype`."""
    exponent_bits, mantissa_bits = LAYOUT[dtype]
    if dtype == torch.float32:
        bits = struct.unpack(">I", struct.pack(">f", stored_value(value, dtype)))[0]
    else:  # fp16 and bf16 are both 16 bits: reinterpret the stored value as int16
        bits = int(torch.tensor(value, dtype=torch.float64).to(dtype).view(torch.int16).item()) & 0xFFFF
    text = format(bits, f"0{1 + exponent_bits + mantissa_bits}b")
    return text[0], text[1 : 1 + exponent_bits], text[1 + exponent_bits :]


# ---------------------------------------------------------------------------------------------
# What autocast does: the dtype of every op
# ---------------------------------------------------------------------------------------------


class _OpDtypeRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple[str, ...], str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = tuple(DTYPE_NAMES.get(a.dtype, str(a.dtype)) for a in args if isinstance(a, torch.Tensor))
        first = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(first, torch.Tensor):
            self.ops.append((func.overloadpacket.__name__, inputs, DTYPE_NAMES.get(first.dtype, str(first.dtype))))
        return out


def record_op_dtypes(fn: Callable[[], torch.Tensor]) -> list[tuple[str, tuple[str, ...], str]]:
    """Run `fn()` and return (aten op, input dtypes, output dtype) for every op it dispatched.

    Ops that only move data (views, copies the autocast casts make) are kept: they show where
    autocast inserts a cast (`_to_copy` from fp32 to bf16).
    """
    recorder = _OpDtypeRecorder()
    with recorder:
        fn()
    return recorder.ops


# ---------------------------------------------------------------------------------------------
# Dynamic loss scaling from scratch
# ---------------------------------------------------------------------------------------------


def local_grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradients this rank holds: for FSDP2's DTensor gradients, the local shard."""
    grads = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                grads.append(local_tensor(param.grad))
    return grads


def found_inf_across_ranks(grads: Iterable[torch.Tensor], group=None, sync: bool = True) -> torch.Tensor:
    """1.0 on every rank if any gradient on any rank is inf or nan, else 0.0.

    Each rank may hold different gradients (FSDP shards, pipeline stages): an overflow in one
    rank's shard must make *every* rank skip the step, or the ranks' parameters and scales drift
    apart. A MAX all-reduce of the local flag does that.
    """
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
    """The dynamic loss scaler of torch.amp.GradScaler, from scratch.

    Per step: ``scale(loss).backward()``; optionally ``unscale_(optimizer)`` (then clip);
    ``step(optimizer)`` (skipped if any rank found inf/nan); ``update()``.
    ``update`` halves the scale after an overflow (backoff) and doubles it after
    ``growth_interval`` consecutive clean steps (growth), as GradScaler does.
    ``sync_found_inf=False`` leaves out the all-reduce: each rank then decides alone (wrong when
    ranks hold different gradients; kept to show what goes wrong).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        group=None,
        sync_found_inf: bool = True,
    ):
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


# ---------------------------------------------------------------------------------------------
# One training loop for both scalers
# ---------------------------------------------------------------------------------------------


def poison_one_gradient(optimizer: torch.optim.Optimizer) -> None:
    """Write inf into the first element of this rank's first local gradient: an overflow on this rank only."""
    with torch.no_grad():
        local_grads(optimizer)[0].view(-1)[0] = math.inf


def amp_training_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler,
    batches,
    *,
    dtype: torch.dtype = torch.float16,
    poison: dict[int, int] | None = None,
    max_norm: float | None = None,
) -> dict:
    """Train with autocast(`dtype`) and `scaler` (torch.amp.GradScaler or DynamicLossScaler).

    `poison` maps step -> rank: on that step that rank alone finds an inf in its gradients.
    Returns the scale before each step, the steps whose update was skipped, and the losses.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    poison = poison or {}
    scales, skipped, losses = [], [], []
    for step, (x, y) in enumerate(batches):
        device_type = x.device.type
        with torch.autocast(device_type, dtype=dtype):
            loss = nn.functional.mse_loss(model(x), y)
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        if poison.get(step) == rank:
            poison_one_gradient(optimizer)
        scaler.unscale_(optimizer)  # unscale first, so clipping sees the true gradients
        if max_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        before = [local_tensor(p.detach()).clone() for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        if all(torch.equal(b, local_tensor(p.detach())) for b, p in zip(before, model.parameters())):
            skipped.append(step)
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"scales": scales, "skipped": skipped, "losses": losses}


def rank_batches(n_steps: int, global_batch: int, device: torch.device, seed: int = 0) -> list:
    """This rank's micro-batches of the shared regression data: global batch s, its rows rank::world_size.

    The global batches are the same for any number of ranks, so results compare across world sizes.
    """
    from course_lib.data import regression

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    x, y = regression(n=n_steps * global_batch, seed=seed).tensors
    return [
        (
            x[s * global_batch : (s + 1) * global_batch][rank::world].to(device),
            y[s * global_batch : (s + 1) * global_batch][rank::world].to(device),
        )
        for s in range(n_steps)
    ]


# ---------------------------------------------------------------------------------------------
# Loss curves: fp32, bf16 autocast, fp16 with and without loss scaling
# ---------------------------------------------------------------------------------------------

PRECISION_MODES = ("fp32", "bf16 autocast", "fp16 autocast, no scaling", "fp16 autocast + GradScaler")


def train_precision_mode(
    mode: str, batches, *, lr: float, loss_factor: float, device: torch.device, n_layers: int = 2
) -> dict:
    """Data-parallel SGD of the course MLP in one precision mode; gradients averaged over ranks.

    `loss_factor` (a power of two) shrinks the loss, and `lr / loss_factor` undoes it: in fp32 the
    run is unchanged, but the gradients become as small as a large model's, where fp16 underflows.
    Returns the global batch's losses (averaged over ranks) and the fraction of weight-gradient entries
    that came out exactly zero.
    """
    from course_lib.models import MLP

    model = MLP(n_layers=n_layers).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr / loss_factor)
    dtype = {"fp32": None, "bf16 autocast": torch.bfloat16}.get(mode, torch.float16)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**16) if "GradScaler" in mode else None
    world = dist.get_world_size() if dist.is_initialized() else 1
    losses, zeroed, skipped = [], [], 0
    for x, y in batches:
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = nn.functional.mse_loss(model(x), y)
        scaled = loss * loss_factor
        (scaler.scale(scaled) if scaler else scaled).backward()
        weights = [grad_of(p) for p in model.parameters() if p.dim() == 2]
        # the global batch's loss and zeroed fraction: the same number on every rank
        logged = torch.tensor(
            [loss.item(), sum(int((g == 0).sum()) for g in weights) / sum(g.numel() for g in weights)],
            dtype=torch.float64,
            device=device,
        )
        if world > 1:
            # what DDP does during backward: average the gradients (one flat all-reduce, with the log values)
            grads = [grad_of(p) for p in model.parameters()]
            flat = torch.cat([g.flatten().double() for g in grads] + [logged])
            dist.all_reduce(flat)
            flat /= world
            torch._foreach_copy_(
                grads, [v.view_as(g) for v, g in zip(flat[:-2].split([g.numel() for g in grads]), grads)]
            )
            logged = flat[-2:]
        if scaler:
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped += scaler.get_scale() < before
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(logged[0].item())
        zeroed.append(logged[1].item())
    return {"losses": losses, "zeroed": sum(zeroed) / len(zeroed), "skipped": skipped}


# ---------------------------------------------------------------------------------------------
# Memory of parameters and activations
# ---------------------------------------------------------------------------------------------


def saved_activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward during `model(x)`, parameters themselves not counted.

    Each storage is counted once. Under autocast this includes the low-precision weight copies.
    """
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    return sum(seen.values())


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds (FSDP2: its shards only)."""
    return sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# FSDP2 mixed precision: which dtype goes over the wire
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def record_collectives():
    """Record (name, dtype, bytes of the full tensor) for every all_gather_single / reduce_scatter_single call.

    The full tensor is the all-gather's output and the reduce-scatter's input: the unsharded parameters
    or gradients, the same size for any number of ranks (padding aside).

    FSDP2 calls these through the `torch.distributed` module, so wrapping them there sees its traffic.
    """
    calls: list[tuple[str, str, int]] = []
    originals = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}

    def wrap(name, original):
        def recorded(output, input, *args, **kwargs):
            full = output if name == "all_gather_single" else input
            calls.append((name, DTYPE_NAMES.get(input.dtype, str(input.dtype)), full.numel() * full.element_size()))
            return original(output, input, *args, **kwargs)

        return recorded

    for name, original in originals.items():
        setattr(dist, name, wrap(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def inspect_fsdp2_mixed_precision(
    param_dtype=torch.bfloat16, reduce_dtype=torch.float32, device: torch.device | None = None
) -> dict:
    """One forward/backward of an FSDP2-sharded MLP under MixedPrecisionPolicy; the dtypes at each stage."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from course_lib.models import MLP

    device = device or torch.device("cpu")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model = MLP().to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    seen: dict[str, torch.dtype] = {}

    def before_forward(module, args):  # runs after FSDP2's own pre-forward hook has gathered the weight
        seen["gathered weight"] = module.weight.dtype
        seen["layer input"] = args[0].dtype

    def after_forward(module, args, out):
        seen["layer output"] = out.dtype  # returns None: a forward hook that returns a value replaces the output

    model[0].register_forward_pre_hook(before_forward)
    model[0].register_forward_hook(after_forward)
    x, y = torch.randn(8, 32, device=device), torch.randn(8, 8, device=device)
    with record_collectives() as calls:
        out = model(x)
        nn.functional.mse_loss(out.float(), y).backward()
    first = model[0].weight
    assert isinstance(first, torch.Tensor)
    return {
        "sharded parameter": DTYPE_NAMES[first.dtype],
        "all_gather input": sorted({dtype for name, dtype, _ in calls if name == "all_gather_single"}),
        "gathered weight": DTYPE_NAMES[seen["gathered weight"]],
        "layer input": DTYPE_NAMES[seen["layer input"]],
        "layer output": DTYPE_NAMES[seen["layer output"]],
        "reduce_scatter input": sorted({dtype for name, dtype, _ in calls if name == "reduce_scatter_single"}),
        "sharded gradient": DTYPE_NAMES[grad_of(first).dtype],
        "reduce-scattered bytes": sum(b for name, _, b in calls if name == "reduce_scatter_single"),
    }


# ---------------------------------------------------------------------------------------------
# The anti-pattern: a hand-managed scale next to GradScaler
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Exercise: the found-inf check that agrees across ranks
# ---------------------------------------------------------------------------------------------


def solution_found_inf(grads: list[torch.Tensor]) -> torch.Tensor:
    found = torch.zeros(())
    for grad in grads:
        if not torch.isfinite(grad).all():
            found.fill_(1.0)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return found


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


def check_found_inf(fn: Callable[[list[torch.Tensor]], torch.Tensor]) -> None:
    """Runs on every rank: `fn(grads)` must return 1.0 on every rank iff some rank has a non-finite gradient.

    After each case the ranks agree (MAX all-reduce) on whether any of them got a wrong answer, so all
    ranks stop at the same case: the ranks that were wrong raise ExerciseFailed, the others return.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for description, bad in _found_inf_cases(world_size):
        grads = [torch.randn(4, 3), torch.randn(3)]
        if rank in bad:
            grads[1][2] = bad[rank]
        originals = [g.clone() for g in grads]
        expected = 1.0 if bad else 0.0
        wrong = None
        try:
            got = fn(grads)
            got = got.detach().cpu() if isinstance(got, torch.Tensor) else torch.tensor(float(got))
            if got.numel() != 1 or float(got) != expected:
                shown = got.flatten().tolist() if got.numel() > 1 else float(got)
                wrong = f"case '{description}': expected {expected}, got {shown}"
            elif not all(torch.equal(g.nan_to_num(), o.nan_to_num()) for g, o in zip(grads, originals)):
                wrong = f"case '{description}': the check changed the gradients; it should only read them"
        except Exception as error:
            wrong = f"case '{description}': your function raised {type(error).__name__}: {error}"
        anyone_wrong = torch.tensor(1.0 if wrong else 0.0)
        dist.all_reduce(anyone_wrong, op=dist.ReduceOp.MAX)
        if wrong:
            raise ExerciseFailed(wrong)
        if anyone_wrong.item():
            return  # another rank's answer was wrong; that rank reports it


# ---------------------------------------------------------------------------------------------
# GPU only: matmul throughput per dtype
# ---------------------------------------------------------------------------------------------


def matmul_tflops(dtype: torch.dtype, device: torch.device, n: int = 8192, repeats: int = 10) -> float:
    """Median TFLOP/s of an n x n x n matmul on a CUDA device (2 n^3 flops per product)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):  # warm-up: kernel selection, clocks
        a @ b
    torch.cuda.synchronize(device)
    times_ms = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times_ms.append(start.elapsed_time(end))
    median_s = sorted(times_ms)[len(times_ms) // 2] / 1e3
    return 2 * n**3 / median_s / 1e12
