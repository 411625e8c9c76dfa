"""Notebook 01: what a collective costs, in bytes sent per rank and in the alpha-beta time model."""

from __future__ import annotations

from collections.abc import Sequence

from course_lib import comms


def bytes_sent_per_rank(collective: str, nbytes: float, world_size: int) -> float:
    """Bytes each rank sends, for a tensor of `nbytes` (the full, unsharded size), ring algorithms."""
    if collective == "naive_all_reduce":
        return float(world_size - 1) * nbytes
    return comms.sent_per_rank(collective.removeprefix("ring_"), nbytes, world_size)


# nccl-tests' bus factors (its doc/PERFORMANCE.md): what makes a collective's bus bandwidth comparable to a link's
# peak. They differ from bytes sent per rank (comms.RING) where the payload is counted another way: a reduce's busbw
# is its algbw (the root receives the whole tensor), an all-to-all's is (N-1)/N of it (a rank keeps its own block).
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send": lambda n: 1.0,
}


def bus_factor(collective: str, world_size: int) -> float:
    """nccl-tests' bus bandwidth = algorithm bandwidth x this factor (size = the full tensor)."""
    return BUS_FACTOR[collective.removeprefix("ring_").removeprefix("naive_")](world_size)


def alpha_beta_time(collective: str, nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """The alpha-beta model: messages × alpha (latency, s) + bytes sent × beta (s per byte = 1/bandwidth).

    Ring all-reduce sends 2(N-1) messages, all_gather / reduce_scatter N-1, broadcast (chain) N-1.
    """
    n = world_size
    messages = {
        "all_reduce": 2 * (n - 1),
        "ring_all_reduce": 2 * (n - 1),
        "all_gather": n - 1,
        "reduce_scatter": n - 1,
        "broadcast": n - 1,
        "naive_all_reduce": 2 * (n - 1),
    }[collective]
    return messages * alpha + bytes_sent_per_rank(collective, nbytes, n) * beta


def fit_alpha_beta(
    collective: str, nbytes: Sequence[float], seconds: Sequence[float], world_size: int
) -> tuple[float, float]:
    """Fit alpha (s) and beta (s/byte) of :func:`alpha_beta_time` to measured times.
    Least squares on the relative error, so the small messages (alpha) count as much as the large ones (beta)."""
    import numpy as np

    messages = alpha_beta_time(collective, 1.0, world_size, 1.0, 0.0)
    per_byte = bytes_sent_per_rank(collective, 1.0, world_size)
    t = np.asarray(seconds, dtype=float)
    design = np.stack([np.full_like(t, messages), np.asarray(nbytes, float) * per_byte], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    return max(float(alpha), 0.0), max(float(beta), 0.0)
