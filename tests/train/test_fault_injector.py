"""The test-only fault injector fires once per chosen step, on one rank, and reaches the workers through the
training step hook."""

import json

import pytest

from tests.train import fault_injector
from train.step_hook import load_step_hook


class Killed(Exception):
    pass


@pytest.fixture
def no_exit(monkeypatch):
    monkeypatch.setattr(fault_injector.os, "_exit", lambda code: (_ for _ in ()).throw(Killed(code)))


def test_fires_once_on_the_chosen_rank(no_exit, tmp_path):
    marker = tmp_path / "fired"
    kill = dict(at="5", marker=str(marker))
    fault_injector.after_step(4, 1, 2, **kill)  # wrong step
    fault_injector.after_step(5, 0, 2, **kill)  # default target is the last rank
    assert not marker.exists()
    with pytest.raises(Killed, match="^137$"):  # the exit status of an OOM-killed process
        fault_injector.after_step(5, 1, 2, **kill)
    assert marker.read_text() == "killed rank 1 after step 5\n"
    fault_injector.after_step(5, 1, 2, **kill)  # the restarted worker passes


def test_each_listed_step_fires_once_across_restarts_and_resubmissions(no_exit, tmp_path):
    marker = tmp_path / "fired"
    fired = []
    for attempt in range(3):  # the first group, the group restarted from step 3, the run submitted again from step 6
        for step in range((0, 4, 7)[attempt], 13):
            try:
                fault_injector.after_step(step, 1, 2, at="5,8", marker=str(marker))
            except Killed:
                fired.append((attempt, step))
                break
    assert fired == [(0, 5), (1, 8)]
    assert marker.read_text() == "killed rank 1 after step 5\nkilled rank 1 after step 8\n"


def test_target_rank_picks_the_victim(no_exit, tmp_path):
    kill = dict(at="2", marker=str(tmp_path / "fired"), target_rank=0)
    fault_injector.after_step(2, 3, 4, **kill)
    with pytest.raises(Killed):
        fault_injector.after_step(2, 0, 4, **kill)


def test_the_step_hook_installs_it_from_the_environment_and_is_off_without_it(monkeypatch, no_exit, tmp_path):
    marker = tmp_path / "fired"
    monkeypatch.delenv("RAYLINE_STEP_HOOK", raising=False)
    assert load_step_hook(1, 2) is None
    for name, value in fault_injector.fault_env(at="3", marker=marker, rank=0).items():
        monkeypatch.setenv(name, value)
    hooks = [load_step_hook(rank, 2) for rank in range(2)]
    hooks[1](3)  # not the chosen rank
    with pytest.raises(Killed):
        hooks[0](3)
    assert marker.read_text() == "killed rank 0 after step 3\n"


@pytest.mark.parametrize("spec, args, problem", [("tests.train.fault_injector", "{}", "module:function"),
                                                  ("tests.train.fault_injector:after_step", "[1]", "JSON object"),
                                                  ("tests.train.fault_injector:after_step", "{", "not JSON")])
def test_a_bad_hook_setting_is_named(monkeypatch, spec, args, problem):
    monkeypatch.setenv("RAYLINE_STEP_HOOK", spec)
    monkeypatch.setenv("RAYLINE_STEP_HOOK_ARGS", args)
    with pytest.raises(ValueError, match=problem):
        load_step_hook(0, 1)


def test_a_node_kill_refuses_anything_but_a_stack_worker_node(monkeypatch, no_exit, tmp_path):
    marker = tmp_path / "fired"
    kill = dict(at="2", marker=str(marker), kind="node")
    killed = []
    monkeypatch.setattr(fault_injector, "kill_own_session", lambda: killed.append("session"))
    for label in ("head", ""):
        monkeypatch.setattr(fault_injector, "node_label", lambda label=label: label)
        with pytest.raises(RuntimeError, match="only a worker node"):
            fault_injector.after_step(2, 1, 2, **kill)
    assert not marker.exists() and not killed
    monkeypatch.setattr(fault_injector, "node_label", lambda: "worker-2")
    with pytest.raises(Killed, match="^137$"):
        fault_injector.after_step(2, 1, 2, **kill)
    assert killed == ["session"] and marker.read_text() == "killed node worker-2 of rank 1 after step 2\n"
    assert json.loads(fault_injector.fault_env("2", marker, "node")["RAYLINE_STEP_HOOK_ARGS"])["kind"] == "node"


def test_a_notice_signals_the_nodes_ray_start_and_training_goes_on(monkeypatch, no_exit, tmp_path):
    """kind=notice: SIGTERM to the session leader (the node's `ray start --block`, as Kubernetes signals a pod's main
    process), the step held for notice_wait_s, no exit; only on a stack worker node, once."""
    marker, signals, waits = tmp_path / "fired", [], []
    monkeypatch.setattr(fault_injector.os, "kill", lambda pid, sig: signals.append((pid, sig)))
    monkeypatch.setattr(fault_injector.time, "sleep", waits.append)
    notice = dict(at="4", marker=str(marker), kind="notice", notice_wait_s=2.5)
    monkeypatch.setattr(fault_injector, "node_label", lambda: "head")
    with pytest.raises(RuntimeError, match="only a worker node"):
        fault_injector.after_step(4, 1, 2, **notice)
    monkeypatch.setattr(fault_injector, "node_label", lambda: "worker-1")
    fault_injector.after_step(4, 1, 2, **notice)  # returns: the rank trains on
    fault_injector.after_step(4, 1, 2, **notice)  # the restarted group passes
    assert signals == [(fault_injector.os.getsid(0), fault_injector.signal.SIGTERM)] and waits == [2.5]
    assert marker.read_text() == "gave notice to node worker-1 of rank 1 after step 4\n"
