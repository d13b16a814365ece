"""`pipelines.submit` and the README's raw `ray job submit` run a real stage on the real local Ray head.

A stage submitted with `pipelines.submit.submit_stage`, its log streamed to the end, is what the demo does for each of its
stages: tests/pipelines/test_demo.py checks the data job's streamed log. No secret ever goes into a job's runtime_env
(the Jobs API hands it to every holder of the cluster's token): the refusal tests need no stack."""

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.config import ConfigError
from pipelines.submit import dashboard_address, main, submit_stage
from rayjobs import stages

ROOT = stages.PROJECT_ROOT


def _data_overrides(corpus: Path, model: Path, out: Path) -> list[str]:
    return [f"inputs=[{corpus / 'train.jsonl'},{corpus / 'malformed.jsonl'}]", f"eval_inputs=[{corpus / 'eval.jsonl'}]",
            f"output_uri={out}", f"tokenizer={model}", "num_shards=1"]


def _manifests(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in out.glob("*/manifest.json")]


@pytest.mark.parametrize("streamed", [True, False], ids=["streaming-logs", "polling"])
def test_a_job_that_outlives_its_timeout_is_stopped(local_stack, sample_corpus_dir, tiny_model_dir, tmp_path,
                                                     streamed):
    from ray.job_submission import JobStatus, JobSubmissionClient

    out = tmp_path / "prepared-late"
    logs = io.StringIO() if streamed else None
    # Data prep takes far longer than 2 s (the job's runtime env alone); submit_stage must not wait for it.
    with pytest.raises(TimeoutError, match=r"job (\S+) \(data\) still (PENDING|RUNNING) after the 2s timeout "
                                           r"\(timeout_s\); stopped it") as raised:
        submit_stage("data", str(ROOT / "configs/data/sample.yaml"),
                     _data_overrides(sample_corpus_dir, tiny_model_dir, out), stream=logs, timeout_s=2)
    job_id = re.search(r"job (\S+) \(data\)", str(raised.value)).group(1)
    client = JobSubmissionClient(dashboard_address(None))
    deadline = time.time() + 120
    while (status := client.get_job_status(job_id)) != JobStatus.STOPPED and time.time() < deadline:
        time.sleep(1)
    assert status == JobStatus.STOPPED, client.get_job_logs(job_id)[-3000:]
    assert _manifests(out) == []


def test_raw_ray_job_submit_from_readme(local_stack, sample_corpus_dir, tiny_model_dir, tmp_path, log_growing_in_checkout):
    """`ray job submit --working-dir .` as the README writes it (the stage's MLflow role in the runtime env), with a
    log growing in the root: .rayignore leaves it behind."""
    out = tmp_path / "prepared-raw"
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = [ray, "job", "submit", "--working-dir", ".", "--runtime-env-json", '{"env_vars": {"RAYLINE_ROLE": "trainer"}}',
           "--", "python", "-m", "pipelines.prepare_data",
           "--config", "configs/data/sample.yaml", *_data_overrides(sample_corpus_dir, tiny_model_dir, out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "succeeded" in proc.stdout.lower()
    assert len(_manifests(out)) == 1


def test_bad_config_is_refused_before_upload(local_stack):
    with pytest.raises(ConfigError, match="not submitted: .*seq_lenn: unknown field"):
        submit_stage("data", str(ROOT / "configs/data/sample.yaml"), ["seq_lenn=5"])


SECRETS = {"AWS_SECRET_ACCESS_KEY": "aws-secret-in-env", "AWS_SESSION_TOKEN": "aws-session-in-env",
           "MLFLOW_TRACKING_PASSWORD": "mlflow-password-in-env", "MLFLOW_TRACKING_TOKEN": "mlflow-token-in-env",
           "HF_TOKEN": "hf-token-in-env", "MY_DB_PASSWORD": "db-password-in-env"}


def test_a_secret_in_the_environment_never_reaches_the_jobs_runtime_env(local_stack, sample_corpus_dir, tiny_model_dir,
                                                                         tmp_path, monkeypatch):
    """Read back from the Jobs API, as any holder of the cluster's token can: pointers and the role, no secret."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    result = submit_stage("data", str(ROOT / "configs/data/sample.yaml"),
                          _data_overrides(sample_corpus_dir, tiny_model_dir, tmp_path / "prepared-env"), wait=False)
    client = JobSubmissionClient(dashboard_address(None))
    try:
        runtime_env = client.get_job_info(result.job_id).runtime_env
    finally:
        client.stop_job(result.job_id)
    env_vars = runtime_env["env_vars"]
    assert not set(SECRETS) & set(env_vars) and "AWS_ACCESS_KEY_ID" not in env_vars
    dumped = json.dumps(runtime_env)
    assert not [name for name, value in SECRETS.items() if value in dumped]
    assert not os.environ.get("AWS_ACCESS_KEY_ID") or os.environ["AWS_ACCESS_KEY_ID"] not in dumped
    assert env_vars["RAYLINE_ROLE"] == "trainer" and env_vars["AWS_REGION"] == "eu-west-1"
    assert env_vars["MLFLOW_TRACKING_URI"] == os.environ["MLFLOW_TRACKING_URI"]
    deadline = time.time() + 120
    while client.get_job_status(result.job_id) not in (JobStatus.STOPPED, JobStatus.SUCCEEDED, JobStatus.FAILED):
        assert time.time() < deadline
        time.sleep(1)


def test_forwarded_env_carries_pointers_only(monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA-in-env")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("RAYLINE_ROLE", "admin")  # the stack's own user, as `stack env` exports it
    env = stages.submission_env(stages.get_stage("data"))
    # The job acts as its stage's role, not as the shell that submitted it; a role is chosen only explicitly.
    assert env["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9000" and env["RAYLINE_ROLE"] == "trainer"
    assert not (set(SECRETS) | {"AWS_ACCESS_KEY_ID"}) & set(env)
    assert stages.submission_env(stages.get_stage("rollout"))["RAYLINE_ROLE"] == "rollout"
    assert stages.submission_env(stages.get_stage("serve"))["RAYLINE_ROLE"] == "rollout"  # it deploys and records
    assert stages.submission_env(stages.get_stage("data"), {"RAYLINE_ROLE": "evaluator"})["RAYLINE_ROLE"] == "evaluator"


@pytest.mark.parametrize("name", ["HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD", "DB_PASSWORD",
                                  "X_SECRET_SALT", "OPENAI_API_KEY"])
def test_a_secret_passed_explicitly_is_refused_before_anything_is_sent(name):
    # No cluster listens at this address: the refusal must come before any connection.
    with pytest.raises(stages.SecretInRuntimeEnv, match=rf"^{name}: looks like a secret, refused") as raised:
        submit_stage("data", str(ROOT / "configs/data/sample.yaml"), address="http://127.0.0.1:9",
                     env={"RAYLINE_SERVE_URL": "http://x", name: "value-that-must-not-show"})
    assert "value-that-must-not-show" not in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(stages.SecretInRuntimeEnv, match=name):
        stages.job_runtime_env(None, {name: "v"}, record_commit=False)


def test_the_cli_refuses_a_secret_in_one_line_naming_it(capsys):
    code = main(["--stage", "data", "--config", str(ROOT / "configs/data/sample.yaml"), "--address",
                 "http://127.0.0.1:9", "--env", "HF_TOKEN=hf_value_that_must_not_show"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: HF_TOKEN: looks like a secret") and err.count("\n") == 1
    assert "hf_value_that_must_not_show" not in err
