"""One shard of examples -> its Parquet files and rejects file, plus the counts the manifest adds up.

A shard is one partition of the hash shuffle on content (`data.shuffle`), so every copy of an example is in the same
shard. This is the second half of the stage, run once per shard: exact dedup, the deterministic
shuffle order, tokenizing, the too_long policy, packing (or padding), and writing
    <version>/train/part-<shard>.parquet, <version>/eval/part-<shard>.parquet, <version>/rejects/part-<shard>.jsonl
(with near_dedup, after the exact dedup, the near copies data/near_dedup.py found are dropped too)
The shard's name is its smallest row key (16 hex digits): fixed by its content, so a retried task
overwrites its own output instead of adding to it, and a re-run writes the same names.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data.examples import EVAL, TRAIN
from core.collector import no_cycle_collection
from data.heap import keep_freed_memory
from data.near_dedup import first_references
from data.packing import IGNORE, PackedRows, pack_sequences, pad_sequences
from data.prepared import COLUMNS, ROW_SCHEMA
from data.shuffle import read_partition
from data.tokens import byte_lengths, encode_with_labels, load_backend, set_thread_count
from core import storage

SPLITS = {TRAIN: "train", EVAL: "eval"}


@dataclass(frozen=True)
class ShardPlan:
    """Everything a shard task needs; built by the driver, shipped to every task."""

    version_uri: str
    backend_json: str  # the Rust tokenizer exactly as transformers configured it (tokenizer.backend_tokenizer)
    format: str
    seq_len: int
    packing: str
    truncate: bool
    dedup: bool
    seed: int
    pad_id: int
    tokenize_batch_size: int
    tokenizer_threads: int = 1


def dedup_examples(group: pa.Table, rows: np.ndarray, dedup: bool) -> tuple[pa.Table, int]:
    """Of `group`'s `rows` (indices of its examples), keep one per content key (an eval copy before a train copy,
    then the first source and line), train rows before eval rows, each split in the seeded shuffle order (so each
    split's tokens are one slice). Returns the kept rows and how many duplicates were dropped. The sorts are of
    keys only: the text is copied once, by the last take."""
    keys = group.select(["key0", "key1", "split", "source", "line", "order"]).take(rows)
    dropped = 0
    if dedup and len(rows):
        by_key = pc.sort_indices(keys, [("key0", "ascending"), ("key1", "ascending"), ("split", "descending"),
                                        ("source", "ascending"), ("line", "ascending")]).to_numpy()
        k0, k1 = keys["key0"].to_numpy()[by_key], keys["key1"].to_numpy()[by_key]
        first = np.ones(len(by_key), bool)
        first[1:] = (k0[1:] != k0[:-1]) | (k1[1:] != k1[:-1])
        dropped = int(len(by_key) - first.sum())
        kept = by_key[first]
        keys = keys.take(kept)
    else:
        kept = np.arange(len(rows))
    order = pc.sort_indices(keys, [("split", "ascending"), ("order", "ascending"), ("key1", "ascending")]).to_numpy()
    return group.take(rows[kept[order]]), dropped


def tokenize_examples(backend, examples: pa.Table, plan: ShardPlan,
                      token_bytes: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat ids, flat labels and lengths for every row of `examples`, in row order."""
    parts = []
    for start in range(0, examples.num_rows, plan.tokenize_batch_size):
        chunk = examples.slice(start, plan.tokenize_batch_size)
        spans = None if plan.format == "text" else chunk["spans"].to_pylist()
        parts.append(encode_with_labels(backend, chunk["text"].to_pylist(), spans, token_bytes))
    if not parts:
        return np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int64)
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))


