"""Near-duplicate removal: MinHash signatures of word shingles, LSH bands, spread over the stage's own shuffle.

Each example's content (lower-cased, split on whitespace) becomes a set of `ngram`-word shingles; its MinHash
signature is `num_perm` minima of seeded multiply-add hashes over that set, so two signatures agree in a position
with probability equal to the sets' Jaccard similarity. The signature is cut into `bands` bands of `rows` values
(chosen for `threshold` as datasketch's MinHashLSH chooses them: least false positives plus false negatives under
the S-curve 1 - (1 - s^rows)^bands); two examples with an equal band are near copies. As in datasketch's LSH, a
shared band is the test: signatures are not compared again, so `threshold` is where the S-curve rises, not a cut.

Distributed, in three steps of the stage (data/prepare.py):
  1. read tasks compute each example's band keys (`band_keys`, fused with the read like the rest of the per-record
     work) and write one row per (band key, example) to the band partition `band key % partitions` (data/shuffle.py);
  2. one task per band partition sorts its rows by band key and, in each bucket, names every other example a near
     copy of the bucket's first: the eval copy first, then the smallest (source, line), as exact dedup keeps. Its
     output goes to the shard of the removed example (`near_duplicates`);
  3. each shard task drops the examples named, keeping for each the first record it was named a near copy of, and
     writes them to its rejects as near_duplicate (data/shards.py).
A record that is a near copy of one that is itself removed is removed too (no chains are followed). A band
partition holds `bands` rows per example of its share, so, like the shards, its memory follows `partitions`, not the
corpus. Everything is seeded (the permutations by a fixed seed, the order by content and location): a re-run removes
the same records and names the same references.

Written in numpy rather than with datasketch: datasketch's LSH is an index in one process (or Redis/Cassandra),
where the stage needs band keys as columns to shuffle, and its MinHash hashes every shingle with SHA-1 in Python.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data.records import Messages

BAND_SCHEMA = pa.schema([("band", pa.uint64()), ("key0", pa.uint64()), ("split", pa.int8()), ("source", pa.string()),
                         ("line", pa.int64())])
NEAR_SCHEMA = pa.schema([("key0", pa.uint64()), ("ref_split", pa.int8()), ("ref_source", pa.string()),
                         ("ref_line", pa.int64())])
_SEED = 0x5EED_0F_3EA7  # fixed: signatures must not change with the stage's seed, or the same corpus loses other records
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def lsh_bands(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) with bands * rows <= num_perm minimising false positive plus false negative area for
    `threshold` (the weighting datasketch's MinHashLSH uses by default, 0.5 / 0.5)."""
    s = np.linspace(0.0, 1.0, 1001)
    best = None
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            p = 1.0 - (1.0 - s**rows) ** bands
            fp = np.trapezoid(np.where(s < threshold, p, 0.0), s)
            fn = np.trapezoid(np.where(s >= threshold, 1.0 - p, 0.0), s)
            error = 0.5 * fp + 0.5 * fn
            if best is None or error < best[0]:
                best = (error, bands, rows)
    return best[1], best[2]


@dataclass(frozen=True)
class NearDupPlan:
    """What the read tasks and the band tasks need; built once by the driver."""

    ngram: int
    num_perm: int
    bands: int
    rows: int
    partitions: int

    @classmethod
    def from_config(cls, cfg, partitions: int) -> "NearDupPlan":
        bands, rows = lsh_bands(cfg.near_dedup_threshold, cfg.near_dedup_num_perm)
        return cls(cfg.near_dedup_ngram, cfg.near_dedup_num_perm, bands, rows, partitions)


_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_CHUNK_SHINGLES = 2048  # shingles per vectorised MinHash step: num_perm x this uint64s (2 MiB at 128) stay in cache


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit moves every output bit (uint64 array arithmetic wraps, as intended)."""
    x = (x ^ (x >> _S30)) * _C1
    x = (x ^ (x >> _S27)) * _C2
    return x ^ (x >> _S31)


@functools.lru_cache(maxsize=4)
def _permutations(num_perm: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(_SEED)
    a = rng.integers(1, 2**63, num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)  # odd: a bijection mod 2^64
    return a[:, None], rng.integers(0, 2**63, num_perm, dtype=np.uint64)[:, None]


@functools.lru_cache(maxsize=8)
def _weights(n: int) -> np.ndarray:
    return np.random.default_rng(_SEED + n).integers(1, 2**63, n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def content_text(content: Messages | str) -> str:
    """What is compared: a raw text, or a conversation's turns one after another."""
    return content if isinstance(content, str) else "\n".join(text for _, text in content)


def _combine(hashed: np.ndarray, n: int, count: int) -> np.ndarray:
    """Hashes of the `count` windows of `n` consecutive word hashes starting at 0, 1, ... (order matters)."""
    weights = _weights(n)
    out = hashed[:count] * weights[0]
    for j in range(1, n):
        out += hashed[j: count + j] * weights[j]
    return _mix(out)


