"""Activation memory per transformer layer: the paper's formula, and the course's block derived tensor by tensor."""

from __future__ import annotations

from typing import Any

from course_lib.models import BLOCK

# Each term: bytes per element of s·b·h or of a·s²·b, and whether tensor parallelism splits it over the t ranks
# (it lies between a column- and a row-parallel layer) or leaves it replicated. Sequence parallelism, as the paper
# implements it, divides every term by t.
_PAPER_TABLE = """
attention: QKV input (LayerNorm output) | 2 | sbh  | replicated
attention: Q and K, for QKᵀ             | 4 | sbh  | split
attention: softmax output               | 2 | as2b | split
attention: softmax dropout mask         | 1 | as2b | split
attention: dropout output, for ·V       | 2 | as2b | split
attention: V                            | 2 | sbh  | split
attention: output projection input      | 2 | sbh  | split
attention: dropout mask                 | 1 | sbh  | replicated
MLP: first linear input                 | 2 | sbh  | replicated
MLP: GeLU input                         | 8 | sbh  | split
MLP: second linear input                | 8 | sbh  | split
MLP: dropout mask                       | 1 | sbh  | replicated
LayerNorm: the two inputs               | 4 | sbh  | replicated
"""
KORTHIKANTI_TERMS: list[tuple[str, int, str, bool]] = [
    (name, int(factor), unit, placement == "split")
    for name, factor, unit, placement in (
        [field.strip() for field in line.split("|")] for line in _PAPER_TABLE.strip().splitlines()
    )
]
SELECTIVE = ("attention: softmax output", "attention: softmax dropout mask", "attention: dropout output, for ·V")


def korthikanti_terms(
    s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False, selective: bool = False
) -> dict[str, float]:
    """The paper's bytes per layer, term by term; `selective` drops what their selective recomputation recomputes."""
    terms = {}
    for name, factor, unit, split in KORTHIKANTI_TERMS:
        if selective and name in SELECTIVE:
            continue
        size = s * b * h if unit == "sbh" else a * s * s * b
        divided = split or sequence_parallel
        terms[name] = factor * size / (t if divided else 1)
    return terms


def korthikanti_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False) -> float:
    """The terms' sum, Table 2 of the paper: sbh(10 + 24/t + 5as/(ht)); sequence-parallel, sbh(34 + 5as/h)/t."""
    return sum(korthikanti_terms(s, b, h, a, t, sequence_parallel).values())


def attention_width(h: int, a: int, head_multiple: int = 1) -> int:
    """Per-token q, k, v, output widths as fused attention stores them: CUDA's flash pads heads to head_multiple=8."""
    head = h // a
    return a * -(-head // head_multiple) * head_multiple


def course_block_terms(
    s: int,
    b: int,
    h: int = BLOCK.d_model,
    a: int = BLOCK.n_heads,
    d_ff: int = BLOCK.d_ff,
    *,
    element_bytes: int = 2,
    stats_bytes: int | None = None,
    attention: str = "flash",
    head_multiple: int = 1,
    t: int = 1,
    sequence_parallel: bool = False,
) -> dict[str, float]:
    """Bytes each tensor saved for backward by one `TransformerBlock` takes, on one of `t` tensor-parallel ranks.

    element_bytes: the activations' dtype; stats_bytes: LayerNorm's mean and 1/σ (fp32 on CUDA). With t > 1 q/k/v/up
    are column-parallel and o/down row-parallel; with sequence_parallel the norms see s/t tokens, but q/k/v and up
    save their all-gathered, whole input.
    """
    e, stats = element_bytes, element_bytes if stats_bytes is None else stats_bytes
    tokens, sp = s * b, t if sequence_parallel else 1
    return {
        "norm1 input (the block input)": e * tokens * h / sp,
        "norm1 mean and 1/σ": 2 * stats * tokens / sp,
        "q/k/v input (norm1 output)": e * tokens * h,
        **attention_terms(s, b, h, a, e, attention=attention, head_multiple=head_multiple, t=t),
        "norm2 input": e * tokens * h / sp,
        "norm2 mean and 1/σ": 2 * stats * tokens / sp,
        "up input (norm2 output)": e * tokens * h,
        "GELU input": e * tokens * d_ff / t,
        "down input (GELU output)": e * tokens * d_ff / t,
    }


def attention_terms(
    s: int, b: int, h: int, a: int, e: int, *, attention: str = "flash", head_multiple: int = 1, t: int = 1
) -> dict[str, float]:
    """What the attention kernel saves, and `o`'s input. "flash" (fused: q, k, v, the output and a fp32 log-sum-exp
    per row; on CUDA heads padded to head_multiple=8 values, and o's input then a copy) or "math" (as on the CPU:
    it computes in fp32 and saves the softmax, a·s² per sequence)."""
    tokens = s * b
    if attention == "flash":
        width = attention_width(h, a, head_multiple)
        terms = {"q, k, v": 3 * e * tokens * width / t}
        if width == h:
            terms["attention output = o input"] = e * tokens * h / t
        else:
            terms["attention output (padded heads)"] = e * tokens * width / t
            terms["o input (a copy without the padding)"] = e * tokens * h / t
        return terms | {"log-sum-exp (fp32)": 4 * a * tokens / t}
    if attention == "math":  # the math path upcasts 16-bit q, k, v to fp32
        return {
            "q, k, v (fp32)": 3 * 4 * tokens * h / t,
            "softmax output (fp32, a·s² per sequence)": 4 * a * s * s * b / t,
            "o input (attention output)": e * tokens * h / t,
        }
    raise ValueError(f"attention must be 'flash' or 'math', got {attention!r}")


def course_block_bytes(
    s: int, b: int, h: int = BLOCK.d_model, a: int = BLOCK.n_heads, d_ff: int = BLOCK.d_ff, **options: Any
) -> float:
    """The sum of :func:`course_block_terms` (same arguments): bytes one TransformerBlock saves for backward."""
    return sum(course_block_terms(s, b, h, a, d_ff, **options).values())


def selective_block_bytes(
    s: int, b: int, h: int, a: int, d_ff: int, *, element_bytes: int = 2, head_multiple: int = 1
) -> float:
    """Bytes one checkpointed block keeps under the save-matmuls policy (`recompute.save_matmuls`), flash attention."""
    e, tokens, width = element_bytes, s * b, attention_width(h, a, head_multiple)
    return e * tokens * (h + 3 * h + width + h + d_ff + h) + 4 * a * tokens


def stack_bytes(
    per_layer: float, layers: int, block_input: float, recompute: str = "none", selective_per_layer: float = 0.0
) -> dict[str, float]:
    """Activation bytes of `layers` blocks: held after the forward, and at the peak of the backward."""
    if recompute == "none":
        held = layers * per_layer
        return {"held": held, "peak": held}
    if recompute == "full":
        held = layers * block_input
        return {"held": held, "peak": held + per_layer}
    if recompute == "selective":
        held = layers * selective_per_layer
        return {"held": held, "peak": held + per_layer}
    raise ValueError(f"recompute must be 'none', 'full' or 'selective', got {recompute!r}")
