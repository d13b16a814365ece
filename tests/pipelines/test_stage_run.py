"""Every stage entry point ends the same way (pipelines/stage_run.py): exit 2 on a config error, 1 on a resource wait
that ran out, else the summary and one `result:` JSON line."""

import json
from dataclasses import dataclass

from core.config import ConfigError
from core.resource_wait import ResourceWaitTimeout
from pipelines.stage_run import losses, model_line, run_stage


@dataclass
class Result:
    model_name: str = "m"
    model_version: str | None = "3"


def raising(error):
    def stage():
        raise error
    return stage


def test_exit_status_and_message_by_outcome(capsys):
    assert run_stage("train", raising(ConfigError("train.epochs: must be at least 1")), lambda r: []) == 2
    assert "config error: train.epochs: must be at least 1" in capsys.readouterr().err
    assert run_stage("train", raising(ResourceWaitTimeout("waited 40 s: asked CPU 2, free CPU 0.5")), lambda r: []) == 1
    assert "train failed: waited 40 s: asked CPU 2, free CPU 0.5" in capsys.readouterr().err
    assert run_stage("dpo", lambda: Result(), lambda r: [f"run {r.model_name}", *model_line(r)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["run m", "model      models:/m/3", "result: " + json.dumps({"model_name": "m", "model_version": "3"})]


def test_summary_helpers():
    assert losses(2.5, None) == "2.5000 -> n/a" and losses(None, 0.12345) == "n/a -> 0.1235"
    assert model_line(Result(model_version=None)) == []
