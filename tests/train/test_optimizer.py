"""Warmup + cosine learning-rate schedule."""

import pytest

from train.optimizer import lr_factor


def test_warmup_then_cosine_to_the_floor():
    factors = [lr_factor(s, warmup_steps=4, total_steps=20, min_lr_ratio=0.1) for s in range(21)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == pytest.approx(1.0)
    assert factors[12] == pytest.approx(0.55)  # halfway through the decay
    assert factors[20] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))


def test_no_warmup_starts_at_peak():
    assert lr_factor(0, 0, 10, 0.0) == pytest.approx(1.0)
    assert lr_factor(10, 0, 10, 0.0) == pytest.approx(0.0)
