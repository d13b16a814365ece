"""Which checkpoint a restarted run resumes from, and which worker count may resume it (any, for an elastic run)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from train.checkpoint import (
    TrainerState,
    WorldSizeMismatch,
    check_resumable,
    checkpoint_files,
    COMMITTED,
    latest_complete_checkpoint,
    load_checkpoint,
    mark_committed,
    newest_trainer_state,
    save_checkpoint,
)


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


def test_a_checkpoint_without_its_commit_marker_is_never_resumed_from(tmp_path):
    """Every rank's file is there by name, one of them cut off mid-copy (a node gone before its upload finished, as when
    a termination notice's save did not fit): without the marker, neither the scan nor the world-size check uses it."""
    run = tmp_path / "run"
    write_checkpoint(run, 4, checkpoint_files(2))
    write_checkpoint(run, 8, checkpoint_files(2) - {COMMITTED})
    (run / "checkpoint_step000008" / "trainer_state.json").write_text('{"step": 8, "wor')  # half written
    assert latest_complete_checkpoint(str(run), 2) == "checkpoint_step000004"
    (run / "checkpoint_step000004" / "trainer_state.json").write_text('{"step": 4, "world_size": 2}')
    assert newest_trainer_state(str(run))[1].step == 4
    mark_committed(str(run / "checkpoint_step000008"), 8)  # what rank 0 writes once every upload has returned
    assert latest_complete_checkpoint(str(run), 2) == "checkpoint_step000008"


def test_rank_zero_commits_only_a_checkpoint_whose_every_file_landed(tmp_path):
    """train/worker.py commit_checkpoint, after every rank's report (one process here: no barrier to wait at)."""
    from train.worker import commit_checkpoint

    run = tmp_path / "run"
    write_checkpoint(run, 4, checkpoint_files(1) - {COMMITTED})
    write_checkpoint(run, 8, checkpoint_files(1) - {COMMITTED, "__0_0.distcp"})  # a report Ray skipped
    for step in (4, 8):
        commit_checkpoint(str(run / f"checkpoint_step{step:06d}"), step, rank=0)
    assert (run / "checkpoint_step000004" / COMMITTED).exists() and not (run / "checkpoint_step000008" / COMMITTED).exists()
    assert latest_complete_checkpoint(str(run), 1) == "checkpoint_step000004"


def test_listing_works_on_s3(s3_bucket):
    import pyarrow.fs as pafs

    from core import storage

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


def test_a_checkpoint_resumes_only_with_the_worker_count_that_wrote_it(tmp_path):
    """The data position and RNG states are per worker: a 2-worker checkpoint is refused by 1 worker."""
    run = tmp_path / "run"
    assert newest_trainer_state(str(run)) is None

    def fresh():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    model, optimizer, _ = fresh()
    for step, world in ((3, 2), (6, 1), (12, 1)):
        save_checkpoint(run / f"checkpoint_step{step:06d}", model, optimizer, TrainerState(step=step, world_size=world),
                        rank=0)
    for step in (3, 6):
        mark_committed(str(run / f"checkpoint_step{step:06d}"), step)  # 12: its uploads never all returned
    write_checkpoint(run, 9, {".metadata", COMMITTED})  # taken, but its trainer state never landed
    uri, state = newest_trainer_state(str(run))
    assert (uri, state.step, state.world_size) == (str(run / "checkpoint_step000006"), 6, 1)

    assert load_checkpoint(run / "checkpoint_step000006", *fresh(), rank=0).step == 6  # one process, one worker
    with pytest.raises(WorldSizeMismatch, match=r"checkpoint_step000003: this checkpoint was written by 2 workers "
                                                r"but the run now has 1; resume it with scaling\.num_workers=2"):
        load_checkpoint(run / "checkpoint_step000003", *fresh(), rank=0)


def test_rng_state_loads_without_unpickling(tmp_path):
    """The RNG file on shared storage loads with weights_only=True (no pickle), and restores every generator."""
    import random

    import numpy as np
    import torch

    from train.checkpoint import rng_state, set_rng_state

    torch.save(rng_state(), tmp_path / "rng_rank0.pt")
    drawn = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(torch.load(tmp_path / "rng_rank0.pt", weights_only=True))
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(drawn[0], again[0]) and (drawn[1] == again[1]).all() and drawn[2] == again[2]


def test_an_elastic_run_resumes_a_checkpoint_of_any_size_with_the_same_global_batch(tmp_path):
    """Its data position is global (train/batches.py): any size goes, but not another global batch, and neither kind
    of run continues the other's checkpoint (their data orders differ)."""
    elastic = TrainerState(step=6, world_size=2, global_batch_rows=16)
    for world in (1, 2, 3):
        check_resumable(elastic, world, "ckpt", global_batch_rows=16, elastic=True)
    with pytest.raises(WorldSizeMismatch, match=r"ckpt: this checkpoint was written with a global batch of 16 rows but "
                                                r"the run now takes 32"):
        check_resumable(elastic, 2, "ckpt", global_batch_rows=32, elastic=True)
    with pytest.raises(WorldSizeMismatch, match=r"ckpt: this checkpoint was written by an elastic run; resume it with "
                                                r"scaling\.num_workers as its \[min, max\] range"):
        check_resumable(elastic, 2, "ckpt")
    with pytest.raises(WorldSizeMismatch, match=r"ckpt: this checkpoint was written by a fixed-size run of 2 workers, "
                                                r"whose data order is per worker; an elastic run cannot continue it"):
        check_resumable(TrainerState(step=6, world_size=2), 2, "ckpt", global_batch_rows=16, elastic=True)


def test_a_checkpoint_is_complete_for_the_size_its_marker_names(tmp_path):
    """A resized run looks for checkpoints of the size that wrote them, not of its own."""
    run = tmp_path / "run"
    write_checkpoint(run, 3, checkpoint_files(2) - {COMMITTED})
    mark_committed(str(run / "checkpoint_step000003"), 3, world_size=2)
    write_checkpoint(run, 6, checkpoint_files(1) - {COMMITTED})
    mark_committed(str(run / "checkpoint_step000006"), 6, world_size=1)
    write_checkpoint(run, 9, checkpoint_files(1) - {COMMITTED})  # a 2-rank checkpoint that lacks rank 1's files
    mark_committed(str(run / "checkpoint_step000009"), 9, world_size=2)
    for world in (1, 2, 4):
        assert latest_complete_checkpoint(str(run), world) == "checkpoint_step000006"


def test_an_elastic_checkpoint_loads_at_another_size_without_its_rank_rng(tmp_path, one_process_group):
    """One process resumes what 2 ranks wrote (DCP reshards; a 1-rank layout is the whole tensor): the weights and
    Adam's state come back, the position stays the writer's for the caller to carry over, and no rank's RNG file is
    loaded into a rank that did not write it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    save_checkpoint(tmp_path / "ckpt", model, optimizer,
                    TrainerState(step=6, world_size=2, micro_batches_into_epoch=6, global_batch_rows=16), rank=0)
    torch.manual_seed(1)
    fresh = torch.nn.Linear(4, 4)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    drawn = torch.rand(1)  # the generator's next draw, which a loaded RNG state would change
    torch.manual_seed(1)
    torch.nn.Linear(4, 4)
    state = load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt,
                            torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda step: 1.0), rank=0, global_batch_rows=16)
    assert (state.step, state.world_size, state.micro_batches_into_epoch) == (6, 2, 6)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(torch.rand(1), drawn)
