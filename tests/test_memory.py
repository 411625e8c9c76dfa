"""course_lib.memory: the ZeRO calculator's formulas, the sharding arithmetic, and byte counting
on a single-process model (the multi-rank counts are checked in test_fsdp.py)."""

from __future__ import annotations

import pytest
import torch

from course_lib import memory
from course_lib.models import MLP


def test_70b_on_64_gpus():
    rows = memory.calculator_table(70e9, 64)  # mixed-precision Adam: 2 + 2 + 12 bytes
    assert rows[0]["total"] == pytest.approx(1120.0)
    assert rows[3]["total"] == pytest.approx(17.5)  # 1120 / 64; "about 17.6" is within 1 %
    assert rows[1]["total"] == pytest.approx(140 + 140 + 840 / 64)
    assert rows[2]["total"] == pytest.approx(140 + (140 + 840) / 64)


@pytest.mark.parametrize("n", [1, 2, 3, 8, 64])
def test_stage_formulas(n):
    psi, p, g, k = 1000.0, 2, 2, 12
    b = [memory.zero_bytes_per_gpu(psi, n, s, p, g, k) for s in range(4)]
    assert b[0]["total"] == (p + g + k) * psi
    assert b[1] == {"params": p * psi, "grads": g * psi, "optimizer": k * psi / n, "total": (p + g) * psi + k * psi / n}
    assert b[2]["grads"] == g * psi / n and b[2]["params"] == p * psi
    assert b[3]["total"] == pytest.approx((p + g + k) * psi / n)
    assert [x["total"] for x in b] == sorted((x["total"] for x in b), reverse=True)  # each stage saves more
    if n == 1:
        assert all(x["total"] == b[0]["total"] for x in b)  # nothing to shard


@pytest.mark.parametrize(
    "optimizer, make",
    [
        ("Adam", lambda ps: torch.optim.Adam(ps)),
        ("SGD+momentum", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
        ("SGD", lambda ps: torch.optim.SGD(ps, lr=0.1)),
    ],
)
def test_precisions_are_the_bytes_torch_allocates(optimizer, make):
    """Bytes per parameter of weights, gradients and optimizer state, as torch holds them after one step."""
    model = torch.nn.Linear(8, 4)
    opt = make(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / n
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()) / n
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() > 0) / n
    assert memory.PRECISIONS["fp32"][optimizer] == (weights, grads, state)
    half = torch.bfloat16.itemsize  # 16-bit weights and gradients; the optimizer keeps an fp32 master copy
    assert memory.PRECISIONS["mixed (16-bit + fp32 master)"][optimizer] == (half, half, weights + state)


def test_zero_stages_are_0_to_3():
    with pytest.raises(ValueError):
        memory.zero_bytes_per_gpu(1, 1, 4)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_sharding_arithmetic(n):
    numels = [1485, 2070, 322]
    assert sum(memory.zero_numel(numels, n, r) for r in range(n)) == sum(numels)
    sizes = [memory.zero_numel(numels, n, r) for r in range(n)]
    assert max(sizes) - min(sizes) <= len(numels)  # at most one element per unit apart
    for shape in [(45, 32), (7, 45), (7,), (3,)]:
        parts = [memory.fully_shard_numel(shape, n, r) for r in range(n)]
        assert sum(parts) == torch.Size(shape).numel()
        assert parts == [c.numel() for c in torch.empty(shape).chunk(n)] + [0] * (n - len(torch.empty(shape).chunk(n)))
        assert all(memory.fully_shard_numel(shape, n, r, padded=True) >= parts[r] for r in range(n))


def test_held_bytes_single_process():
    model = MLP()
    psi = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters())
    assert memory.held_bytes(model, opt) == {"params": 4 * psi, "grads": 0, "optimizer": 0, "total": 4 * psi}
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    assert memory.held_bytes(model, opt) == {
        "params": 4 * psi,
        "grads": 4 * psi,
        "optimizer": 8 * psi,
        "total": 16 * psi,
    }
