"""The serving benches' load: request lengths, the same for every server."""

from __future__ import annotations

import pytest

from bench.serve_load import LoadResult, lengths, tail_note, timed_ttfts


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


def test_a_steady_flow_leaves_each_clients_opening_request_out_of_ttft_and_lockstep_keeps_all():
    # (the request's place among its client's requests, TTFT): two clients' opening burst, then their later requests
    samples = [(0, 0.50), (0, 0.60), (1, 0.09), (1, 0.11), (2, 0.10)]
    assert timed_ttfts(samples, 0.25) == [0.09, 0.11, 0.10]
    assert timed_ttfts(samples, 0.0) == [0.50, 0.60, 0.09, 0.11, 0.10]  # lockstep: every wave is a burst, all count


def pooled(concurrency: int, samples: int) -> LoadResult:
    return LoadResult(concurrency, 0, 1000.0, 0.1, 0.2, 0, ttfts=[0.1] * samples)


def test_a_p99_on_too_few_samples_is_named_with_the_requests_that_give_enough():
    # 2026-12-06: --requests 128 --spread 0.25 --rounds 4 at 64 streams: 2 requests per client, one timed: 256 TTFTs.
    note = tail_note(pooled(64, 256), rounds=4, spread=0.25, label="rayline")
    assert note == ("note: TTFT p99 of rayline at 64 streams is the 4th-slowest of 256 samples: one slow request moves "
                    "it; --requests 189 gives 500 or more"), note
    # 189 requests a round, each client's first untimed: 4 x (189 - 64) = 500.
    assert tail_note(pooled(64, 4 * (189 - 64)), rounds=4, spread=0.25, label="rayline") is None
    # Lockstep times every request: 4 x 125 = 500.
    assert "--requests 125 gives" in tail_note(pooled(32, 128), rounds=4, spread=0.0, label="vllm server")
    assert "is the slowest of 50 samples" in tail_note(pooled(8, 50), rounds=2, spread=0.0, label="rayline")
    assert tail_note(pooled(64, 768), rounds=4, spread=0.25, label="rayline") is None
