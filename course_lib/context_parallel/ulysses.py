"""Ulysses sequence parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023): split the heads, not the keys.

Each rank holds its contiguous chunk of the sequence for every head. An all-to-all trades it for the whole sequence
of h/N heads; attention runs locally, unchanged (any kernel, any mask: every rank sees every token of its heads);
a second all-to-all trades the output back to this rank's tokens of every head. Backward runs the two exchanges in
reverse (the all-to-all's gradient is the opposite all-to-all).

Bytes per rank and layer, N ranks, S tokens, b·h·d·e per token of one tensor: each all-to-all keeps 1/N of its
input and sends the rest, (N-1)/N · b·h·(S/N)·d·e. Forward: q, k, v in and the output back, 4 of them; backward: 4
more, as many bytes as the forward. The ring sends 2·b·h·d·e·S·(N-1)/N forward and (2N-1)/(N-1) times that backward:
Ulysses / ring = 2/N forward, 4(N-1)/(N(3N-2)) over forward and backward. Under grouped-query attention (h_kv K/V
heads) the ring passes only the K/V heads: Ulysses / ring = (h/h_kv + 1)/N forward. Its limit: N must divide the
query heads (past N = h_kv the K/V heads are replicated), where the ring splits any sequence over any N.
"""

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
