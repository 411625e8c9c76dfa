"""Number formats (fp32, fp16, bf16, e4m3fn, e5m2) and the dtype each step really uses: autocast's ops, FSDP2's wire."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import cast

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib import comms
from course_lib.compare import grad_of

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DTYPE_NAMES = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "e4m3fn",
    torch.float8_e5m2: "e5m2",
}
# (exponent bits, mantissa bits) of the IEEE-style layouts; 1 sign bit each
LAYOUT = {
    torch.float32: (8, 23),
    torch.float16: (5, 10),
    torch.bfloat16: (8, 7),
    torch.float8_e4m3fn: (4, 3),
    torch.float8_e5m2: (5, 2),
}


def smallest_subnormal(dtype: torch.dtype) -> float:
    """The smallest positive number the format stores: 2^(min exponent - mantissa bits)."""
    info = torch.finfo(dtype)
    return info.smallest_normal * 2.0 ** -LAYOUT[dtype][1]


def stored_value(value: float, dtype: torch.dtype) -> float:
    """What `value` becomes when stored in `dtype` (round to nearest even, inf beyond the range)."""
    return torch.tensor(value, dtype=torch.float64).to(dtype).item()


def rounding_error(value: float, dtype: torch.dtype) -> float:
    """|stored - value| / |value| when `value` is stored in `dtype`: inf if it overflows, 0 for 0."""
    stored = stored_value(value, dtype)
    if math.isinf(stored) or value == 0:
        return math.inf if math.isinf(stored) else 0.0
    return abs(stored - value) / abs(value)


def bit_fields(value: float, dtype: torch.dtype) -> tuple[str, str, str]:
    """(sign, exponent, mantissa) bit strings of `value` stored in `dtype`."""
    exponent_bits, mantissa_bits = LAYOUT[dtype]
    if dtype == torch.float32:
        bits = struct.unpack(">I", struct.pack(">f", stored_value(value, dtype)))[0]
    else:  # 16 or 8 bits: reinterpret the stored value as an integer of its width
        width = 1 + exponent_bits + mantissa_bits
        as_int = torch.tensor(value, dtype=torch.float64).to(dtype).view(torch.int16 if width == 16 else torch.uint8)
        bits = int(as_int.item()) & (2**width - 1)
    text = format(bits, f"0{1 + exponent_bits + mantissa_bits}b")
    return text[0], text[1 : 1 + exponent_bits], text[1 + exponent_bits :]


class _OpDtypeRecorder(TorchDispatchMode):
    def __init__(self) -> None:
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
    """Run `fn()` and return (aten op, input dtypes, output dtype) for every op it dispatched."""
    recorder = _OpDtypeRecorder()
    with recorder:
        fn()
    return recorder.ops


def inspect_fsdp2_mixed_precision(
    param_dtype: torch.dtype | None = torch.bfloat16,
    reduce_dtype: torch.dtype | None = torch.float32,
    device: torch.device | None = None,
) -> dict:
    """One forward/backward of an FSDP2-sharded MLP under MixedPrecisionPolicy; the dtypes at each stage."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from course_lib.models import MLP, shard_layers_then_root

    device = device or torch.device("cpu")
    model = MLP().to(device)
    shard_layers_then_root(model, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    seen: dict[str, torch.dtype] = {}

    def before_forward(module, args):  # runs after FSDP2's own pre-forward hook has gathered the weight
        seen["gathered weight"] = module.weight.dtype
        seen["layer input"] = args[0].dtype

    def after_forward(module, args, out):
        seen["layer output"] = out.dtype  # returns None: a forward hook that returns a value replaces the output

    model[0].register_forward_pre_hook(before_forward)
    model[0].register_forward_hook(after_forward)
    x, y = torch.randn(8, 32, device=device), torch.randn(8, 8, device=device)
    with comms.Recorder() as rec:
        out = model(x)
        nn.functional.mse_loss(out.float(), y).backward()
    reduced = [c for c in rec.calls if c.op == "reduce_scatter"]
    first = cast(torch.Tensor, model[0].weight)
    return {
        "sharded parameter": DTYPE_NAMES[first.dtype],
        "all_gather input": sorted({DTYPE_NAMES[c.dtype] for c in rec.calls if c.op == "all_gather"}),
        "gathered weight": DTYPE_NAMES[seen["gathered weight"]],
        "layer input": DTYPE_NAMES[seen["layer input"]],
        "layer output": DTYPE_NAMES[seen["layer output"]],
        "reduce_scatter input": sorted({DTYPE_NAMES[c.dtype] for c in reduced}),
        "sharded gradient": DTYPE_NAMES[grad_of(first).dtype],
        "reduce-scattered bytes": sum(c.nbytes for c in reduced),
    }
