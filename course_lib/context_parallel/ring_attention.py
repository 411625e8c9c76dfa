"""Ring attention: queries stay, K/V blocks circle the ring, an online softmax merges; the course's block on it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course_lib import comms
from course_lib.context_parallel.layout import causal_pairs, visible_rectangle
from course_lib.models import Attention, TransformerBlock


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return lse.masked_fill(torch.isinf(lse), 0.0)  # a query that saw no key: exp(-inf - 0) = 0, not nan


def _scores(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor | None, k_pos: torch.Tensor | None) -> torch.Tensor:
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if q_pos is not None and k_pos is not None:  # causal: a query sees keys at its position or before
        scores = scores.masked_fill(k_pos[None, :].to(q.device) > q_pos[:, None].to(q.device), float("-inf"))
    return scores


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q kᵀ/√d) v over one K/V block, the log-sum-exp of each query's scores).

    With positions the causal mask keeps key ≤ query; a query that sees no key of the block gets output 0
    and log-sum-exp -inf, so merging it adds nothing.
    """
    scores = _scores(q, k, q_pos, k_pos)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - _finite(lse).unsqueeze(-1)) @ v, lse


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: attention over two disjoint key sets -> attention over their union.

    lse = log Σ exp(score) = m + log ℓ (running max m, running sum ℓ). Each part's output is normalised by
    its own sum; weighting it by exp(lse_part - lse) gives it its share of the union's sum.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = _finite(lse)
    out = out_a * torch.exp(lse_a - safe).unsqueeze(-1) + out_b * torch.exp(lse_b - safe).unsqueeze(-1)
    return out, lse


class Ring:
    """The neighbours of this rank in `group`, and exchanges posted now and waited for later."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group, self.rank, self.size = group, dist.get_rank(group), dist.get_world_size(group)

        def global_rank(r: int) -> int:
            return r if group is None else dist.get_global_rank(group, r)

        self.next, self.prev = global_rank((self.rank + 1) % self.size), global_rank((self.rank - 1) % self.size)

    def post(self, send: torch.Tensor, recv_shape: tuple[int, ...]) -> tuple[list[Any], torch.Tensor]:
        """Start sending `send` to the next rank and receiving a `recv_shape` tensor from the previous one."""
        recv = send.new_empty(recv_shape)
        ops = [
            dist.P2POp(dist.isend, send.contiguous(), self.next, self.group),
            dist.P2POp(dist.irecv, recv, self.prev, self.group),
        ]
        return dist.batch_isend_irecv(ops), recv


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


class RingAttention(torch.autograd.Function):
    """Attention of this rank's queries over every rank's keys and values; forward and backward on the ring."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        held: list[torch.Tensor],
        causal: bool,
        group: dist.ProcessGroup | None,
        trace: list[dict] | None,
    ) -> torch.Tensor:
        ring = Ring(group)
        r, n = ring.rank, ring.size
        kv = torch.stack([k, v])  # one message per step: K and V of the same tokens
        out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        for step in range(n):
            owner = (r - step) % n
            if step < n - 1:  # the next block is on its way while this one is computed
                works, incoming = ring.post(kv, _block_shape(kv, held, (owner - 1) % n))
            rows, cols = visible_rectangle(held[r], held[owner], causal)
            if len(rows) and len(cols):  # a block entirely in this rank's future (causal) costs nothing
                q_pos, k_pos = _mask(held[r][rows], held[owner][cols], causal)
                rows, cols = rows.to(q.device), cols.to(q.device)
                kv_part = kv[:, :, :, cols]
                block_out, block_lse = block_attention(q[:, :, rows], kv_part[0], kv_part[1], q_pos, k_pos)
                out[:, :, rows], lse[:, :, rows] = merge_partials(
                    out[:, :, rows], lse[:, :, rows], block_out, block_lse
                )
            if trace is not None:
                trace.append(_step(held[r], held[owner], causal, step, owner, rows, cols))
            if step < n - 1:
                _wait(works)
                kv = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.held, ctx.causal, ctx.group, ctx.trace = held, causal, group, trace
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        held, causal = ctx.held, ctx.causal
        ring = Ring(ctx.group)
        r, n = ring.rank, ring.size
        delta = (dout * out).sum(-1, keepdim=True)  # Σ_j P_ij dP_ij, FlashAttention's D
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)  # the gradients of the K/V block this rank holds, travelling with it
        for step in range(n):
            owner, upstream = (r - step) % n, (r - step - 1) % n
            if step < n - 1:
                works, incoming = ring.post(kv, _block_shape(kv, held, upstream))
            rows, cols = visible_rectangle(held[r], held[owner], causal)
            if len(rows) and len(cols):
                q_pos, k_pos = _mask(held[r][rows], held[owner][cols], causal)
                rows, cols = rows.to(q.device), cols.to(q.device)
                q_rows, dout_rows = q[:, :, rows], dout[:, :, rows]
                k_cols, v_cols = kv[0][:, :, cols], kv[1][:, :, cols]
                scores = _scores(q_rows, k_cols, q_pos, k_pos)
                p = torch.exp(scores - lse[:, :, rows].unsqueeze(-1))  # the final probabilities of these keys
                ds = p * (dout_rows @ v_cols.transpose(-2, -1) - delta[:, :, rows]) * q.shape[-1] ** -0.5
                dq[:, :, rows] += ds @ k_cols
                dkv[0][:, :, cols] += ds.transpose(-2, -1) @ q_rows
                dkv[1][:, :, cols] += p.transpose(-2, -1) @ dout_rows
            if ctx.trace is not None:
                ctx.trace.append(_step(held[r], held[owner], causal, step, owner, rows, cols, "backward"))
            if n > 1:  # N hops in all: after the last one, every block's dK/dV is back with its owner
                dkv_works, dkv = ring.post(dkv, _block_shape(kv, held, upstream))
                _wait(dkv_works)
            if step < n - 1:
                _wait(works)
                kv = incoming
        return dq, dkv[0], dkv[1], None, None, None, None


