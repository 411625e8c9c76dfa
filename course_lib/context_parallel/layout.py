"""Tokens per rank (contiguous, or zig-zag to balance causal work), and CP's bytes, memory and overlap on paper."""

from __future__ import annotations

import torch

from course_lib.collectives import chunk_offsets, chunk_sizes

LAYOUTS = ("contiguous", "zigzag")


def positions(layout: str, seq_len: int, world_size: int, rank: int) -> torch.Tensor:
    """The global token positions rank `rank` holds, in the order it stores them (1-D, int64)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    pieces = world_size if layout == "contiguous" else 2 * world_size
    if seq_len < pieces:
        raise ValueError(f"a {layout} layout cuts {seq_len} tokens into {pieces} chunks: use at least {pieces} tokens")
    offsets = chunk_offsets(chunk_sizes(seq_len, pieces))
    chunks = [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]
    return torch.cat([torch.arange(offsets[c], offsets[c + 1]) for c in chunks])


def describe_positions(held: torch.Tensor) -> str:
    """Positions as runs: "0-12, 37-49"."""
    runs: list[list[int]] = []
    for p in held.tolist():
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def all_positions(layout: str, seq_len: int, world_size: int) -> list[torch.Tensor]:
    """`positions` of every rank, in rank order."""
    return [positions(layout, seq_len, world_size, r) for r in range(world_size)]


def shard_sequence(x: torch.Tensor, mine: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's tokens of a full-sequence tensor (a copy: the rank keeps only these)."""
    return x.index_select(dim, mine.to(x.device)).contiguous()


def unshard_sequence(shards: list[torch.Tensor], layout_positions: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Every rank's shard put back in sequence order (the inverse of shard_sequence over all ranks)."""
    order = torch.cat(layout_positions)
    stacked = torch.cat(shards, dim=dim)
    return stacked.index_select(dim, torch.argsort(order).to(stacked.device))


def causal_pairs(query_positions: torch.Tensor, key_positions: torch.Tensor) -> int:
    """(query, key) pairs a causal mask keeps between two blocks: the attention work of one ring step."""
    return int((key_positions[None, :] <= query_positions[:, None]).sum())


def causal_work(layout: str, seq_len: int, world_size: int) -> list[list[int]]:
    """work[r][step]: the pairs rank r computes at ring step `step`, when it holds rank (r - step)'s K/V."""
    held = all_positions(layout, seq_len, world_size)
    return [
        [causal_pairs(held[r], held[(r - step) % world_size]) for step in range(world_size)] for r in range(world_size)
    ]


def visible_rectangle(
    q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows (queries) that see some key of a block, and the columns (keys) some query sees."""
    if not causal:
        return torch.arange(len(q_pos)), torch.arange(len(k_pos))
    if not len(q_pos) or not len(k_pos):
        return q_pos[:0], k_pos[:0]
    rows = torch.nonzero(q_pos >= k_pos.min()).squeeze(1)
    cols = torch.nonzero(k_pos <= q_pos.max()).squeeze(1)
    return rows, cols


def computed_work(layout: str, seq_len: int, world_size: int) -> list[list[int]]:
    """computed[r][step]: the size of the rectangle rank r computes at `step` (visible_rectangle)."""
    held = all_positions(layout, seq_len, world_size)
    work = []
    for r in range(world_size):
        areas = []
        for step in range(world_size):
            rows, cols = visible_rectangle(held[r], held[(r - step) % world_size])
            areas.append(len(rows) * len(cols))
        work.append(areas)
    return work


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
