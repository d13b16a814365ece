"""`pipelines.submit` and the README's raw `ray job submit` run a real stage on the real local Ray head.

A stage submitted with `pipelines.submit.submit_stage`, its log streamed to the end, is what the demo does for each of its
stages: tests/pipelines/test_demo.py checks the data job's streamed log."""

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines.config import ConfigError
from pipelines.submit import dashboard_address, submit_stage
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
    """`ray job submit --working-dir .` with a log growing in the root: .rayignore leaves it behind."""
    out = tmp_path / "prepared-raw"
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = [ray, "job", "submit", "--working-dir", ".", "--", "python", "-m", "pipelines.prepare_data",
           "--config", "configs/data/sample.yaml", *_data_overrides(sample_corpus_dir, tiny_model_dir, out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "succeeded" in proc.stdout.lower()
    assert len(_manifests(out)) == 1


def test_bad_config_is_refused_before_upload(local_stack):
    with pytest.raises(ConfigError, match="not submitted: .*seq_lenn: unknown field"):
        submit_stage("data", str(ROOT / "configs/data/sample.yaml"), ["seq_lenn=5"])
