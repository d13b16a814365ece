"""A rollout's phase record (serve/promotion/rollout_phases.py): consecutive phases that add up to its duration.
The record a real rollout writes on its run is held in tests/serve/test_rollout.py."""

from __future__ import annotations

import pytest

from serve.promotion.rollout_phases import METRIC_PREFIX, PHASES, PhaseClock, phases_of


def test_phases_add_up_to_the_time_from_start_to_the_last_mark():
    clock = PhaseClock(start=100.0)
    for phase, at in (("gate", 100.5), ("apply", 100.75), ("build", 110.0), ("replica_start", 118.0),
                      ("healthy", 118.25), ("verify", 118.5), ("record", 119.0)):
        clock.mark(phase, at=at)
    assert clock.seconds == {"gate": 0.5, "apply": 0.25, "build": 9.25, "replica_start": 8.0, "healthy": 0.25,
                             "verify": 0.25, "record": 0.5}
    assert clock.total == 19.0 == sum(clock.seconds.values())
    assert clock.line().startswith("gate 0.5s, apply 0.2s, build 9.2s")


def test_a_phase_marked_again_adds_up_and_time_never_runs_back():
    clock = PhaseClock(start=0.0)
    clock.mark("healthy", at=2.0)
    clock.mark("verify", at=1.0)  # a clock read before the last mark: the phase gets 0, never a negative share
    clock.mark("healthy", at=5.0)
    assert clock.seconds == {"healthy": 5.0, "verify": 0.0} and clock.total == 5.0


def test_the_run_metrics_round_trip_in_phase_order():
    clock = PhaseClock(start=0.0)
    clock.mark("gate", at=1.0)
    clock.mark("rollback", at=4.0)
    clock.mark("record", at=4.5)
    metrics = clock.metrics()
    assert metrics == {f"{METRIC_PREFIX}gate": 1.0, f"{METRIC_PREFIX}rollback": 3.0, f"{METRIC_PREFIX}record": 0.5}
    assert list(phases_of({**metrics, "duration_s": 4.5, "gate_s": 1.0})) == ["gate", "rollback", "record"]
    assert set(PHASES) >= set(phases_of(metrics))


def test_an_unknown_phase_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown rollout phase 'deploy'"):
        PhaseClock().mark("deploy")
