"""Tiny deterministic models shared by the notebooks, and the shape of any transformer (ModelShape)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class ModelShape:
    """A transformer's sizes and its training sequences, from the course's block (BLOCK) to Llama 3 (compose.planner);
    n_params None counts the shape."""

    n_params: float | None
    n_layers: int
    d_model: int
    n_heads: int
    seq: int = 4096
    micro_batch: float = 1
    # activation all-reduces per layer and micro-batch: 2 forward, 2 backward with fused qkv (Megatron);
    # the course's block has separate q, k, v: their input gradients are all-reduced one by one (6)
    tp_all_reduces: int = 4
    kv_heads: int | None = None
    d_ff: int = 0  # 0: 4 x d_model
    glu: bool = False
    vocab: int = 0
    tied: bool = True
    dropout: bool = True

    @property
    def kv_ratio(self) -> float:
        return (self.kv_heads or self.n_heads) / self.n_heads

    @property
    def ffn(self) -> int:
        return self.d_ff or 4 * self.d_model


def parameters(m: ModelShape) -> float:
    """Weight count from the shape: attention (GQA), MLP (2 or 3 matrices), norms, embedding and an untied head."""
    if m.n_params is not None:
        return m.n_params
    h = m.d_model
    layer = 2 * h * h * (1 + m.kv_ratio) + (3 if m.glu else 2) * h * m.ffn + 2 * h
    return m.n_layers * layer + outer_parameters(m)


def outer_parameters(m: ModelShape) -> float:
    """The parameters outside the layers: the embedding table, the head unless tied, the final norm."""
    return m.vocab * m.d_model * (1 if m.tied else 2) + (m.d_model if m.vocab else 0)


def flops_per_token(m: ModelShape) -> float:
    """Training FLOPs per token as torchtitan counts them for MFU: 6 per matmul weight plus 12·L·h·s of attention."""
    lookup = 0 if m.tied else m.vocab * m.d_model
    return 6 * (parameters(m) - lookup) + 12 * m.n_layers * m.d_model * m.seq


# The course's block: 48 wide, 12 heads of 4, 192 hidden units. 12 heads split over 1, 2, 3, 4, 6 and 12 ranks.
BLOCK = ModelShape(None, n_layers=1, d_model=48, n_heads=12, d_ff=192, tp_all_reduces=6)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Draw the block's weights from `seed` (same on every rank), leaving the global generator the data uses alone."""
    with torch.random.fork_rng(devices=[]):  # the CPU generator: the course's models initialise on the CPU
        torch.default_generator.manual_seed(seed)
        yield


class MLP(nn.Sequential):
    """`n_layers` blocks of Linear + GELU, then a Linear head. Seeded: same weights on every rank."""

    def __init__(self, d_in: int = 32, d_hidden: int = 64, d_out: int = 8, n_layers: int = 4, seed: int = 0):
        layers: list[nn.Module] = []
        width = d_in
        with seeded(seed):
            for _ in range(n_layers):
                layers += [nn.Linear(width, d_hidden), nn.GELU()]
                width = d_hidden
            layers.append(nn.Linear(width, d_out))
        super().__init__(*layers)


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def world_mesh() -> DeviceMesh:
    """A 1-D mesh of every rank on rank_device(): FSDP2's default mesh would put a gloo rank that sees a GPU on CUDA."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from course_lib.launch.runtime import rank_device

    return init_device_mesh(rank_device().type, (dist.get_world_size(),))


def shard_layers_then_root(
    model: nn.Module, layers: Iterable[nn.Module] | None = None, *, reshard_after_forward: bool = True, **options: Any
) -> nn.Module:
    """FSDP2's usual wrapping: `fully_shard` each layer as a unit of its own, then the root.

    A unit's parameters are all-gathered together, just before it runs. The root takes the parameters
    no layer claimed and drives the schedule. `layers` defaults to the model's Linear children;
    `options` (mesh=, mp_policy=, ...) apply to every unit, the root included. Without a mesh, the units
    shard over every rank on this rank's device (:func:`world_mesh`).
    """
    from torch.distributed.fsdp import fully_shard

    if options.get("mesh") is None:
        options["mesh"] = world_mesh()
    if layers is None:
        layers = [m for m in model.children() if isinstance(m, nn.Linear)]
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, **options)
    return model


class Attention(nn.Module):
    """Causal multi-head self-attention; heads come from q's output width, so the same forward runs column-sharded."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.head_dim = d_model // n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1]

        def heads(t: torch.Tensor) -> torch.Tensor:  # (b, s, width) -> (b, heads, s, head_dim)
            return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        y = nn.functional.scaled_dot_product_attention(
            heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True
        )
        return self.o(y.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """Linear up to d_ff, GELU, Linear down to d_model."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class TransformerBlock(nn.Module):
    """A pre-norm transformer block: x + attention(norm1(x)), then + feed_forward(norm2(x))."""

    def __init__(
        self,
        d_model: int = BLOCK.d_model,
        n_heads: int = BLOCK.n_heads,
        d_ff: int = BLOCK.d_ff,
        dropout: float = 0.0,
        seed: int = 0,
    ):
        super().__init__()
        with seeded(seed):
            self.norm1 = nn.LayerNorm(d_model)
            self.attention = Attention(d_model, n_heads)
            self.norm2 = nn.LayerNorm(d_model)
            self.feed_forward = FeedForward(d_model, d_ff)
        # two modules, not one called twice: module trackers such as CommDebugMode expect one call per module
        self.dropout1, self.dropout2 = nn.Dropout(dropout), nn.Dropout(dropout)
        self.n_heads = n_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout1(self.attention(self.norm1(x)))
        return x + self.dropout2(self.feed_forward(self.norm2(x)))
