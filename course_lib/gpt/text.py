"""The capstone's data: the notebooks' prose as characters (course_text.txt, tools/course_text.py); a rank's loader."""

from __future__ import annotations

import math
from collections import Counter
from functools import lru_cache
from pathlib import Path

import torch

SNAPSHOT = Path(__file__).with_name("course_text.txt")  # written by tools/course_text.py

VAL_FRACTION = 0.1


@lru_cache(maxsize=1)
def course_text() -> str:
    """The committed snapshot of the course's prose."""
    return SNAPSHOT.read_text(encoding="utf-8")


class CharTokenizer:
    """One token per distinct character of the text, in sorted order: vocab = len(chars)."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, tokens: torch.Tensor | list[int]) -> str:
        return "".join(self.chars[int(t)] for t in tokens)


@lru_cache(maxsize=1)
def tokens_and_tokenizer() -> tuple[torch.Tensor, CharTokenizer]:
    text = course_text()
    tokenizer = CharTokenizer(text)
    return tokenizer.encode(text), tokenizer


def split() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) token streams: the first 90% of the text and the last 10%."""
    tokens, _ = tokens_and_tokenizer()
    cut = round(len(tokens) * (1 - VAL_FRACTION))
    return tokens[:cut], tokens[cut:]


class ShardedBatches:
    """The global batch of any step, and this data-parallel rank's rows of it.

    ``batches = ShardedBatches(train, seq=64, global_batch=16, dp_rank=d, dp_size=dp)``;
    ``x, y = batches(step)``: this rank's inputs and targets (y is x shifted by one character).
    """

    def __init__(
        self, tokens: torch.Tensor, seq: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not one of the {dp_size} data-parallel ranks")
        if global_batch < dp_size:
            raise ValueError(f"a global batch of {global_batch} sequences leaves some of {dp_size} dp ranks empty")
        self.tokens, self.seq, self.global_batch = tokens, seq, global_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed

    def starts(self, step: int) -> torch.Tensor:
        """Where each of the step's windows starts: every rank draws the same, whatever it will keep."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, len(self.tokens) - self.seq - 1, (self.global_batch,), generator=g)

    def rows(self) -> range:
        """Which rows of the global batch this rank holds."""
        sizes = [len(part) for part in torch.arange(self.global_batch).tensor_split(self.dp_size)]
        first = sum(sizes[: self.dp_rank])
        return range(first, first + sizes[self.dp_rank])

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        mine = self.starts(step)[self.rows().start : self.rows().stop]
        windows = torch.stack([self.tokens[s : s + self.seq + 1] for s in mine.tolist()])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # a pipeline stage checks strides too


def validation_windows(val: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole validation text as consecutive windows of `seq` characters (inputs, targets)."""
    n = (len(val) - 1) // seq
    return val[: n * seq].view(n, seq), val[1 : n * seq + 1].view(n, seq)


def entropy_baselines(tokens: torch.Tensor) -> dict[str, float]:
    """Nats per character of untrained models (uniform, unigram, bigram): loss below unigram means context is used."""
    counts = Counter(tokens.tolist())
    n = len(tokens)
    unigram = -sum(c / n * math.log(c / n) for c in counts.values())
    pairs = Counter(zip(tokens[:-1].tolist(), tokens[1:].tolist()))
    firsts = Counter(tokens[:-1].tolist())
    bigram = -sum(c / (n - 1) * math.log(c / firsts[a]) for (a, _), c in pairs.items())
    return {"uniform": math.log(len(tokens_and_tokenizer()[1].chars)), "unigram": unigram, "bigram": bigram}
