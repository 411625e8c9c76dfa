"""Ulysses sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023): split the heads, not the keys."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.expert_parallel import all_to_all


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """This rank's rows of attention over the whole sequence; q, k, v: (batch, heads, its S/N tokens, d), the
    contiguous chunk `rank` of the sequence (chunks of equal length)."""
    n = dist.get_world_size(group)
    heads = q.shape[1]
    if heads % n:
        raise ValueError(
            f"Ulysses gives each of the {n} ranks whole heads, but {heads} heads do not split {n} ways: use a "
            f"number of ranks that divides {heads}, or ring attention, which splits any sequence over any number"
        )
    q, k, v = (sequence_to_heads(t, group) for t in (q, k, v))
    return heads_to_sequence(F.scaled_dot_product_attention(q, k, v, is_causal=causal), group)


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """(b, h, S/N, d), my tokens of every head -> (b, h/N, S, d), every token of my heads: one all-to-all."""
    n = dist.get_world_size(group)
    b, h, c, d = x.shape
    rows = all_to_all(x.transpose(0, 1), [h // n] * n, [h // n] * n, group)  # heads are rows: group j to rank j
    # rows: (N, h/N, b, c, d), block j = rank j's tokens of my heads; rank order is sequence order
    return rows.view(n, h // n, b, c, d).permute(2, 1, 0, 3, 4).reshape(b, h // n, n * c, d)


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """(b, h/N, S, d) -> (b, h, S/N, d): the inverse all-to-all, my tokens of every head back on this rank."""
    n = dist.get_world_size(group)
    b, g, s, d = x.shape
    blocks = x.view(b, g, n, s // n, d).permute(2, 1, 0, 3, 4).reshape(n * g, b, s // n, d)  # block j: rank j's tokens
    return all_to_all(blocks, [g] * n, [g] * n, group).transpose(0, 1)


def ulysses_bytes(seq_len: int, world_size: int, batch: int, heads: int, head_dim: int, element_size: int) -> dict:
    """Bytes a rank sends for one attention layer: {"forward": ..., "backward": ...}, four all-to-alls each."""
    one = (world_size - 1) * batch * heads * (seq_len // world_size) * head_dim * element_size // world_size
    return {"forward": 4 * one, "backward": 4 * one}
