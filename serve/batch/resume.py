"""Batch jobs that resume: Ray Data's job-level checkpoint, keyed on each row's `source` (inputs.py).

While a job writes its result files, Ray Data records beside them (`checkpoint_uri`) the sources each file
holds, committing a file's record only once the file is whole. Started again with the same config after a
crash (driver, node or cluster), the job finds that record, removes result files a dead task left half
done, and reads only the rows whose source is not recorded: every input row ends up in the output exactly
once, and the work already written is kept. When the job ends the record is deleted, so a finished
output directory is again refused unless `overwrite` says to replace it.

On a resumed run Ray Data puts a pool of checkpoint-filter actors after the read. Ray gives them 1 CPU
each and no setting to change it: beside a 1-CPU engine on a 2-CPU node that leaves no room for the read
tasks, and the job waits forever (seen on the test stack). `job_checkpoint` has them take the stage's
`cpu_stage_num_cpus` instead, through the one name in Ray Data's planner that builds them
(`fractional_filter_actors`); each still reserves 1 GiB of memory.
"""

from __future__ import annotations

import contextlib
import json
from typing import Iterator

from ray.data.checkpoint.checkpoint_writer import PENDING_CHECKPOINT_SUFFIX

from core import storage
from serve.batch.config import Config
from serve.batch.inputs import input_files
from serve.batch.rows import SOURCE_COLUMN


def checkpoint_uri(cfg: Config) -> str:
    """Where the job records its done rows: `checkpoint_uri`, else `<output_uri>.checkpoint` beside the output."""
    return cfg.checkpoint_uri or cfg.output_uri.rstrip("/") + ".checkpoint"


def finish_interrupted_commits(record_uri: str) -> list[str]:
    """Delete each pending record file whose committed copy exists; returns their names.

    Ray Data commits a result file's record by renaming `<id>.pending.parquet` to `<id>.parquet`. On S3 a
    rename is a copy and then a delete, and a job killed between the two leaves both. On resume Ray 2.60 takes
    any pending record as a half-written result file and deletes that file, while the committed record still
    marks its rows done: they are skipped and never written again (seen here: 50 of 400 rows missing in 3 of
    4 kills on Swift). Both present means the commit got as far as the copy, so the result file is whole;
    deleting the pending copy finishes the commit, as Ray's own commit does when retried."""
    files = set(storage.list_files(record_uri))
    suffix = PENDING_CHECKPOINT_SUFFIX + ".parquet"
    done = sorted(f for f in files if f.endswith(suffix) and f[: -len(suffix)] + ".parquet" in files)
    for rel in done:
        fs, path = storage.resolve(storage.join(record_uri, rel))
        fs.delete_file(path)
    return done


def committed_rows(record_uri: str) -> int:
    """Rows whose result files were whole when the run stopped: the committed record files' rows (a pending
    one, `<id>.pending.parquet`, marks a file a dead task left half written; Ray Data removes both)."""
    return sum(
        storage.parquet_metadata(storage.join(record_uri, rel)).num_rows for rel in storage.list_files(record_uri)
        if rel.endswith(".parquet") and not rel.endswith(PENDING_CHECKPOINT_SUFFIX + ".parquet")
    )


def _holds_files(uri: str) -> bool:
    return storage.exists(uri) and bool(storage.list_files(uri))


def identity_uri(cfg: Config) -> str:
    """Beside the record: what the run reads (input files and sizes, model), so a resume can check it."""
    return checkpoint_uri(cfg) + ".json"


def job_identity(cfg: Config, fmt: str, model_label: str) -> dict:
    """What a run of the job reads: each input file's size, and the model version."""
    return {"input": {uri: storage.total_bytes(uri) for uri in input_files(cfg, fmt)}, "model": model_label}