def _block_shape(kv: torch.Tensor, held: list[torch.Tensor], owner: int) -> tuple[int, ...]:
    shape = list(kv.shape)
    shape[-2] = len(held[owner])  # blocks differ by a token when the length does not split evenly
    return tuple(shape)


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (q_pos, k_pos) if causal else (None, None)


def _step(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    causal: bool,
    step: int,
    owner: int,
    rows: torch.Tensor,
    cols: torch.Tensor,
    phase: str = "forward",
) -> dict:
    """A trace entry: the block this rank held at `step`, the pairs the mask keeps and the pairs computed."""
    kept = causal_pairs(q_pos, k_pos) if causal else len(q_pos) * len(k_pos)
    return dict(phase=phase, step=step, owner=owner, pairs=kept, computed=len(rows) * len(cols))


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    held: list[torch.Tensor],
    *,
    causal: bool = True,
    group: dist.ProcessGroup | None = None,
    trace: list[dict] | None = None,
) -> torch.Tensor:
    """This rank's rows of softmax(QKᵀ/√d)V over the whole sequence; q, k, v: (batch, heads, its tokens, d)."""
    return RingAttention.apply(q, k, v, held, causal, group, trace)


def sent_by_kind(rec: comms.Recorder) -> dict[str, int]:
    """Bytes this rank's ring attention sent by kind (cost.ring_bytes' keys), from a recorder around fwd and bwd."""
    sends = [c for c in rec.calls if c.op == "send"]
    backward = [c for c in sends if c.phase == "backward"]
    per_layer = 2 * len(backward[0].group) - 1 if backward else 1
    if len(backward) % per_layer:
        raise ValueError(f"{len(backward)} backward sends are not whole layers of {per_layer}")
    sent = {"forward K/V": sum(c.nbytes for c in sends if c.phase == "forward"), "backward K/V": 0, "backward dK/dV": 0}
    for i, c in enumerate(backward):
        place = i % per_layer
        sent["backward K/V" if place % 2 == 0 and place < per_layer - 1 else "backward dK/dV"] += c.nbytes
    return sent


class ContextParallelAttention(nn.Module):
    """models.Attention with the sequence split over `group`: q, k, v of my tokens, ring attention, o."""

    def __init__(self, full: Attention, held: list[torch.Tensor], group: dist.ProcessGroup | None = None):
        super().__init__()
        self.q, self.k, self.v, self.o, self.head_dim = full.q, full.k, full.v, full.o, full.head_dim
        self.held, self.group = held, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens = x.shape[0], x.shape[1]

        def heads(t: torch.Tensor) -> torch.Tensor:  # (b, s, width) -> (b, heads, s, head_dim)
            return t.view(batch, tokens, -1, self.head_dim).transpose(1, 2)

        y = ring_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), self.held, group=self.group)
        return self.o(y.transpose(1, 2).reshape(batch, tokens, -1))


class ContextParallelBlock(nn.Module):
    """TransformerBlock whose attention is ContextParallelAttention; everything else as it was."""

    def __init__(self, full: TransformerBlock, held: list[torch.Tensor], group: dist.ProcessGroup | None = None):
        super().__init__()
        self.norm1, self.norm2, self.dropout1, self.dropout2 = full.norm1, full.norm2, full.dropout1, full.dropout2
        self.attention = ContextParallelAttention(full.attention, held, group)
        self.feed_forward = full.feed_forward

    forward = TransformerBlock.forward


def sum_gradients(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """All-reduce (sum) every parameter gradient over `group`: each rank held the part from its tokens."""
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
