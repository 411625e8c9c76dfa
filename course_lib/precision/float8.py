"""Float8 training: the e4m3 and e5m2 formats, scaling by amax, and torchao's Float8Linear under FSDP2."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from course_lib.precision.inspection import FLOAT8_DTYPES, FLOAT_DTYPES
from course_lib.precision.lab import finfo_table

# ---- torchao's load-time log lines ----------------------------------------------------------------------------------
# `import torchao` tries to load each of its compiled kernel libraries (_C_mxfp8, _C_cutlass_90a: CUDA kernels for
# microscaling and rowwise float8) and logs "Failed to load <path>: ..." on the `torchao` logger for each one that
# cannot load, as on a CPU-only torch. Float8 training with tensor-wise scales does not use them (its matmul is torch's
# own scaled_mm). Its import also registers KernelPreference, an Enum, as a pytree constant, which torch 2.13 logs as
# deprecated on `torch.utils._pytree` (torch now handles Enums itself; torchao has yet to drop the call). Both lines
# are dropped here, and nothing else those loggers say.


def _torchao_kernel_library_not_loaded(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return message.startswith("Failed to load ") and "/torchao/_C" in message


def _torchao_enum_registered_as_pytree_constant(record: logging.LogRecord) -> bool:
    enum_class = record.args[0] if isinstance(record.args, tuple) and record.args else None
    return str(record.msg).startswith("%s is an Enum subclass") and getattr(enum_class, "__module__", "").startswith(
        "torchao."
    )


class _Drop(logging.Filter):
    def __init__(self, matches: Callable[[logging.LogRecord], bool]) -> None:
        super().__init__()
        self.matches = matches

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.matches(record)


def _quiet_torchao_import() -> None:
    for logger_name, matches in (
        ("torchao", _torchao_kernel_library_not_loaded),
        ("torch.utils._pytree", _torchao_enum_registered_as_pytree_constant),
    ):
        logger = logging.getLogger(logger_name)
        if not any(isinstance(f, _Drop) and f.matches is matches for f in logger.filters):
            logger.addFilter(_Drop(matches))


_quiet_torchao_import()

# ---- the formats ----------------------------------------------------------------------------------------------------


def formats_table() -> list[dict]:
    """finfo_table's fp32, fp16 and bf16, then e4m3fn and e5m2 with the same columns, from torch.finfo."""
    return finfo_table(FLOAT_DTYPES + FLOAT8_DTYPES)


# ---- scaling --------------------------------------------------------------------------------------------------------

AMAX_FLOOR = 1e-12  # an all-zero tensor gets a finite scale (torchao's EPS)


