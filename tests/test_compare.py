"""course_lib.compare: its comparisons take tensors from two devices (a GPU result against a CPU reference)."""

from __future__ import annotations

import pytest
import torch

from course_lib import compare

META = torch.device("meta")  # a second device on a machine without a GPU


def test_relative_error_is_max_difference_over_the_scale_floored_at_one():
    expected = torch.tensor([0.5, -4.0, 2.0])
    got = expected + torch.tensor([0.0, 0.002, -0.001])
    assert compare.relative_error(got, expected) == pytest.approx(0.002 / 4.0, rel=1e-4)  # float32
    small = torch.tensor([1e-3, 0.0])
    assert compare.relative_error(small + 1e-6, small) == pytest.approx(1e-6, rel=1e-3)  # not 1e-6 / 1e-3


def test_relative_error_and_max_difference_compare_on_the_references_device():
    """`got` moves to `expected`'s device: the arithmetic runs on meta, and only reading the number fails there
    (instead of "Tensor on device meta is not on the expected device cpu")."""
    got, expected = torch.ones(3), torch.ones(3, device=META)
    for compared in (compare.relative_error, compare.max_difference):
        with pytest.raises(RuntimeError, match=r"Tensor\.item\(\) cannot be called on meta tensors"):
            compared(got, expected)
