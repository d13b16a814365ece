"""bench/bench_train.py's timed window: the slowest rank's wall clock, every rank read back."""

from __future__ import annotations

import pytest

from bench.bench_train import slowest_rank_seconds


def test_the_window_is_the_slowest_ranks():
    # Rank 1 waited on rank 0's hooks less than rank 0 spent in them: rank 0 is the run's clock here.
    assert slowest_rank_seconds([10.0, 10.5], [40.0, 39.0]) == pytest.approx(30.0)
    assert slowest_rank_seconds([10.0, 9.0], [40.0, 41.0]) == pytest.approx(32.0)


def test_ranks_that_did_not_all_report_give_no_window():
    with pytest.raises(ValueError, match="did not all report"):
        slowest_rank_seconds([1.0, 2.0], [3.0])
