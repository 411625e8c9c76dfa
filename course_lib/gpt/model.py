"""A small decoder-only transformer (GPT) built from the course's TransformerBlock."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from course_lib import models
from course_lib.models import ModelShape, TransformerBlock


@dataclass(frozen=True)
class GPTConfig:
    """Model sizes: defaults (0.4 M params) train on two CPU cores in budget; 8 heads of 16 split over tp = 2, 4, 8."""

    vocab: int  # distinct characters of the text
    d_model: int = 128
    n_heads: int = 8
    n_layers: int = 2  # blocks: one per stage with pp = 2
    seq: int = 64  # characters of context
    seed: int = 0

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model


def token_table(config: GPTConfig) -> torch.Tensor:
    """Initial table, N(0, 0.1²) for logits ~1: GPT-2's 0.02 stalls a model this small on the unigram plateau."""
    g = torch.Generator().manual_seed(config.seed)
    return torch.randn(config.vocab, config.d_model, generator=g) * 0.1


class Embeddings(nn.Module):
    """Token and position embeddings, added: the first stage of the model."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab, config.d_model)
        self.positions = nn.Embedding(config.seq, config.d_model)
        g = torch.Generator().manual_seed(config.seed + 1)
        with torch.no_grad():
            self.tokens.weight.copy_(token_table(config))
            self.positions.weight.copy_(torch.randn(config.seq, config.d_model, generator=g) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        where = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tokens(tokens) + self.positions(where)


class Head(nn.Module):
    """The final LayerNorm and the output projection onto the vocabulary, with the token table's weight.

    `tied`: the Embeddings' table (one parameter, two uses) or None for a pipeline's last stage, which holds
    its own copy (same initial values; the stages add their gradients, see layouts.sync_tied_gradients).
    """

    def __init__(self, config: GPTConfig, tied: torch.Tensor | None = None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.d_model)
        self.output = nn.Linear(config.d_model, config.vocab, bias=False)
        with torch.no_grad():
            self.output.weight.copy_(token_table(config))
        if tied is not None:
            self.output.weight = tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))


def make_blocks(config: GPTConfig, layers: range | None = None) -> nn.Sequential:
    """The transformer blocks `layers` (default all), each seeded by its index: same weights wherever built."""
    layers = range(config.n_layers) if layers is None else layers
    return nn.Sequential(
        *[TransformerBlock(config.d_model, config.n_heads, config.d_ff, seed=config.seed + 100 + i) for i in layers]
    )


class GPT(nn.Module):
    """The whole model (first=last=True) or a pipeline stage of it: embeddings only on the first, head on the last."""

    def __init__(
        self, config: GPTConfig, blocks: nn.Sequential | None = None, first: bool = True, last: bool = True
    ) -> None:
        super().__init__()
        self.config = config
        self.embed = Embeddings(config) if first else None
        self.blocks = make_blocks(config) if blocks is None else blocks
        self.head = Head(config, tied=self.embed.tokens.weight if self.embed is not None else None) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        x = self.blocks(x)
        return self.head(x) if self.head is not None else x


def pipeline_stage(config: GPTConfig, stage: int, n_stages: int) -> GPT:
    """Stage `stage`: its blocks, embeddings on the first, head on the last (with its own tied-table copy)."""
    from course_lib.compose import stage_blocks

    blocks = stage_blocks(make_blocks(config), stage, n_stages)
    return GPT(config, blocks, first=stage == 0, last=stage == n_stages - 1)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in nats per character, over every position of every sequence."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def count_parameters(config: GPTConfig) -> dict[str, int]:
    """Parameters of the whole model by part: the tied table counted once."""
    d, v, f, s = config.d_model, config.vocab, config.d_ff, config.seq
    block = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 4 * d  # q k v o, up, down, two LayerNorms
    parts = {"token table": v * d, "positions": s * d, "blocks": config.n_layers * block, "final norm": 2 * d}
    parts["total"] = sum(parts.values())
    parts["matmul"] = v * d + config.n_layers * (4 * d * d + 2 * d * f)  # weights of every matrix multiply
    return parts


def flops_per_token(config: GPTConfig) -> int:
    """models.flops_per_token with the matmul weights as parameters: 6 per weight + 12·n_layers·d_model·seq."""
    shape = ModelShape(count_parameters(config)["matmul"], config.n_layers, config.d_model, config.n_heads, config.seq)
    return int(models.flops_per_token(shape))


@torch.no_grad()
def sample(model: GPT, prompt: torch.Tensor, n_new: int, temperature: float = 0.8, seed: int = 0) -> torch.Tensor:
    """`n_new` tokens after `prompt` (1-D), each drawn from the softmax of the last position's logits."""
    g = torch.Generator(device=prompt.device).manual_seed(seed)
    tokens = prompt.clone()
    for _ in range(n_new):
        window = tokens[-model.config.seq :].unsqueeze(0)
        probs = torch.softmax(model(window)[0, -1] / temperature, dim=-1)
        tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=g)])
    return tokens
