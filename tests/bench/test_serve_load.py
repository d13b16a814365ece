"""The serving benches' load: request lengths, the same for every server."""

from __future__ import annotations

import pytest

from bench.serve_load import lengths


def test_without_spread_every_request_has_the_same_length():
    assert lengths(5, 128, 0.0) == [128] * 5


def test_a_spread_draws_lengths_around_max_tokens_the_same_for_every_server():
    drawn = lengths(512, 128, 0.25)
    assert drawn == lengths(512, 128, 0.25)  # seeded: both sides of a comparison get this list
    assert min(drawn) >= 96 and max(drawn) <= 160 and len(set(drawn)) > 30
    assert abs(sum(drawn) / len(drawn) - 128) < 4  # the same mean work as the lockstep load
    assert lengths(512, 128, 0.25, seed=1) != drawn


@pytest.mark.parametrize("spread", [-0.1, 1.0, 1.5])
def test_a_spread_outside_0_to_1_is_refused(spread):
    with pytest.raises(ValueError, match=f"spread must be in \\[0, 1\\), got {spread}"):
        lengths(4, 128, spread)
