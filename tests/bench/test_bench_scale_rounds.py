"""bench/bench_scale.py: sizes run in alternating rounds and are pooled, not one run each in a fixed order."""

from __future__ import annotations

import pytest

from bench.bench_scale import pooled
from bench.equal_terms import round_order


def run(wall, tokens, steady, peak):
    return {"size": 5, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "steady_tokens_per_s": steady,
            "driver_peak_mib": peak, "cluster_peak_mib": 2 * peak, "spilled_bytes": 0}


def test_sizes_alternate_between_rounds():
    assert round_order([20_000, 200_000, 2_000_000], 2) == [[20_000, 200_000, 2_000_000], [2_000_000, 200_000, 20_000]]


def test_a_size_pools_its_rounds():
    p = pooled([run(10.0, 1000, 200.0, 100.0), run(30.0, 1000, 100.0, 150.0)])
    assert p["tokens_per_s"] == pytest.approx(2000 / 40)  # all tokens over all seconds, not a mean of rates
    assert p["steady_tokens_per_s"] == pytest.approx(2000 / (5 + 10))
    assert (p["driver_peak_mib"], p["cluster_peak_mib"], p["rounds"]) == (150.0, 300.0, 2)
