"""Context parallelism on paper: bytes each rank sends per attention layer, memory it keeps, when the ring hides."""

from __future__ import annotations

from course_lib.context_parallel.layout import all_positions


def tokens_per_rank(layout: str, seq_len: int, world_size: int) -> list[int]:
    """s_r for every rank."""
    return [len(p) for p in all_positions(layout, seq_len, world_size)]


def ring_bytes(
    layout: str, seq_len: int, world_size: int, rank: int, batch: int, heads: int, head_dim: int, element_size: int
) -> dict[str, int]:
    """Bytes rank `rank` sends for one attention layer, by kind (the keys of ring_attention.sent_by_kind)."""
    if world_size == 1:
        return {"forward K/V": 0, "backward K/V": 0, "backward dK/dV": 0}
    per_token = 2 * batch * heads * head_dim * element_size  # K and V of one token
    received_last = tokens_per_rank(layout, seq_len, world_size)[(rank + 1) % world_size]
    kv = per_token * (seq_len - received_last)
    return {"forward K/V": kv, "backward K/V": kv, "backward dK/dV": per_token * seq_len}


def ring_bytes_even(seq_len: float, world_size: int, batch: int, heads: int, head_dim: int, element_size: int) -> float:
    """Forward + backward bytes per rank per layer when N divides S: 2·b·h·d·e·S·(3 - 2/N)."""
    if world_size == 1:
        return 0.0
    return 2 * batch * heads * head_dim * element_size * seq_len * (3 - 2 / world_size)


def saved_bytes(tokens: int, batch: int, heads: int, head_dim: int, element_size: int) -> int:
    """What attention keeps for backward on a rank holding `tokens`: q, k, v, out and the log-sum-exp."""
    return (4 * head_dim + 1) * batch * heads * tokens * element_size


def overlap_tokens(flops_per_s: float, bytes_per_s: float, element_size: int, causal: bool = True) -> float:
    """Tokens per rank above which one ring step's compute outlasts its message, so the ring is hidden."""
    return flops_per_s * element_size / ((1 if causal else 2) * bytes_per_s)
