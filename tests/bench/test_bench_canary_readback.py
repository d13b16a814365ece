"""bench/bench_canary.py: the first challenger answer timed from the alias set, must-match keys read from the run."""

from __future__ import annotations

import math

from bench.bench_canary import MUST_MATCH, first_answer_s, read_back
from bench.equal_terms import ratio_line
from bench.serve_load import LoadResult


def load(answered_by: dict[str, int], failed: int = 0) -> LoadResult:
    return LoadResult(8, 24, 100.0, 0.1, 0.2, failed, tokens=384, wall_s=3.84, answered_by=answered_by)


def test_first_answer_counts_from_the_alias_set_to_the_answer_in():
    # Sent before the alias was set, answered by the challenger after: the answer's time is what counts.
    assert first_answer_s(100.0, [112.5, 104.0, 130.0]) == 4.0
    assert math.isnan(first_answer_s(100.0, []))


def test_a_side_answered_by_another_version_gives_no_ratio():
    # The side names v2 but v1 signed some answers: its engine is not read back, so no ratio.
    ours = read_back(load({"m/2": 20, "m/1": 4}), {}, "m/2")
    theirs = read_back(load({"m/2": 24}), {}, "m/2")
    assert ours["answered by"] == "m/1 x4, m/2 x20"
    line = ratio_line("canary off", 1.0, ours, theirs, MUST_MATCH)
    assert line.startswith("rayline vs canary off: no ratio") and "answered by" in line and "engine" in line


def test_the_load_is_what_the_clients_completed():
    ours, theirs = read_back(load({"m/2": 23}, failed=1), {}, "m/2"), read_back(load({"m/2": 24}), {}, "m/2")
    assert ours["load"] == "23 of 24 requests answered, 384 output tokens, 8 clients"
    assert "load (rayline 23 of 24" in ratio_line("canary off", 1.0, ours, theirs, MUST_MATCH)
