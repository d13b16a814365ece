"""core/usage.py without a cluster: what a process's CPU time counts, and how a version's usage tags add up. The
figures of real stages, against what their processes used read from outside, are checked on the stack
(tests/train/test_train_stage.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from core import usage
from core.usage import Usage

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\nprint('done', flush=True)\n"
SLEEP_AFTER = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n" \
              "print('burnt', flush=True)\ntime.sleep(60)\n"


def test_a_process_counts_its_live_children_and_those_it_waited_for_but_a_driver_only_the_waited():
    before, driver_before = usage.process_cpu_s(), usage.driver_cpu_s()
    subprocess.run([sys.executable, "-c", BURN.format(s=0.6)], check=True, capture_output=True)
    waited = usage.process_cpu_s() - before
    assert waited >= 0.6  # the child's burn (and its start) once the child was waited for
    assert usage.driver_cpu_s() - driver_before >= 0.6

    live = subprocess.Popen([sys.executable, "-c", SLEEP_AFTER.format(s=0.6)], stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout.readline().strip() == "burnt"
        mid, driver_mid = usage.process_cpu_s(), usage.driver_cpu_s()
        assert mid - before >= waited + 0.6  # the live child's burn too
        assert driver_mid - driver_before < waited + 0.6  # a driver leaves live children out (the local stack's)
        assert usage.descendants(live.pid) == [] and live.pid in usage.descendants(__import__("os").getpid())
    finally:
        live.kill()
        live.wait()


def test_usage_adds_up_and_shares_by_fraction():
    a, b = Usage(10.0, 2.0, 3, 1.0), Usage(5.0, 0.0, 2, 0.5)
    assert a + b == Usage(15.0, 2.0, 5, 1.5)
    assert a.share(0.25) == Usage(2.5, 0.5, 3, 0.25)
    assert a.metrics() == {"usage/cpu_s": 10.0, "usage/gpu_s": 2.0, "usage/driver_cpu_s": 1.0,
                           "usage/processes": 3.0}


def test_a_versions_tags_give_back_its_usage_by_stage_and_the_total_adds_them():
    tags = {**Usage(12.34, 0.0).tags("data"), **Usage(100.0, 8.0).tags("train"), **Usage(3.0, 1.0).tags("eval"),
            "rayline.dataset_version": "abc"}
    assert tags["rayline.usage.data_cpu_s"] == "12.3" and tags["rayline.usage.train_gpu_s"] == "8.0"
    by_stage = usage.version_usage(tags)
    assert list(by_stage) == ["data", "train", "eval"]  # pipeline order
    assert by_stage["train"] == Usage(100.0, 8.0)
    assert usage.total_tags(by_stage) == {"rayline.usage.total_cpu_s": "115.3", "rayline.usage.total_gpu_s": "9.0"}


def test_a_post_trained_version_inherits_what_building_its_parent_cost_not_its_eval_or_rollout():
    parent = {**Usage(10.0).tags("data"), **Usage(100.0, 2.0).tags("train"), **Usage(5.0).tags("eval"),
              **Usage(0.4).tags("rollout")}
    assert usage.inherited(parent) == {"data": Usage(10.0), "train": Usage(100.0, 2.0)}


def test_an_unknown_stage_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="usage stage 'serve': one of data, tune, train, dpo, grpo, eval, rollout"):
        Usage().tags("serve")


def test_descendants_of_a_gone_process_are_none():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    time.sleep(0.05)
    assert usage.descendants(proc.pid) == []


def test_a_ledger_that_does_not_answer_leaves_the_drivers_time_and_fails_nothing(capsys):
    class Gone:  # the ledger's handle after its node was lost
        class totals:
            @staticmethod
            def remote():
                raise RuntimeError("the actor died")

    meter = usage.StageUsage(Gone(), usage.driver_cpu_s())
    sum(i * i for i in range(200_000))
    used = meter.totals()
    assert used.processes == 1 and used.gpu_s == 0.0 and used.cpu_s == used.driver_cpu_s >= 0.0
    assert "the job's ledger did not answer (RuntimeError): only the driver's CPU time is counted" in capsys.readouterr().out
