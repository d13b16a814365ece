"""Raw input lines -> example rows: validated, cleaned, rendered with the chat template, keyed for dedup.

This is the streaming half of the stage (it runs fused with the read tasks). Each output row is either
an example (reason == "") with its rendered `text` and the character `spans` the loss is computed on,
or a reject (reason set) that keeps its source, line and raw text. `key0` is what the shuffle hashes:
for examples the content hash, so exact duplicates meet in the same shard whichever files they came
from; for rejects a hash of source and line, which spreads them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pyarrow as pa

from core.collector import no_cycle_collection
from data.mixture import MixturePlan, expand
from data.near_dedup import NearDupPlan, band_keys
from data.records import Messages, RecordRules, Reject, content_bytes, parse_record
from data.template import ChatRenderer

TRAIN, EVAL = 0, 1

EXAMPLE_SCHEMA = pa.schema([
    ("part", pa.int32()),  # key0 % num_shards: the shard (shuffle group) the row goes to
    ("key0", pa.uint64()),  # 128-bit hash of normalised content, in two halves: exact-dedup key
    ("key1", pa.uint64()),
    ("order", pa.uint64()),  # seeded hash of the key: the deterministic shuffle order
    ("split", pa.int8()),
    ("source", pa.string()),
    ("line", pa.int64()),
    ("reason", pa.string()),
    ("detail", pa.string()),
    ("raw", pa.large_string()),
    ("text", pa.large_string()),
    ("spans", pa.list_(pa.int32())),  # flat [start, end, start, end, ...] character spans with labels
    ("bands", pa.list_(pa.uint64())),  # near_dedup: the example's LSH band keys (data/near_dedup.py); else null
])


@dataclass(frozen=True)
class ExamplePlan:
    """Everything the streaming half needs, shipped to every read task."""

    rules: RecordRules
    renderer: ChatRenderer
    seed: int
    eval_fraction: float
    seq_len: int
    num_shards: int = 1
    mixture: MixturePlan | None = None  # lines of a mixture's files are repeated as often as they are taken
    near: NearDupPlan | None = None  # near_dedup: each example also gets its LSH band keys


def render(content: Messages | str, renderer: ChatRenderer) -> tuple[str, list[int]] | Reject:
    """Text for the tokenizer plus flat [start, end, ...] character spans whose tokens are labels."""
    if isinstance(content, str):
        template = renderer.template
        text = content + (template.eos_token if template.append_eos else "")
        return text, [0, len(text)]
    return renderer.render(content)


def keys(content: bytes, seed: int) -> tuple[int, int, int, float]:
    """(key0, key1, order, u): content hash halves, seeded order, and a seeded uniform in [0, 1) for the split."""
    digest = hashlib.blake2b(content, digest_size=16).digest()
    seeded = hashlib.blake2b(digest, digest_size=16, key=seed.to_bytes(8, "little", signed=True)).digest()
    return (int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little"),
            int.from_bytes(seeded[:8], "little"), int.from_bytes(seeded[8:], "little") / 2.0**64)


def copy_keys(key1: int, order: int, copy: int) -> tuple[int, int]:
    """(key1, order) of a mixture's repeat `copy` (>= 1) of a record: another dedup key, so exact dedup keeps a
    record's own repeats, and another place in the shuffle order. key0 stays, so the copies share a shard."""
    digest = hashlib.blake2b(b"%d:%d:%d" % (key1, order, copy), digest_size=16).digest()
    return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")


def location_digest(source: str, line: int) -> bytes:
    """8 bytes fixed by where a record is (its source and line): what spreads rejects over shards and names a read
    task's shuffle files (data/shuffle.py)."""
    return hashlib.blake2b(f"{source}:{line}".encode(), digest_size=8).digest()


def _raw_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return repr(raw)  # keeps every byte the user gave, readably


def to_examples(block: pa.Table, plan: ExamplePlan) -> pa.Table:
    """Map a block of raw lines (source, line, raw, kind, split) to EXAMPLE_SCHEMA rows, one per line."""
    with no_cycle_collection():
        return _to_examples(block, plan)


def _to_examples(block: pa.Table, plan: ExamplePlan) -> pa.Table:
    block, copies = expand(block, plan.mixture)
    rows: list[tuple] = []
    signed: list[tuple[int, Messages | str]] = []  # (row, content) of the examples to sign for near_dedup
    sources = block.column("source").to_pylist()
    lines = block.column("line").to_pylist()
    raws = block.column("raw").to_pylist()
    kinds = block.column("kind").to_pylist()
    splits = block.column("split").to_pylist()
    carry_raw_from = plan.seq_len  # see below: only texts this long can exceed seq_len tokens
    for source, line, raw, kind, split, copy in zip(sources, lines, raws, kinds, splits, copies):
        result = parse_record(raw, kind, plan.rules)
        if not isinstance(result, Reject):
            content = result
            result = render(content, plan.renderer)
        if isinstance(result, Reject):
            key0 = int.from_bytes(location_digest(source, line), "little")
            values = (key0 % plan.num_shards, key0, None, None, split, source, line, result.reason, result.detail,
                      _raw_text(raw), None, None, None)
        else:
            text, spans = result
            key0, key1, order, u = keys(content_bytes(content), plan.seed)
            if split == TRAIN and u < plan.eval_fraction:
                split = EVAL
            if copy and split == TRAIN:  # a held-out record is held out once: its eval copies stay duplicates
                key1, order = copy_keys(key1, order, copy)
            # A token covers at least one byte, so only a text of >= seq_len bytes can become too_long;
            # keep the raw record for those alone, so the shuffle does not carry every record twice.
            n_bytes = len(text) if text.isascii() else len(text.encode("utf-8"))
            keep_raw = isinstance(content, list) and n_bytes + 8 >= carry_raw_from
            values = (key0 % plan.num_shards, key0, key1, order, split, source, line, "", "",
                      _raw_text(raw) if keep_raw else None, text, spans, None)
            if plan.near is not None and not copy:  # a mixture's repeats are exact copies: one set of bands will do
                signed.append((len(rows), content))
        rows.append(values)
    columns = [list(c) for c in zip(*rows)] if rows else [[] for _ in EXAMPLE_SCHEMA]
    if signed:  # all of the block's signatures in one vectorised pass
        bands = columns[-1]
        for (i, _), band in zip(signed, band_keys([content for _, content in signed], plan.near).tolist()):
            bands[i] = band
    return pa.Table.from_arrays([pa.array(column, type=f.type) for column, f in zip(columns, EXAMPLE_SCHEMA)],
                                schema=EXAMPLE_SCHEMA)
