"""A batch job killed mid-way and started again with the same command resumes (serve/batch/resume.py).

Real parts: `python -m pipelines.batch_infer` as a user runs it, against the test stack's Ray head, a vLLM
engine on CPU, output and checkpoint on the stack's S3 (Swift). The driver is killed with SIGKILL as soon as
its checkpoint record holds a committed result file; the same config is then run again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from core import storage
from core.config import load_config
from serve.batch.config import Config
from serve.batch.resume import checkpoint_uri, identity_uri

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N_ROWS = 240


def overrides(input_path, output_uri: str, model_dir) -> list[str]:
    return [
        f"input_uri={input_path}", f"output_uri={output_uri}", f"engine.model={model_dir}",
        "sampling.max_tokens=8", "batch_size=8", "max_concurrent_batches=4", "progress_every_s=0",
        "engine.max_num_seqs=16", "engine.kv_cache_memory_bytes=67108864",
    ]


def kill_after_first_commit(cmd: list[str], record_uri: str, log_path, timeout_s: float = 600) -> float:
    """Start the job and SIGKILL its driver once the checkpoint record holds a committed result file (a result
    file alone is not enough: until its record is committed, a resume rightly writes its rows again); returns
    the seconds it ran."""
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        while time.monotonic() - started < timeout_s:
            if proc.poll() is not None:
                pytest.fail(f"the job ended (rc {proc.returncode}) before it could be killed: {open(log_path).read()[-3000:]}")
            if committed(record_uri) > 0:
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
                return time.monotonic() - started
            time.sleep(0.2)
        pytest.fail(f"no committed result file within {timeout_s} s")
    finally:
        if proc.poll() is None:
            proc.kill()


def committed(record_uri: str) -> int:
    from serve.batch.resume import committed_rows

    try:
        return committed_rows(record_uri)
    except Exception:  # not there yet, or a file going away under the listing
        return 0


def test_a_commit_cut_between_copy_and_delete_is_finished_not_undone(tmp_path):
    """S3's rename is a copy and a delete: a kill between them leaves a committed record and its pending copy.
    The pending copy goes (the result file is whole); a pending record alone stays for Ray Data to undo."""
    from serve.batch.resume import committed_rows, finish_interrupted_commits

    import pyarrow as pa
    import pyarrow.parquet as pq

    record = tmp_path / "out.checkpoint"
    record.mkdir()
    for name, n in (("a", 3), ("a.pending", 3), ("b.pending", 2), ("c", 4)):
        pq.write_table(pa.table({"source": [f"p.jsonl:{i}" for i in range(n)]}), record / f"{name}.parquet")
    assert finish_interrupted_commits(str(record)) == ["a.pending.parquet"]
    assert sorted(p.name for p in record.iterdir()) == ["a.parquet", "b.pending.parquet", "c.parquet"]
    assert committed_rows(str(record)) == 7


def test_a_resume_over_changed_input_is_refused_naming_the_file(tmp_path):
    """The record says which rows are done by their source; over other input it would skip the wrong rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from serve.batch.resume import job_done, prepare_output

    cfg = load_config(Config, os.path.join(ROOT, "configs/batch/infer_tiny.yaml"),
                      [f"input_uri={tmp_path}/in.jsonl", f"output_uri={tmp_path}/out"])
    then = {"input": {f"{tmp_path}/in.jsonl": 1000}, "model": "m/1"}
    assert prepare_output(cfg, then) == 0 and os.path.exists(identity_uri(cfg))
    (tmp_path / "out.checkpoint").mkdir()  # the run is killed after one result file is committed
    pq.write_table(pa.table({"source": ["in.jsonl:1", "in.jsonl:2"]}), tmp_path / "out.checkpoint" / "a.parquet")
    assert prepare_output(cfg, then) == 2
    grown = {"input": {f"{tmp_path}/in.jsonl": 1200}, "model": "m/1"}
    with pytest.raises(ValueError, match=r"in.jsonl \(1,000 bytes then, 1,200 bytes now\).*resumable=false"):
        prepare_output(cfg, grown)
    with pytest.raises(ValueError, match="model m/1 then, m/2 now"):
        prepare_output(cfg, {**then, "model": "m/2"})
    job_done(cfg)
    assert not os.path.exists(identity_uri(cfg))


def file_rows(uri: str, rels) -> int:
    """Rows in the Parquet files `rels` under uri (from their footers)."""
    return sum(storage.parquet_metadata(storage.join(uri, rel)).num_rows for rel in rels)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_killed_job_started_again_answers_only_the_rest_and_every_row_once(local_stack, s3_bucket, tiny_model_dir,
                                                                               tmp_path):
    import ray

    from core.ray_cluster import init_ray
    from serve.batch.pipeline import main, read_results

    input_path = tmp_path / "prompts.jsonl"
    # Repeated ids: users' ids need not be unique; the checkpoint keys on each line's source.
    input_path.write_text("".join(json.dumps({"id": f"q{i % 40}", "prompt": f"What is {i} + {i % 7}?"}) + "\n"
                                  for i in range(N_ROWS)))
    output_uri = f"{s3_bucket}/batch-resume/{uuid.uuid4().hex[:8]}/out"
    args = overrides(input_path, output_uri, tiny_model_dir)
    cmd = [sys.executable, "-m", "pipelines.batch_infer", "--config", "configs/batch/infer_tiny.yaml", *args]

    cfg = load_config(Config, os.path.join(ROOT, "configs/batch/infer_tiny.yaml"), args)
    record = checkpoint_uri(cfg)
    ran_s = kill_after_first_commit(cmd, record, tmp_path / "first.log")
    print(f"killed after {ran_s:.1f} s")
    assert storage.list_files(record), "the killed run left no checkpoint beside its output"
    before = set(storage.list_files(output_uri))
    state = {"output": {f: file_rows(output_uri, [f]) for f in before},
             "record": {f: file_rows(record, [f]) for f in storage.list_files(record)}}

    init_ray()
    try:
        result = main(cfg)  # the same config again
    finally:
        ray.shutdown()

    table = read_results(output_uri)
    sources = table.column("source").to_pylist()
    after = {f: file_rows(output_uri, [f]) for f in storage.list_files(output_uri)}
    assert sorted(sources) == sorted(f"prompts.jsonl:{i + 1}" for i in range(N_ROWS)), (state, after)  # every row, once
    assert result.rows == N_ROWS and result.errors == 0
    assert 0 < result.resumed_rows < N_ROWS, "the kill did not land mid-way"
    # The second run answered only the rest: its own files hold N - resumed rows; the first run's whole files
    # were kept (any half-written one was removed), and the checkpoint is gone once the job finished.
    kept = before & set(storage.list_files(output_uri))
    new = set(storage.list_files(output_uri)) - before
    assert kept and new
    assert file_rows(output_uri, new) == N_ROWS - result.resumed_rows
    assert not storage.exists(record) or not storage.list_files(record)
    assert not storage.exists(identity_uri(cfg))  # what the job read, kept for a resume's check, goes too

