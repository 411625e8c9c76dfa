"""fp32, fp16 and bf16 (and float8's e4m3fn and e5m2): their bit layouts, and what a number becomes when stored."""

from __future__ import annotations

import math
import struct

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DTYPE_NAMES = {
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