def prepare_output(cfg: Config, identity: dict | None = None) -> int:
    """Ready output_uri for this job; returns the rows an interrupted run of it already wrote (0 for a fresh
    start). An interrupted run's checkpoint is always resumed (with `overwrite` too: the same config started
    again resumes; `resumable: false` starts afresh), unless `identity` (what this run reads) differs from
    what the interrupted run read: its rows would not be this input's. A finished run's output is refused
    unless `overwrite` says to replace it."""
    record = checkpoint_uri(cfg)
    if cfg.resumable and _holds_files(record):
        if identity is not None and storage.exists(identity_uri(cfg)):
            changed = _what_changed(json.loads(storage.read_text(identity_uri(cfg))), identity)
            if changed:
                raise ValueError(
                    f"output_uri {cfg.output_uri}: an interrupted run of this job read other input: {changed}; "
                    "put it back to resume, or set resumable=false (or another output_uri) to start afresh"
                )
        finish_interrupted_commits(record)
        return committed_rows(record)
    if _holds_files(cfg.output_uri) and not cfg.overwrite:
        raise FileExistsError(
            f"output_uri {cfg.output_uri}: already holds results of a finished run (no checkpoint at {record} to "
            "resume from); pick another directory or set overwrite=true"
        )
    for uri in (cfg.output_uri, record):  # a stale record too: with resumable off, nothing may skip rows
        if storage.exists(uri):
            storage.delete_tree(uri)
    if cfg.resumable and identity is not None:
        storage.write_text(identity_uri(cfg), json.dumps(identity, sort_keys=True))
    return 0


def _what_changed(before: dict, now: dict) -> str:
    """'' when the interrupted run read what this one reads; else what differs, file by file."""
    out = []
    files_then, files_now = before.get("input", {}), now.get("input", {})
    for uri in sorted(set(files_then) | set(files_now)):
        if files_then.get(uri) != files_now.get(uri):
            then = f"{files_then[uri]:,} bytes" if uri in files_then else "absent"
            out.append(f"{uri} ({then} then, {f'{files_now[uri]:,} bytes' if uri in files_now else 'absent'} now)")
    if before.get("model") != now.get("model"):
        out.append(f"model {before.get('model')} then, {now.get('model')} now")
    return "; ".join(out)


def job_done(cfg: Config) -> None:
    """The job finished: Ray Data deleted its record; the identity beside it goes too."""
    if storage.exists(identity_uri(cfg)):
        fs, path = storage.resolve(identity_uri(cfg))
        fs.delete_file(path)


@contextlib.contextmanager
def fractional_filter_actors(num_cpus: float) -> Iterator[None]:
    """Within the block, the checkpoint-filter actors Ray Data plans take `num_cpus` CPUs each, not 1."""
    from ray.data._internal.execution.operators.map_operator import MapOperator
    from ray.data._internal.planner.checkpoint import plan_read_op

    if getattr(plan_read_op, "MapOperator", None) is not MapOperator:
        raise RuntimeError(
            "ray.data._internal.planner.checkpoint.plan_read_op no longer builds the checkpoint filter with "
            "MapOperator.create: serve/batch/resume.py needs updating for this Ray version"
        )

    class FilterOperator:
        @staticmethod
        def create(*args, ray_remote_args=None, **kwargs):
            remote_args = {**(ray_remote_args or {}), "num_cpus": num_cpus}
            return MapOperator.create(*args, ray_remote_args=remote_args, **kwargs)

    plan_read_op.MapOperator = FilterOperator
    try:
        yield
    finally:
        plan_read_op.MapOperator = MapOperator


@contextlib.contextmanager
def job_checkpoint(cfg: Config) -> Iterator[None]:
    """Within the block, Ray Data executions in this driver record and skip done rows under checkpoint_uri."""
    if not cfg.resumable:
        yield
        return
    from ray.data import DataContext
    from ray.data.checkpoint import CheckpointConfig

    fs, path = storage.resolve(checkpoint_uri(cfg))
    context = DataContext.get_current()
    saved = context.checkpoint_config
    context.checkpoint_config = CheckpointConfig(
        id_column=SOURCE_COLUMN, checkpoint_path=path, override_filesystem=fs, delete_checkpoint_on_success=True,
    )
    try:
        with fractional_filter_actors(cfg.cpu_stage_num_cpus):
            yield
    finally:
        context.checkpoint_config = saved
