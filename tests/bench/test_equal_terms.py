"""bench/equal_terms.py: a ratio only between equal set-ups, set-ups read back from real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from bench.equal_terms import (
    busy_threads, placeholder, print_setups, process_tree, ratio_line, round_order, thread_times,
)

MUST = ["executor", "OMP_NUM_THREADS", "niceness"]
OURS = {"executor": "UniProcExecutor", "OMP_NUM_THREADS": "1", "niceness": 15, "processes": 3}


def test_ratio_given_when_the_keys_that_must_match_match():
    theirs = {**OURS, "processes": 2}  # not a must-match key: shown, but no reason to refuse
    assert ratio_line("vllm server", 1.2345, OURS, theirs, MUST) == "rayline vs vllm server: 1.23x"


def test_ratio_refused_and_the_difference_named():
    theirs = {**OURS, "executor": "MultiprocExecutor", "niceness": 0}
    line = ratio_line("vllm server", 1.5, OURS, theirs, MUST)
    assert line.startswith("rayline vs vllm server: no ratio")
    assert "1.5" not in line
    assert "executor (rayline UniProcExecutor, vllm server MultiprocExecutor)" in line
    assert "niceness (rayline 15, vllm server 0)" in line
    assert "OMP_NUM_THREADS" not in line


def test_ratio_refused_when_a_side_was_not_read_back():
    theirs = {k: v for k, v in OURS.items() if k != "OMP_NUM_THREADS"}
    line = ratio_line("torchrun", 0.9, OURS, theirs, MUST)
    assert line == "rayline vs torchrun: no ratio, set-ups differ: OMP_NUM_THREADS (rayline 1, torchrun not read back)"


@pytest.mark.parametrize("placeholder", ["not logged", "unset", "not read back", None,
                                         "no EngineCore process found"])
def test_ratio_refused_when_both_sides_hold_the_same_placeholder(placeholder):
    # Equal placeholders say nothing about what ran (vLLM's log lacked the line on both sides, say).
    ours, theirs = {**OURS, "OMP_NUM_THREADS": placeholder}, {**OURS, "OMP_NUM_THREADS": placeholder}
    line = ratio_line("vllm server", 1.1, ours, theirs, MUST)
    assert line.startswith("rayline vs vllm server: no ratio, set-ups differ: OMP_NUM_THREADS (rayline ")
    assert "1.10x" not in line


def test_ratio_refused_when_one_side_holds_a_placeholder():
    line = ratio_line("vllm server", 1.1, {**OURS, "OMP_NUM_THREADS": "not logged"}, OURS, MUST)
    assert line == ("rayline vs vllm server: no ratio, set-ups differ: "
                    "OMP_NUM_THREADS (rayline not logged, vllm server 1)")


def test_a_placeholder_outside_the_must_match_keys_does_not_refuse():
    ours = {**OURS, "processes": "not logged"}
    assert ratio_line("vllm server", 1.1, ours, {**OURS, "processes": "unset"}, MUST) == "rayline vs vllm server: 1.10x"


def test_values_that_read_back_are_not_placeholders():
    assert not any(placeholder(v) for v in (0, False, 1.0, "off (no throughput lines)", "uni", "float32", "nobind"))
    assert all(placeholder(v) for v in ("not logged", "unset", "-", "", None, "Not Logged", "no ServeReplica:x"))


def test_print_setups_shows_every_key_of_every_side(capsys):
    print_setups({"rayline": OURS, "vllm server": {"executor": "MultiprocExecutor", "max_num_batched_tokens": 2048}})
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[-3:] == ["rayline", "vllm", "server"]
    rows = {line.split()[0]: line.split()[1:] for line in out[1:]}
    assert rows["executor"] == ["UniProcExecutor", "MultiprocExecutor"]
    assert rows["processes"] == ["3", "-"]
    assert rows["max_num_batched_tokens"] == ["-", "2048"]


def test_round_order_alternates():
    assert round_order(["a", "b"], 4) == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]


def test_process_tree_reads_a_running_tree():
    # A parent at niceness 5 with OMP_NUM_THREADS=3 that starts one child of its own.
    code = "import subprocess, time; subprocess.Popen(['sleep', '30']); time.sleep(30)"
    env = {**os.environ, "OMP_NUM_THREADS": "3"}
    env.pop("RAYON_NUM_THREADS", None)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, preexec_fn=lambda: os.nice(5))
    try:
        deadline = time.time() + 20
        while (tree := process_tree(proc.pid))["processes"] < 2 and time.time() < deadline:
            time.sleep(0.1)
        assert tree["processes"] == 2
        assert tree["niceness"] == os.getpriority(os.PRIO_PROCESS, 0) + 5
        assert tree["OMP_NUM_THREADS"] == "3"
        assert tree["RAYON_NUM_THREADS"] == "unset"
        assert "sleep" in tree["process names"]
    finally:
        for child in psutil.Process(proc.pid).children():
            child.kill()
        proc.kill()
        proc.wait()


def test_process_tree_leaves_out_a_retitled_environment():
    # setproctitle (vLLM, Ray) takes the memory /proc shows the environment from: nothing there is "unset".
    code = "import setproctitle, time; setproctitle.setproctitle('VLLM::EngineCore_DP0'); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "3"})
    try:
        deadline = time.time() + 20
        # cmdline() is empty for a moment while the child starts.
        while not (psutil.Process(proc.pid).cmdline() or [""])[0].startswith("VLLM::") and time.time() < deadline:
            time.sleep(0.1)
        tree = process_tree(proc.pid)
        assert tree["processes"] == 1
        assert "OMP_NUM_THREADS" not in tree
    finally:
        proc.kill()
        proc.wait()


def test_busy_threads_counts_the_threads_that_computed():
    # Two threads spin (a Python thread releases the GIL in hashlib on large inputs), one sleeps.
    code = ("import hashlib, threading, time\n"
            "def spin():\n"
            "    data = bytes(1 << 24)\n"
            "    while True: hashlib.sha256(data).digest()\n"
            "for _ in range(2): threading.Thread(target=spin, daemon=True).start()\n"
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(1.0)
        before = thread_times(proc.pid)
        time.sleep(3.0)
        after = thread_times(proc.pid)
        assert len(after) >= 4
        assert busy_threads(before, after) == 2
    finally:
        proc.kill()
        proc.wait()
