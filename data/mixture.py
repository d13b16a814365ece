"""Weighted mixtures: several named sources sampled by weight into one training set, deterministically from the seed.

A mixture takes `mixture_records` input records (lines) in all; source i gets `weight_i / sum(weights)` of them,
rounded by largest remainder, so every source's count is within one record of its exact share and the counts add
up to the total. A source asked for `c` of its `n` records takes each record `c // n` times (the whole source,
repeated) and `c % n` of them once more: those whose seeded hash of (file, line) is smallest. So no record is taken
twice before every record of its source is taken once, and the choice depends on the seed, the source's name and
its files only, not on the cluster or the order tasks run in.

Choosing exactly `c % n` records needs every record's hash first: the driver reads each mixture source once more
before the stage's read phase (a pass that splits lines and hashes locations, no parsing; remote objects in Ray
tasks). The read tasks then repeat each line as often as it is taken (`copies`), before parsing; an upsampled
record's copies get distinct dedup keys (data/examples.py), so exact dedup removes copies across records, not a
record's own repeats.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import ray

from data.sources import SourceFile, read_lines
from core import storage


def shares(weights: list[float], total: int) -> list[int]:
    """`total` split by `weights` with largest remainder: each count within one of its exact share, summing to total
    (ties go to the earlier source)."""
    exact = [w / sum(weights) * total for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def most_without_repeats(records: list[int], weights: list[float]) -> int:
    """The largest total whose shares take no source's record twice."""
    total = min(int(n * sum(weights) / w + 1e-6) for n, w in zip(records, weights))
    while any(c > n for c, n in zip(shares(weights, total), records)):
        total -= 1  # float rounding at the edge
    return total


def source_key(seed: int, name: str) -> bytes:
    return hashlib.blake2b(f"{seed}\0{name}".encode(), digest_size=16).digest()


def location_hash(uri: str, line: int, key: bytes) -> int:
    """A seeded 64-bit hash of where a record is: what orders a source's records for the extra copies."""
    return int.from_bytes(hashlib.blake2b(f"{uri}:{line}".encode(), digest_size=8, key=key).digest(), "little")


def file_hashes(f: SourceFile, key: bytes) -> np.ndarray:
    """`location_hash` of every record of one file (records as the read tasks see them: non-blank lines)."""
    out = [np.fromiter((location_hash(f.uri, line, key) for line in block["line"].to_pylist()), np.uint64)
           for block in read_lines(f, 1 << 16)]
    return np.concatenate(out) if out else np.zeros(0, np.uint64)


@dataclass(frozen=True)
class MixturePlan:
    """What the read tasks need: per file of the mixture, (base copies, threshold, key). A record is taken
    `base` times, once more when its location hash is <= threshold (-1: none is)."""

    files: dict[str, tuple[int, int, bytes]]

    def copies(self, block: pa.Table) -> np.ndarray:
        """How many times each line of a block of raw lines is taken (files outside the mixture: once)."""
        out = np.ones(block.num_rows, np.int64)
        for i, (uri, line) in enumerate(zip(block["source"].to_pylist(), block["line"].to_pylist())):
            if (spec := self.files.get(uri)) is not None:
                base, threshold, key = spec
                out[i] = base + (location_hash(uri, line, key) <= threshold)
        return out


def expand(block: pa.Table, plan: MixturePlan | None) -> tuple[pa.Table, list[int]]:
    """The block with each line repeated as often as it is taken, and each row's copy number (0 for the first)."""
    if plan is None:
        return block, [0] * block.num_rows
    takes = plan.copies(block)
    if (takes == 1).all():
        return block, [0] * block.num_rows
    rows = np.repeat(np.arange(block.num_rows), takes)
    copy = np.arange(len(rows)) - np.repeat(np.cumsum(takes) - takes, takes)
    return block.take(rows), copy.tolist()


def plan_mixture(cfg, files_of: list[list[SourceFile]]) -> tuple[MixturePlan, list[dict]]:
    """The plan and the manifest's `mixture` rows for `cfg.mixture`, whose sources' files are `files_of`."""
    keys = [source_key(cfg.seed, m.name) for m in cfg.mixture]
    hashes = _hashes([(f, key) for files, key in zip(files_of, keys) for f in files])
    records = []
    for i, (m, files) in enumerate(zip(cfg.mixture, files_of)):
        n = sum(len(hashes[f.uri]) for f in files)
        if n == 0:
            raise ValueError(f"mixture[{i}] ({m.name}): its inputs hold no records")
        records.append(n)
    weights = [m.weight for m in cfg.mixture]
    total = cfg.mixture_records or most_without_repeats(records, weights)
    plan: dict[str, tuple[int, int, bytes]] = {}
    rows = []
    for m, files, key, n, taken in zip(cfg.mixture, files_of, keys, records, shares(weights, total)):
        extra = taken % n
        threshold = -1
        if extra:
            every = np.concatenate([hashes[f.uri] for f in files])
            threshold = int(np.partition(every, extra - 1)[extra - 1])
        plan.update({f.uri: (taken // n, threshold, key) for f in files})
        rows.append({"name": m.name, "weight": round(m.weight / sum(weights), 6), "inputs": m.inputs,
                     "records": n, "taken": taken, "whole_repeats": taken // n, "extra": extra})
    return MixturePlan(plan), rows


def _hashes(items: list[tuple[SourceFile, bytes]]) -> dict[str, np.ndarray]:
    """`file_hashes` of every file: local files here, where they are; s3:// objects in Ray tasks, next to the data."""
    remote = [(f, key) for f, key in items if storage.is_remote(f.uri)]
    refs = [ray.remote(num_cpus=0.5)(file_hashes).remote(f, key) for f, key in remote]
    out = {f.uri: file_hashes(f, key) for f, key in items if not storage.is_remote(f.uri)}
    if refs:
        out.update(zip([f.uri for f, _ in remote], ray.get(refs)))
    return out
