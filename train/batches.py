"""Where a Ray Train worker's micro-batches come from: its own shard (a fixed-size run), or its rows of one global
order that does not depend on the number of workers (an elastic run).

A fixed-size run gives each worker an even split of the train split (Ray's `streaming_split`) and a local shuffle
buffer reseeded every epoch; its data position is per worker, so it resumes only at its own size. An elastic run
gives every worker the whole train split in its prepared order; each cuts it into windows of
`data.shuffle_buffer_rows` rows, permutes each window by a generator seeded with (seed, epoch, window), and takes its
rows of every step: step s holds positions [s*G, (s+1)*G) of the epoch's order (G = the global batch), and rank r's
micro-batch m of it the `micro` rows from s*G + (m*W + r)*micro. Which rows a step trains on depends on the seed and
the epoch alone, so a run resized between two steps goes on with exactly the rows the old size would have read.
Every worker reads the whole train split (W times the reading of a split run): the price of that order.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np
import torch

from train.config import TrainConfig
from train.loop import Batch

ELASTIC_WINDOW_ROWS = 1024
"""Rows read at a time by an elastic run that does not shuffle (`data.shuffle_buffer_rows: 0`)."""


class ShardBatches:
    """A `BatchSource` over this worker's Ray Data shards: deterministic order, reseeded shuffle per epoch."""

    def __init__(self, train_shard, eval_shard, cfg: TrainConfig, device: torch.device,
                 dtypes: torch.dtype | dict[str, torch.dtype] = torch.int64):
        self.train_shard, self.eval_shard = train_shard, eval_shard
        self.cfg, self.device, self.dtypes = cfg, device, dtypes

    def train_batches(self, epoch: int) -> Iterable[Batch]:
        buffer = self.cfg.data.shuffle_buffer_rows or None
        return self.train_shard.iter_torch_batches(
            batch_size=self.cfg.train.micro_batch_size, drop_last=True, dtypes=self.dtypes, device=self.device,
            local_shuffle_buffer_size=buffer, local_shuffle_seed=self.cfg.train.seed + epoch if buffer else None,
        )

    def eval_batches(self) -> Iterable[Batch]:
        return self.eval_shard.iter_torch_batches(batch_size=self.cfg.train.eval_batch_size, dtypes=self.dtypes,
                                                  device=self.device)


def window_order(seed: int, epoch: int, window: int, rows: int, shuffle: bool) -> np.ndarray:
    """The order of one window's `rows` rows in an epoch of an elastic run."""
    if not shuffle:
        return np.arange(rows)
    return np.random.default_rng((seed, epoch, window)).permutation(rows)


def rank_positions(positions: np.ndarray, rank: int, world: int, micro: int, global_batch: int) -> np.ndarray:
    """Which of the epoch's `positions` rank `rank` of `world` trains on: the micro-batches m*W + rank of each step."""
    within = positions % global_batch
    return (within // micro) % world == rank


class GlobalOrderBatches(ShardBatches):
    """A `BatchSource` for an elastic run: this rank's rows of the whole train split's epoch order (module doc)."""

    def __init__(self, train_data, eval_shard, cfg: TrainConfig, device: torch.device,
                 dtypes: torch.dtype | dict[str, torch.dtype], rank: int, world: int, global_batch: int,
                 steps_per_epoch: int):
        super().__init__(train_data, eval_shard, cfg, device, dtypes)
        self.rank, self.world, self.global_batch = rank, world, global_batch
        self.epoch_rows = steps_per_epoch * global_batch

    def train_batches(self, epoch: int) -> Iterator[Batch]:
        micro = self.cfg.train.micro_batch_size
        shuffle = self.cfg.data.shuffle_buffer_rows > 0
        window = self.cfg.data.shuffle_buffer_rows or ELASTIC_WINDOW_ROWS
        held: Batch | None = None  # this rank's rows read but not yet yielded (fewer than a micro-batch)
        start = 0
        rows = self.train_shard.iter_torch_batches(batch_size=window, dtypes=self.dtypes, device="cpu")
        for index, block in enumerate(rows):
            n = len(next(iter(block.values())))
            order = torch.from_numpy(window_order(self.cfg.train.seed, epoch, index, n, shuffle))
            positions = np.arange(start, start + n)
            start += n
            keep = rank_positions(positions, self.rank, self.world, micro, self.global_batch)
            keep &= positions < self.epoch_rows  # the epoch ends at its last whole step
            chosen = order[torch.from_numpy(keep)]
            mine = {k: v[chosen] for k, v in block.items()}
            # One copy per window: the leftover rows joined to this window's, then cut into micro-batches.
            if held is not None:
                mine = {k: torch.cat([held[k], v]) for k, v in mine.items()}
            count = len(next(iter(mine.values())))
            whole = count - count % micro
            for i in range(0, whole, micro):
                yield {k: v[i:i + micro].to(self.device) for k, v in mine.items()}
            held = {k: v[whole:] for k, v in mine.items()}
            if start >= self.epoch_rows:
                return
