"""Sharded training checkpoints with torch.distributed.checkpoint (DCP).

One checkpoint directory holds
    .metadata, __<rank>_0.distcp   model + optimizer state, each rank writing only its own shards (under LoRA
                                   the adapter's weights and their optimizer state: the base is frozen)
    trainer_state.json             step, data position, scheduler state, tokens seen (rank 0)
    rng_rank<r>.pt                 each rank's torch / numpy / python RNG states
    committed                      written last, in storage, once every rank's upload has finished
Every rank writes into its own local directory; Ray Train merges them into one directory in storage
when the ranks report it. Resuming reads the merged directory back on every rank.

A checkpoint counts only once `committed` is there. Each rank uploads its own files, and a file being copied to
a local or NFS path is already visible under its final name, half written: a node that leaves mid-upload (a spot
reclaim whose grace ran out) would otherwise leave a directory that holds every name and is not a checkpoint.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from train.lora import trained_only

TRAINER_STATE = "trainer_state.json"
COMMITTED = "committed"
"""The marker rank 0 writes into a checkpoint's directory in storage once every rank has uploaded its files."""
# What a checkpoint holds of the model: the trained parameters (all of them, or under LoRA only the adapter's;
# the frozen base is read from the base model again on resume).
TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)


@dataclass
class TrainerState:
    """Everything besides tensors that a resumed run needs to continue exactly where it stopped."""

    step: int = 0
    """Optimizer steps completed."""
    epoch: int = 0
    """Epoch the next step reads from."""
    micro_batches_into_epoch: int = 0
    """Micro-batches of `epoch` already consumed (per worker, at `world_size` workers): the data position to skip to
    on resume. An elastic run resumed at another size converts it through the steps it stands for (train/batches.py)."""
    global_batch_rows: int = 0
    """Rows per step of an elastic run, whose data order does not depend on its size (train/batches.py); 0 for a
    fixed-size run, whose rows are split per worker."""
    tokens_seen: int = 0
    train_time_s: float = 0.0
    """Wall time spent inside optimizer steps (data wait included; eval and checkpoints not), over all attempts."""
    wall_time_s: float = 0.0
    """This rank's wall clock from each step's end to the next's, over all attempts: the step as the run experiences
    it, with the hooks, eval and checkpoints between steps (a resumed run starts its clock at its first step)."""
    eval_loss: float | None = None
    first_eval_loss: float | None = None
    eval_metrics: dict[str, float] = field(default_factory=dict)
    """The objective's other measures at the last evaluation (`eval_<name>`; DPO: eval_preference_accuracy, ...)."""
    scheduler: dict = field(default_factory=dict)
    world_size: int = 1
    export_uri: str | None = None
    exported_step: int | None = None
    """The step the export at `export_uri` was written at; a resumed finished run does not export again."""
    save_seconds: list[float] = field(default_factory=list)
    """How long the run's last checkpoints took (rank 0's measure, seconds, newest last): what a termination notice's
    save is expected to take in a resumed run before it has measured one of its own (train/notice.py)."""

    @classmethod
    def from_json(cls, text: str) -> "TrainerState":
        data = json.loads(text)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def rng_state() -> dict:
    """Every RNG's state as tensors, ints and strings only, so that it loads with `weights_only=True`: a checkpoint
    lives on shared storage, and unpickling anything else from there could run code."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(), "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                     cached],
            "python": random.getstate(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_file_name(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def save_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state: TrainerState, rank: int) -> None:
    """Collective: every rank writes its shards (and RNG state) into `directory`; rank 0 adds the trainer state."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    model_sd = trained_only(model, model_sd)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory))
    torch.save(rng_state(), directory / rng_file_name(rank))
    if rank == 0:
        (directory / TRAINER_STATE).write_text(json.dumps(asdict(state), indent=2))