def to_float8(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, rowwise: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` in float8 with its scale: (data, scale), data = x * scale rounded to `dtype`, so x ≈ data / scale.

    The scale maps the largest |x| (amax) of the tensor, or of each row, onto the format's largest number: the values
    use the whole range, the largest lands on max, and none overflows. One scale per tensor is what torchao's
    tensor-wise recipe does (the same bits); one per row keeps an outlier row from squeezing the others toward zero.
    """
    amax = x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().max()
    largest = torch.finfo(dtype).max
    scale = (largest / amax.to(torch.float64).clamp(min=AMAX_FLOOR)).to(torch.float32)  # in float64 as torchao does
    data = (x.to(torch.float32) * scale).clamp(-largest, largest).to(dtype)  # saturate: never inf
    return data, scale


def from_float8(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What float8 `data` with `scale` stands for, in fp32."""
    return data.to(torch.float32) / scale


def cast_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| over the whole tensor (compare.relative_error looks at the largest element)."""
    return float((approx - exact).detach().norm() / exact.detach().norm())


# ---- which Linears ---------------------------------------------------------------------------------------------------


def why_high_precision(linear: nn.Module, shards: int = 1) -> str:
    """Why `linear` should stay in high precision under `convert_to_float8_training`, or "" if float8 suits it."""
    if not isinstance(linear, nn.Linear):
        return "not a Linear"
    out_features, in_features = linear.weight.shape
    if in_features % 16 or out_features % 16:
        return f"dims {in_features}x{out_features} not multiples of 16"
    if out_features % shards:
        return f"{out_features} rows do not split evenly over {shards} ranks"
    return ""


def float8_filter(shards: int = 1) -> Callable[[nn.Module, str], bool]:
    """A `module_filter_fn` for `convert_to_float8_training`: swap a module when why_high_precision says ""."""
    return lambda module, fqn: why_high_precision(module, shards) == ""


def float8_width(world_size: int, about: int = 256) -> int:
    """Smallest multiple of lcm(16, world_size) >= `about`: float8 weights of that many rows split evenly over ranks."""
    step = math.lcm(16, world_size)
    return step * math.ceil(about / step)


def float8_tensor_cores(device: torch.device) -> bool:
    """Whether `device` multiplies float8 on tensor cores: a CUDA GPU of compute capability 8.9 (Ada) or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def float8_recipe(device: torch.device) -> Any:
    """torchao's tensor-wise Float8LinearConfig with the float8 all-gather, for `device`."""
    from torchao.float8 import Float8LinearConfig

    if float8_tensor_cores(device):
        return Float8LinearConfig(enable_fsdp_float8_all_gather=True, pad_inner_dim=True)
    return Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)


# ---- FSDP2 training --------------------------------------------------------------------------------------------------

FSDP_KINDS = ("fp32", "bf16", "float8")


def fsdp_model(kind: str, width: int, device: torch.device) -> tuple[nn.Module, dict[str, nn.Module]]:
    """MLP(d_hidden=width, n_layers=2), each Linear an FSDP2 unit, as `kind` trains it; and its Float8Linears."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from course_lib.models import MLP, shard_layers_then_root

    model = MLP(d_hidden=width, n_layers=2).to(device)
    float8_modules: dict[str, nn.Module] = {}
    if kind == "float8":  # swap the Linears the filter accepts; the recipe casts each weight's shard before gathering
        from torchao.float8 import convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear

        recipe = float8_recipe(device)  # real float8 matmuls on SM89+, emulated elsewhere
        convert_to_float8_training(model, config=recipe, module_filter_fn=float8_filter(dist.get_world_size()))
        float8_modules = {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    policy = MixedPrecisionPolicy() if kind == "fp32" else MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    shard_layers_then_root(model, mp_policy=policy)
    return model, float8_modules


def train_fsdp(
    kind: str,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    width: int,
    lr: float,
    device: torch.device,
) -> dict:
    """SGD on MLP(d_hidden=width, n_layers=2), each Linear an FSDP2 unit, in "fp32", "bf16" or "float8" (torchao)."""
    from course_lib import comms

    model, float8_modules = fsdp_model(kind, width, device)
    # FSDP2 made each weight a DTensor; torchao keeps the scale on the float8 weight's shard, its local tensor
    float8_shards: list[Any] = [cast(Any, m.weight)._local_tensor for m in float8_modules.values()]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    def precompute_scales() -> list[comms.Call]:
        """torchao's step: every float8 weight's scale from its amax, for the next all-gathers; its calls."""
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        with comms.Recorder() as rec:
            precompute_float8_dynamic_scale_for_fsdp(model)
        return rec.calls

    result: dict = {"losses": [], "precompute_calls": [], "scales": [], "scales_are_max_over_amax": True}
    if kind == "float8":
        result["precompute_calls"].append(precompute_scales())  # before the first forward too
    for step, (x, y) in enumerate(batches):
        with comms.Recorder() as rec:
            loss = nn.functional.mse_loss(model(x).float(), y)
            forward_calls = list(rec.calls)
            loss.backward()
        if step == 0:
            result["forward_all_gather_bytes"] = [c.nbytes for c in forward_calls if c.op == "all_gather"]
            result["forward_ops"] = comms.counts(forward_calls)
            result["first_step"] = rec.calls
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if kind == "float8":
            result["precompute_calls"].append(precompute_scales())
            # the scale torchao keeps on each shard for the next all-gather (a private attribute)
            scales = [float(shard._precomputed_scale) for shard in float8_shards]
            result["scales"].append(scales)
            for shard, scale in zip(float8_shards, scales):
                amax = shard.detach().abs().max().to(torch.float32)
                dist.all_reduce(amax, op=dist.ReduceOp.MAX)  # the full weight's amax
                expected = torch.finfo(torch.float8_e4m3fn).max / amax.to(torch.float64)
                result["scales_are_max_over_amax"] &= scale == float(expected.to(torch.float32))
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        result["losses"].append(mean_loss.item() / dist.get_world_size())
    result["float8_modules"] = list(float8_modules)
    result["emulated"] = [cast(Any, m).config.emulate for m in float8_modules.values()]
    result["float8_tensor_cores"] = float8_tensor_cores(device)
    return result


# ---- speed ----------------------------------------------------------------------------------------------------------


def matmul_and_linear_seconds(device: torch.device, n: int = 8192, repeats: int = 10) -> dict[str, float]:
    """Fastest bf16 vs float8 seconds of an n³ matmul and a Linear step; float8 means something from SM89 on."""
    from torchao.float8 import convert_to_float8_training

    from course_lib.launch.runtime import seconds_in_turns

    generator = torch.Generator(device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=generator)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=generator)
    a8, scale_a = to_float8(a)
    b8, scale_b = to_float8(b)  # rows of b become columns of the product: b8.t() is column-major, as scaled_mm wants

    def float8_matmul() -> torch.Tensor:
        tensorwise = nn.functional.ScalingType.TensorWise
        return nn.functional.scaled_mm(
            a8, b8.t(), 1 / scale_a, tensorwise, 1 / scale_b, tensorwise, output_dtype=torch.bfloat16
        )

    linears = {}
    for name in ("bf16 Linear", "float8 Linear"):
        layer = nn.Sequential(nn.Linear(n, n, bias=False, device=device, dtype=torch.bfloat16))
        if name == "float8 Linear":
            convert_to_float8_training(layer)
        linears[name] = layer
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=generator, requires_grad=True)

    def linear_step(layer: nn.Module) -> Callable[[], None]:
        return lambda: layer(x).sum().backward()

    return seconds_in_turns(
        {
            "bf16 matmul": lambda: a @ b.t(),
            "float8 matmul": float8_matmul,
            **{name: linear_step(layer) for name, layer in linears.items()},
        },
        repeats=repeats,
    )