def shingles(texts: list[str], ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """64-bit hashes of the `ngram`-word shingles of every text (lower-cased, split on whitespace; a text of fewer
    words is one shingle of them all, an empty one the shingle 0), and where each text's shingles start."""
    words = [t.lower().split() for t in texts]
    lengths = np.fromiter((len(w) for w in words), np.int64, len(words))
    hashed = _mix(np.fromiter((zlib.crc32(w.encode()) for ws in words for w in ws), np.uint64, int(lengths.sum())))
    starts = np.cumsum(lengths) - lengths
    # Windows over all the words at once; those that run past their own text's end are dropped.
    full = _combine(hashed, ngram, max(len(hashed) - ngram + 1, 0))
    keep = np.ones(len(full), bool)
    if len(full):
        ends = starts + lengths
        owner = np.repeat(np.arange(len(texts)), lengths)[: len(full)]
        keep = np.arange(len(full)) + ngram <= ends[owner]
    per_text = np.maximum(lengths - ngram + 1, 0)
    out = full[keep]
    short = np.flatnonzero(lengths < ngram)
    if len(short):  # rare: texts of fewer than ngram words, one shingle each, put in their places
        pieces = np.split(out, np.cumsum(per_text)[:-1])
        for i in short:
            n = int(lengths[i])
            pieces[i] = _combine(hashed[starts[i]: starts[i] + n], n, 1) if n else np.zeros(1, np.uint64)
        per_text = np.maximum(per_text, 1)
        out = np.concatenate(pieces)
    return out, np.cumsum(per_text) - per_text


def minhash(hashes: np.ndarray, starts: np.ndarray, num_perm: int) -> np.ndarray:
    """MinHash signatures (len(starts) x num_perm) of sets of 64-bit hashes laid end to end (`starts`: where each set
    begins, none empty): for each seeded permutation a*h + b (mod 2^64), the set's minimum."""
    a, b = _permutations(num_perm)
    out = np.empty((len(starts), num_perm), np.uint64)
    bounds = np.append(starts, len(hashes))
    first = 0
    while first < len(starts):  # sets in chunks of about _CHUNK_SHINGLES hashes, whole sets each
        last = max(first + 1, int(np.searchsorted(bounds, bounds[first] + _CHUNK_SHINGLES, "right")) - 1)
        last = min(last, len(starts))
        lo, hi = bounds[first], bounds[last]
        values = a * hashes[None, lo:hi] + b
        out[first:last] = np.minimum.reduceat(values, bounds[first:last] - lo, axis=1).T
        first = last
    return out


def band_keys(contents: list[Messages | str], plan: NearDupPlan) -> np.ndarray:
    """The examples' LSH keys (len(contents) x bands): each band's rows of the signature hashed together with the
    band's number."""
    hashes, starts = shingles([content_text(c) for c in contents], plan.ngram)
    sig = minhash(hashes, starts, plan.num_perm)[:, : plan.bands * plan.rows].reshape(len(contents), plan.bands, plan.rows)
    combined = (sig * _weights(plan.rows)).sum(axis=2, dtype=np.uint64)
    return _mix(combined + np.arange(plan.bands, dtype=np.uint64) * _GOLDEN)


def band_rows(examples: pa.Table) -> pa.Table:
    """One BAND_SCHEMA row per (band key, example) of a block of examples with a `bands` list column."""
    has = pc.is_valid(examples["bands"])
    examples = examples.filter(has)
    counts = pc.list_value_length(examples["bands"]).to_numpy(zero_copy_only=False)
    which = np.repeat(np.arange(examples.num_rows), counts)
    flat = pc.list_flatten(examples["bands"])
    picked = examples.select(["key0", "split", "source", "line"]).take(which)
    return pa.Table.from_arrays([flat, *picked.columns], schema=BAND_SCHEMA)


def near_duplicates(bands: pa.Table, num_shards: int) -> dict[int, pa.Table]:
    """Of one band partition's rows: per shard, every example named a near copy (NEAR_SCHEMA: its key0, and the split,
    source and line of the bucket's first example). A bucket's examples with the first one's key0 are exact copies of
    it (exact dedup's business) and are not named."""
    if not bands.num_rows:
        return {}
    order = pc.sort_indices(bands, [("band", "ascending"), ("split", "descending"), ("source", "ascending"),
                                    ("line", "ascending")])
    bands = bands.take(order)
    band, key0 = bands["band"].to_numpy(), bands["key0"].to_numpy()
    first = np.ones(len(band), bool)
    first[1:] = band[1:] != band[:-1]
    ref = np.maximum.accumulate(np.where(first, np.arange(len(band)), 0))
    near = key0 != key0[ref]
    if not near.any():
        return {}
    removed, refs = np.flatnonzero(near), ref[near]
    table = pa.Table.from_arrays([pa.array(key0[removed]), bands["split"].take(refs), bands["source"].take(refs),
                                  bands["line"].take(refs)], schema=NEAR_SCHEMA)
    shard = key0[removed] % np.uint64(num_shards)
    return {int(s): table.filter(pa.array(shard == s)) for s in np.unique(shard)}


def first_references(near: pa.Table) -> dict[int, tuple[str, int]]:
    """key0 -> (source, line) of the first record (eval first, then smallest source and line) it was named a near
    copy of, over every band it shared."""
    if not near.num_rows:
        return {}
    near = near.take(pc.sort_indices(near, [("key0", "ascending"), ("ref_split", "descending"),
                                            ("ref_source", "ascending"), ("ref_line", "ascending")]))
    key0 = near["key0"].to_numpy()
    first = np.ones(len(key0), bool)
    first[1:] = key0[1:] != key0[:-1]
    picked = near.filter(pa.array(first))
    return dict(zip(picked["key0"].to_pylist(), zip(picked["ref_source"].to_pylist(), picked["ref_line"].to_pylist())))
