"""The test-only fault injector fires once, on one rank, at one step."""

import pytest

from train import fault_injection


class Killed(Exception):
    pass


def test_fires_once_on_the_chosen_rank(monkeypatch, tmp_path):
    marker = tmp_path / "fired"
    monkeypatch.setenv("RAYLINE_FAULT_AT_STEP", "5")
    monkeypatch.setenv("RAYLINE_FAULT_MARKER", str(marker))
    monkeypatch.setattr(fault_injection.os, "_exit", lambda code: (_ for _ in ()).throw(Killed(code)))
    fault_injection.maybe_kill_worker(4, rank=1, world_size=2)  # wrong step
    fault_injection.maybe_kill_worker(5, rank=0, world_size=2)  # default target is the last rank
    assert not marker.exists()
    with pytest.raises(Killed):
        fault_injection.maybe_kill_worker(5, rank=1, world_size=2)
    assert marker.exists()
    fault_injection.maybe_kill_worker(5, rank=1, world_size=2)  # the restarted worker passes


def test_off_without_the_env_var(monkeypatch):
    monkeypatch.delenv("RAYLINE_FAULT_AT_STEP", raising=False)
    fault_injection.maybe_kill_worker(5, rank=1, world_size=2)
