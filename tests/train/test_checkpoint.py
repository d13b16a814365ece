"""Which checkpoint a restarted run resumes from when Ray Train had not registered the newest one."""

from __future__ import annotations

import uuid
from pathlib import Path

from train.checkpoint import checkpoint_files, latest_complete_checkpoint


def write_checkpoint(run: Path, step: int, files: set[str]) -> None:
    d = run / f"checkpoint_step{step:06d}"
    d.mkdir(parents=True)
    for name in files:
        (d / name).write_bytes(b"x")


def test_newest_complete_checkpoint_wins_and_partial_ones_are_skipped(tmp_path):
    run = tmp_path / "run"
    assert latest_complete_checkpoint(str(run), 2) is None  # a fresh run: nothing there yet
    write_checkpoint(run, 3, checkpoint_files(2))
    write_checkpoint(run, 6, checkpoint_files(2))
    write_checkpoint(run, 9, checkpoint_files(2) - {"__1_0.distcp"})  # rank 1 died before its shard landed
    (run / "export").mkdir()
    (run / "export" / "config.json").write_text("{}")
    assert latest_complete_checkpoint(str(run), 2) == "checkpoint_step000006"
    # A checkpoint of 2 ranks is not complete for 4.
    assert latest_complete_checkpoint(str(run), 4) is None


def test_listing_works_on_s3(s3_bucket):
    import pyarrow.fs as pafs

    from pipelines import storage

    run = f"{s3_bucket}/checkpoint-scan-{uuid.uuid4().hex[:8]}"
    fs, path = storage.resolve(run)
    for name in checkpoint_files(2):
        with fs.open_output_stream(f"{path}/checkpoint_step000004/{name}") as out:
            out.write(b"x")
    fs.create_dir(f"{path}/checkpoint_step000008")
    with fs.open_output_stream(f"{path}/checkpoint_step000008/.metadata") as out:
        out.write(b"x")
    assert latest_complete_checkpoint(run, 2) == "checkpoint_step000004"
    assert isinstance(fs, pafs.S3FileSystem)
