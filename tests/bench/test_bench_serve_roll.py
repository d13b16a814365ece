"""bench/bench_serve.py: what a rollout costs the users on the app while it rolls."""

from __future__ import annotations

from bench.bench_serve import roll_cost


def test_answers_before_and_during_the_roll_and_the_failures():
    start, took = 100.0, 10.0
    # (sent, answered, version): 16 answers in the 8 s before (one from the warm-up left out), 5 during, one after.
    seen = [(90.0, 91.0, "m/1")] + [(92.0 + i / 2, 92.1 + i / 2, "m/1") for i in range(16)]
    seen += [(101.0 + i, 101.5 + i, "m/2") for i in range(5)] + [(111.0, 112.0, "m/2")]
    line = roll_cost(seen, ["APIConnectionError: reset"], start, took, 3)
    assert line.startswith("during the roll (3 clients of 6-token chats): 5 answered, 1 failed (target 0); ")
    assert "answers/s 2.0 in the 8 s before, 0.5 during" in line and "APIConnectionError" in line
