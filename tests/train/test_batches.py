"""An elastic run's data order (train/batches.py): each step trains on the same rows at any number of workers, every
row of an epoch's whole steps once, and a position carried across a resize skips exactly the steps already taken."""

from __future__ import annotations

import itertools

import pytest
import torch

from core.config import from_dict
from train.batches import GlobalOrderBatches
from train.checkpoint import TrainerState
from train.config import TrainConfig
from train.loop import LoopPlan
from train.worker import resize_state, sized_loop

ROWS, MICRO, GLOBAL = 100, 2, 12  # 8 whole steps of 12 rows; 4 rows left over each epoch


class Rows:
    """The train split as Ray Data's iterator gives it to a worker: its rows in order, in batches of a given size."""

    def __init__(self, rows: int):
        self.ids = torch.arange(rows)

    def iter_torch_batches(self, batch_size, dtypes=None, device="cpu", **_):
        for start in range(0, len(self.ids), batch_size):
            yield {"row": self.ids[start:start + batch_size], "twice": 2 * self.ids[start:start + batch_size]}


def config(shuffle_rows: int) -> TrainConfig:
    return from_dict(TrainConfig, {"run_name": "r", "model": {"path": "m"}, "checkpoint": {"storage_path": "s"},
                                   "data": {"manifest_uri": "d", "shuffle_buffer_rows": shuffle_rows},
                                   "train": {"micro_batch_size": MICRO}, "scaling": {"num_workers": [1, 3]}}, "test")


def steps(world: int, epoch: int, shuffle_rows: int = 16) -> list[set[int]]:
    """The rows of each step of `epoch` at `world` workers, as every rank's micro-batches make them up."""
    accum = GLOBAL // (MICRO * world)
    per_rank = [list(GlobalOrderBatches(Rows(ROWS), None, config(shuffle_rows), torch.device("cpu"), torch.int64, rank,
                                        world, GLOBAL, ROWS // GLOBAL).train_batches(epoch)) for rank in range(world)]
    for batches in per_rank:
        assert all(torch.equal(b["twice"], 2 * b["row"]) and len(b["row"]) == MICRO for b in batches)
        assert len(batches) == (ROWS // GLOBAL) * accum
    return [{int(r) for rank in per_rank for b in rank[s * accum:(s + 1) * accum] for r in b["row"]}
            for s in range(ROWS // GLOBAL)]


@pytest.mark.parametrize("shuffle_rows", [0, 16, 7])
def test_every_step_takes_the_same_rows_at_any_size_and_every_row_once_per_epoch(shuffle_rows):
    one = steps(1, epoch=0, shuffle_rows=shuffle_rows)
    assert all(len(rows) == GLOBAL for rows in one)
    assert sorted(itertools.chain.from_iterable(one)) == sorted(set().union(*one))  # no row twice in an epoch
    assert len(set().union(*one)) == (ROWS // GLOBAL) * GLOBAL  # and only the tail past the last whole step left out
    for world in (2, 3):
        assert steps(world, epoch=0, shuffle_rows=shuffle_rows) == one
    if shuffle_rows:
        assert steps(1, epoch=1, shuffle_rows=shuffle_rows) != one  # reshuffled every epoch
    else:
        assert one[0] == set(range(GLOBAL))  # the prepared order


def test_a_position_carried_across_a_resize_skips_exactly_the_steps_taken():
    loop = LoopPlan(total_steps=20, steps_per_epoch=8, grad_accum_steps=2, eval_every_steps=4,
                    checkpoint_every_steps=3, rows_per_micro_batch=MICRO, global_batch_rows=GLOBAL)
    assert [sized_loop(loop, w).grad_accum_steps for w in (1, 2, 3)] == [6, 3, 2]
    state = TrainerState(step=11, epoch=1, micro_batches_into_epoch=3 * 3, world_size=2, global_batch_rows=GLOBAL)
    assert resize_state(state, loop, 3) == 2
    assert (state.world_size, state.micro_batches_into_epoch) == (3, 3 * 2)  # 3 steps into epoch 1, at either size
    resize_state(state, loop, 1)
    assert state.micro_batches_into_epoch == 3 * 6
    fixed = LoopPlan(total_steps=20, steps_per_epoch=8, grad_accum_steps=2, eval_every_steps=4,
                     checkpoint_every_steps=3)
    assert sized_loop(fixed, 3) is fixed  # a fixed-size run keeps its plan
