"""Expert parallelism on paper: bytes per all-to-all, capacity, dropped tokens, load imbalance.

Notation: T tokens per rank, k experts per token, E experts over N ranks (E/N each), d model width, e bytes
per element, capacity factor c_f.

* capacity C = ceil(c_f · T·k / E) assignments per expert and batch (router.capacity).
* dispatch sends every kept assignment's token to its expert's rank. With balanced routing the share for my own
  experts is 1/N, so each rank sends T·k·(N-1)/N rows of d·e bytes; combine sends as many back. Whatever the
  routing, a remote expert takes at most C rows from me: at most C·E·(N-1)/N rows.
* dropped assignments: Σ_e max(0, n_e - C), n_e the assignments routed to expert e.
* imbalance: max_e n_e / mean_e n_e (1 is perfect; the busiest expert sets the step time).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def all_to_all_bytes_balanced(tokens: int, top_k: int, world_size: int, d_model: int, element_size: int) -> float:
    """Bytes one rank sends to the others in one dispatch when routing is balanced: T·k·(N-1)/N·d·e."""
    return tokens * top_k * (world_size - 1) / world_size * d_model * element_size


def all_to_all_bytes_bound(cap: int, n_experts: int, world_size: int, d_model: int, element_size: int) -> float:
    """The most bytes one rank can send in one dispatch: C rows to each of the E·(N-1)/N remote experts."""
    return cap * n_experts * (world_size - 1) / world_size * d_model * element_size


def dropped(routed_per_expert: torch.Tensor | Sequence[int], cap: int) -> int:
    """Σ_e max(0, n_e - C): the assignments over capacity."""
    return int(sum(max(0, int(n) - cap) for n in routed_per_expert))


def imbalance(routed_per_expert: torch.Tensor) -> float:
    """max_e n_e / mean_e n_e."""
    counts = routed_per_expert.double()
    return float(counts.max() / counts.mean())


def balanced_batch(tokens: int, n_experts: int, d_model: int) -> torch.Tensor:
    """Tokens a router whose weights are the identity sends evenly: token t to experts t and t + 1 (mod E).

    x_t = 2·u_{t mod E} + u_{(t+1) mod E} (u_i the unit vectors): the router's logits are x_t's first E
    coordinates, so its top-2 are exactly those experts; with T a multiple of E every expert gets 2T/E.
    """
    if d_model < n_experts:
        raise ValueError(f"balanced_batch needs d_model >= n_experts, got {d_model} < {n_experts}")
    x = torch.zeros(tokens, d_model)
    t = torch.arange(tokens)
    x[t, t % n_experts] = 2.0
    x[t, (t + 1) % n_experts] = 1.0
    return x