def apply_length_policy(ids, labels, lengths, plan: ShardPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Chat examples over seq_len are cut (truncate) or rejected; raw text is left for packing to split.

    Returns (ids, labels, lengths) of the kept examples, the kept mask and a per-example truncated mask.
    An example cut down to no label at all is rejected too: it would teach nothing.
    """
    n = len(lengths)
    over = lengths > plan.seq_len
    if plan.format == "text" or not over.any():
        return ids, labels, lengths, np.ones(n, bool), np.zeros(n, bool)
    position = np.arange(len(ids)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    if not plan.truncate:
        keep = ~over
        token_keep = np.repeat(keep, lengths)
        return ids[token_keep], labels[token_keep], lengths[keep], keep, np.zeros(n, bool)
    token_keep = position < plan.seq_len
    ids, labels, lengths = ids[token_keep], labels[token_keep], np.minimum(lengths, plan.seq_len)
    example = np.repeat(np.arange(n), lengths)
    has_label = np.bincount(example, weights=(labels != IGNORE).astype(np.float64), minlength=n) > 0
    keep = ~(over & ~has_label)
    token_keep = np.repeat(keep, lengths)
    return ids[token_keep], labels[token_keep], lengths[keep], keep, over & keep


def rows_table(packed: PackedRows) -> pa.Table:
    rows, seq_len = packed.input_ids.shape
    offsets = pa.array(np.arange(0, rows * seq_len + 1, seq_len, dtype=np.int32))
    arrays = [pa.ListArray.from_arrays(offsets, pa.array(getattr(packed, name).reshape(-1))) for name in COLUMNS]
    return pa.Table.from_arrays(arrays, schema=ROW_SCHEMA)


def _reject_lines(table: pa.Table, reasons: list[str] | None = None, details: list[str] | None = None) -> list[dict]:
    cols = {name: table[name].to_pylist() for name in ("source", "line", "reason", "detail", "raw", "text")}
    out = []
    for i in range(table.num_rows):
        raw = cols["raw"][i] if cols["raw"][i] is not None else cols["text"][i]
        out.append({"source": cols["source"][i], "line": cols["line"][i],
                    "reason": reasons[i] if reasons else cols["reason"][i],
                    "detail": details[i] if details else cols["detail"][i], "raw": raw})
    return out


def drop_near_copies(examples: pa.Table, near: dict[int, tuple[str, int]]) -> tuple[pa.Table, list[dict]]:
    """`examples` without those `near` names (by key0: every copy of their content), and a reject line for each,
    naming the record it is a near copy of (data/near_dedup.py)."""
    if not near or not examples.num_rows:
        return examples, []
    named = np.isin(examples["key0"].to_numpy(), np.fromiter(near, np.uint64, len(near)))
    if not named.any():
        return examples, []
    dropped = examples.filter(pa.array(named))
    refs = [near[k] for k in dropped["key0"].to_pylist()]
    lines = _reject_lines(dropped, ["near_duplicate"] * len(refs), [f"near copy of {s} line {n}" for s, n in refs])
    for line, (source, number) in zip(lines, refs):
        line["near_copy_of"] = {"source": source, "line": number}
    return examples.filter(pa.array(~named)), lines


def build_shard(group: pa.Table, backend, plan: ShardPlan, token_bytes: np.ndarray | None = None,
                near: dict[int, tuple[str, int]] | None = None) -> dict:
    """Dedup (exact, then the near copies `near` names, see `data.near_dedup.first_references`), tokenize, pack and
    write one shard; return its counts (see `data.manifest.add_up`)."""
    shard_key = pc.min(group["key0"]).as_py()
    shard = f"{shard_key:016x}"
    is_reject = pc.not_equal(group["reason"], "").to_numpy(zero_copy_only=False)
    rejects = _reject_lines(group.filter(is_reject))
    examples, deduplicated = dedup_examples(group, np.flatnonzero(~is_reject), plan.dedup)
    examples, near_rejects = drop_near_copies(examples, near or {})
    ids, labels, lengths = tokenize_examples(backend, examples, plan, token_bytes)
    ids, labels, lengths, kept, truncated = apply_length_policy(ids, labels, lengths, plan)
    if not kept.all():
        dropped = examples.filter(pa.array(~kept))
        too_long = ["too_long"] * dropped.num_rows
        details = [f"over seq_len {plan.seq_len} tokens" + ("" if not plan.truncate else
                   "; no assistant token left after truncation") for _ in range(dropped.num_rows)]
        rejects += _reject_lines(dropped, too_long, details)
        examples = examples.filter(pa.array(kept))
    stats = {"shard": shard, "read": group.num_rows, "rejected_by_reason": dict(Counter(r["reason"] for r in rejects)),
             "deduplicated": deduplicated, "near_deduplicated": len(near_rejects), "truncated": int(truncated.sum()),
             "splits": {}}
    rejects += near_rejects  # in the rejects file, but not rejects: dropped as copies, like exact duplicates
    # Examples are sorted by split (dedup_examples): each split is one run of examples and of tokens.
    first = np.searchsorted(examples["split"].to_numpy(), list(SPLITS) + [max(SPLITS) + 1])
    token_first = np.concatenate([[0], np.cumsum(lengths)])[first]
    for i, (code, name) in enumerate(SPLITS.items()):
        mine, token_mine = slice(first[i], first[i + 1]), slice(token_first[i], token_first[i + 1])
        pack = pack_sequences if plan.packing == "pack" else pad_sequences
        # Rows come out longest-first from best-fit; a seeded permutation spreads them again.
        packed = pack(ids[token_mine], labels[token_mine], lengths[mine], plan.seq_len, plan.pad_id,
                      rng=np.random.default_rng([plan.seed % 2**32, shard_key, code]))
        stats["splits"][name] = {"rows": packed.rows, "examples": int(first[i + 1] - first[i]),
                                 "tokens": packed.tokens, "loss_tokens": packed.loss_tokens}
        if packed.rows:
            fs, path = storage.resolve(storage.join(plan.version_uri, name, f"part-{shard}.parquet"))
            fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
            # No column statistics: min/max over token lists prune nothing and cost ~2 us a record to compute.
            pq.write_table(rows_table(packed), path, filesystem=fs, write_statistics=False)
    if rejects:
        rejects.sort(key=lambda r: (r["source"], r["line"]))
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejects)
        storage.write_text(storage.join(plan.version_uri, "rejects", f"part-{shard}.jsonl"), text)
    return stats


@functools.lru_cache(maxsize=2)
def _backend(backend_json: str, threads: int):
    """The Rust tokenizer and its token byte lengths, loaded once per worker process (tasks of a run share them)."""
    set_thread_count(threads)
    backend = load_backend(backend_json)
    return backend, byte_lengths(backend)


def build_shard_files(uris: list[str], plan: ShardPlan, near_uris: list[str] | None = None) -> dict:
    """The shard task: one shard's shuffle files (`data.shuffle`), and near_dedup's files for it -> its stats."""
    keep_freed_memory()
    group = read_partition(uris)
    near = first_references(read_partition(near_uris)) if near_uris else None
    backend, token_bytes = _backend(plan.backend_json, plan.tokenizer_threads)
    with no_cycle_collection():  # a list of ids per record, thousands alive at once
        return build_shard(group, backend, plan, token_bytes, near)
