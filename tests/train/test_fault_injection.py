"""The test-only fault injector fires once per chosen step, on one rank."""

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
    with pytest.raises(Killed, match="^137$"):  # the exit status of an OOM-killed process
        fault_injection.maybe_kill_worker(5, rank=1, world_size=2)
    assert marker.read_text() == "killed rank 1 after step 5\n"
    fault_injection.maybe_kill_worker(5, rank=1, world_size=2)  # the restarted worker passes


def test_each_listed_step_fires_once_across_restarts_and_resubmissions(monkeypatch, tmp_path):
    marker = tmp_path / "fired"
    monkeypatch.setenv("RAYLINE_FAULT_AT_STEP", "5,8")
    monkeypatch.setenv("RAYLINE_FAULT_MARKER", str(marker))
    monkeypatch.setattr(fault_injection.os, "_exit", lambda code: (_ for _ in ()).throw(Killed(code)))
    fired = []
    for attempt in range(3):  # the first group, the group restarted from step 3, the run submitted again from step 6
        for step in range((0, 4, 7)[attempt], 13):
            try:
                fault_injection.maybe_kill_worker(step, rank=1, world_size=2)
            except Killed:
                fired.append((attempt, step))
                break
    assert fired == [(0, 5), (1, 8)]
    assert marker.read_text() == "killed rank 1 after step 5\nkilled rank 1 after step 8\n"


def test_rank_env_var_picks_the_victim(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYLINE_FAULT_AT_STEP", "2")
    monkeypatch.setenv("RAYLINE_FAULT_RANK", "0")
    monkeypatch.setenv("RAYLINE_FAULT_MARKER", str(tmp_path / "fired"))
    monkeypatch.setattr(fault_injection.os, "_exit", lambda code: (_ for _ in ()).throw(Killed(code)))
    fault_injection.maybe_kill_worker(2, rank=3, world_size=4)
    with pytest.raises(Killed):
        fault_injection.maybe_kill_worker(2, rank=0, world_size=4)


@pytest.mark.parametrize("at_step", [None, ""])
def test_off_without_the_env_var(monkeypatch, tmp_path, at_step):
    marker = tmp_path / "fired"
    if at_step is None:
        monkeypatch.delenv("RAYLINE_FAULT_AT_STEP", raising=False)
    else:
        monkeypatch.setenv("RAYLINE_FAULT_AT_STEP", at_step)
    monkeypatch.setenv("RAYLINE_FAULT_MARKER", str(marker))
    monkeypatch.setattr(fault_injection.os, "_exit", lambda code: (_ for _ in ()).throw(Killed(code)))
    # No step on any rank kills a worker or leaves a marker behind.
    for step in range(0, 13):
        for rank in range(2):
            fault_injection.maybe_kill_worker(step, rank=rank, world_size=2)
    assert not marker.exists()


def test_a_node_kill_refuses_anything_but_a_stack_worker_node(monkeypatch, tmp_path):
    marker = tmp_path / "fired"
    monkeypatch.setenv("RAYLINE_FAULT_AT_STEP", "2")
    monkeypatch.setenv("RAYLINE_FAULT_KIND", "node")
    monkeypatch.setenv("RAYLINE_FAULT_MARKER", str(marker))
    killed = []
    monkeypatch.setattr(fault_injection, "kill_own_session", lambda: killed.append("session"))
    monkeypatch.setattr(fault_injection.os, "_exit", lambda code: (_ for _ in ()).throw(Killed(code)))
    for label in ("head", ""):
        monkeypatch.setattr(fault_injection, "node_label", lambda label=label: label)
        with pytest.raises(RuntimeError, match="only a worker node"):
            fault_injection.maybe_kill_worker(2, rank=1, world_size=2)
    assert not marker.exists() and not killed
    monkeypatch.setattr(fault_injection, "node_label", lambda: "worker-2")
    with pytest.raises(Killed, match="^137$"):
        fault_injection.maybe_kill_worker(2, rank=1, world_size=2)
    assert killed == ["session"] and marker.read_text() == "killed node worker-2 of rank 1 after step 2\n"