CHECKPOINT_PREFIX = "checkpoint_step"


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint taken at `step` (names sort by step)."""
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def checkpoint_files(world_size: int) -> set[str]:
    """The files a complete checkpoint of `world_size` ranks holds (DCP shards, RNG states, trainer state, the
    commit marker)."""
    return {".metadata", TRAINER_STATE, COMMITTED, *(f"__{r}_0.distcp" for r in range(world_size)),
            *(rng_file_name(r) for r in range(world_size))}


def mark_committed(checkpoint_uri: str, step: int, world_size: int = 1) -> None:
    """Write the commit marker into the checkpoint at `checkpoint_uri` (in storage): call it once every rank's upload
    has returned, never before (train/worker.py `report_checkpoint`: rank 0, after a barrier). It names the step and
    how many ranks wrote it (an elastic run resumes checkpoints of other sizes)."""
    from core import storage

    storage.write_text(storage.join(checkpoint_uri, COMMITTED), json.dumps({"step": step, "world_size": world_size}))


def latest_complete_checkpoint(run_uri: str, world_size: int) -> str | None:
    """The newest `checkpoint_step*` directory under `run_uri` that holds every rank's files and the commit marker.

    Ray Train registers a reported checkpoint when its controller next polls the workers, so a worker
    that dies right after `ray.train.report` can leave a complete checkpoint in storage that Ray does not
    know of; resuming from it keeps the work instead of redoing it from an older one. A directory without the
    marker (an upload cut off, a checkpoint being deleted) is never picked. Each checkpoint is checked against
    the number of ranks its marker names (`world_size` where a marker predates that).
    """
    from core import storage

    found: dict[str, set[str]] = {}
    for rel in storage.list_files(run_uri):
        top, _, name = rel.partition("/")
        if top.startswith(CHECKPOINT_PREFIX) and name:
            found.setdefault(top, set()).add(name)
    for name in sorted((d for d, names in found.items() if COMMITTED in names), reverse=True):
        try:
            text = storage.read_text(storage.join(run_uri, name, COMMITTED))
        except FileNotFoundError:
            continue  # deleted meanwhile
        try:
            writers = int(json.loads(text).get("world_size", world_size))
        except (ValueError, AttributeError):
            writers = world_size  # a marker without its size
        if checkpoint_files(writers) <= found[name]:
            return name
    return None


def newest_trainer_state(run_uri: str) -> tuple[str, TrainerState] | None:
    """The newest committed `checkpoint_step*` directory under `run_uri` (local or s3://) with a trainer state, and
    the state."""
    from core import storage

    found: dict[str, set[str]] = {}
    for rel in storage.list_files(run_uri):
        top, _, name = rel.partition("/")
        if top.startswith(CHECKPOINT_PREFIX):
            found.setdefault(top, set()).add(name)
    names = sorted(d for d, files in found.items() if {TRAINER_STATE, COMMITTED} <= files)
    if not names:
        return None
    uri = storage.join(run_uri, names[-1])
    return uri, TrainerState.from_json(storage.read_text(storage.join(uri, TRAINER_STATE)))


class WorldSizeMismatch(ValueError):
    """A checkpoint this run cannot resume: written by another number of workers (a fixed-size run), or with another
    data order or global batch (an elastic run)."""


def check_resumable(state: TrainerState, world_size: int, where: str, global_batch_rows: int = 0,
                    elastic: bool = False) -> None:
    """Refuse to resume `state` (from the checkpoint at `where`) where its data position would mean other rows.

    A fixed-size run's data position (micro-batches into the epoch) and RNG states are per worker: with another
    worker count the resumed run would neither skip the rows it already trained on nor draw the same random numbers,
    although DCP could reshard the model and optimizer. An elastic run's position is global (`global_batch_rows` per
    step, in an order that does not depend on the size), so it resumes at any size with the same global batch.
    """
    if elastic:
        if not state.global_batch_rows:
            raise WorldSizeMismatch(f"{where}: this checkpoint was written by a fixed-size run of {state.world_size} "
                                    f"workers, whose data order is per worker; an elastic run cannot continue it: "
                                    f"resume it with scaling.num_workers={state.world_size}, or start a new run_name")
        if state.global_batch_rows != global_batch_rows:
            raise WorldSizeMismatch(f"{where}: this checkpoint was written with a global batch of "
                                    f"{state.global_batch_rows} rows but the run now takes {global_batch_rows}; "
                                    f"keep train.micro_batch_size x grad_accum_steps x max workers, or start a new "
                                    f"run_name")
        return
    if state.global_batch_rows:
        raise WorldSizeMismatch(f"{where}: this checkpoint was written by an elastic run; resume it with "
                                f"scaling.num_workers as its [min, max] range, or start a new run_name")
    if state.world_size != world_size:
        raise WorldSizeMismatch(
            f"{where}: this checkpoint was written by {state.world_size} workers but the run now has "
            f"{world_size}; resume it with scaling.num_workers={state.world_size}, or start a new run_name")


def read_trainer_state(directory: str | Path) -> TrainerState:
    path = Path(directory) / TRAINER_STATE
    if not path.exists():
        raise FileNotFoundError(f"{directory}: not a rayline checkpoint ({TRAINER_STATE} missing)")
    return TrainerState.from_json(path.read_text())


def load_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, rank: int,
                    global_batch_rows: int = 0) -> TrainerState:
    """Collective: restore model, optimizer, scheduler and this rank's RNG state; returns the trainer state (its
    `world_size` still the writer's). An elastic run (`global_batch_rows` > 0) loads a checkpoint of any size: DCP
    reshards the model and optimizer onto this one, and the RNG states, which are per rank, are not loaded.

    Raises WorldSizeMismatch when the checkpoint cannot be resumed here (check_resumable)."""
    directory = Path(directory)
    state = read_trainer_state(directory)
    world = dist.get_world_size() if dist.is_initialized() else 1
    check_resumable(state, world, str(directory), global_batch_rows, elastic=global_batch_rows > 0)
    # get_state_dict gives the sharded layout (and initialises empty optimizer state) for DCP to fill in place.
    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    to_load = {"model": trained_only(model, model_sd), "optim": optim_sd}
    dcp.load(to_load, checkpoint_id=str(directory))  # every trained tensor must be there: DCP refuses partial loads
    # Not strict: the frozen base weights (LoRA) are not in the checkpoint, they come from the base model.
    set_state_dict(model, optimizer, model_state_dict=to_load["model"], optim_state_dict=to_load["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    if state.scheduler:
        scheduler.load_state_dict(state.scheduler)
    rng_file = directory / rng_file_name(rank)
    if state.world_size == world and rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=True))
    return state
