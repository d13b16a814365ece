"""Real tables for the data-stage tests, written in two commits: an Iceberg table (pyiceberg's SQL catalog on SQLite,
two snapshots) and a Delta table (the `deltalake` library, versions 0 and 1); and what a prepared version of them
must hold.

Rows are question/answer pairs with an integer `id` and a `lang` column; the first commit holds FIRST (one of them
with an empty answer, which the instruction format rejects), the second appends SECOND.
"""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa

SCHEMA = pa.schema([("id", pa.int64()), ("question", pa.string()), ("answer", pa.string()), ("lang", pa.string())])
BAD_ID = 7  # its answer is empty: rejected as empty_text
FIRST = [(i, f"What is {i} plus {i}?", "" if i == BAD_ID else f"It is {2 * i}.", "de" if i % 5 == 0 else "en")
         for i in range(1, 21)]
SECOND = [(i, f"What is {i} times three?", f"It is {3 * i}.", "en") for i in range(101, 111)]


def catalog_spec(root: str, warehouse: str | None = None) -> dict:
    """The config's `iceberg.catalog` for a catalog database under `root` (a local folder)."""
    return {"uri": f"sqlite:///{root}/catalog.db", "warehouse": warehouse or f"file://{root}/warehouse",
            "name": "tests"}


def write_table(catalog: dict, table: str = "chats.qa") -> list[int]:
    """Create `table` and append FIRST, then SECOND: returns the two snapshot ids, oldest first."""
    from pyiceberg.catalog import load_catalog

    from data.config import IcebergCatalog
    from data.iceberg_source import catalog_properties

    props = catalog_properties(IcebergCatalog(**catalog))  # an s3:// warehouse: the stack's endpoint, as the stage's
    cat = load_catalog(props.pop("name"), **props)
    namespace = table.split(".")[0]
    cat.create_namespace_if_not_exists(namespace)
    t = cat.create_table(table, schema=SCHEMA)
    snapshots = []
    for rows in (FIRST, SECOND):
        t.append(pa.table(list(zip(*rows)), schema=SCHEMA))
        snapshots.append(t.current_snapshot().snapshot_id)
    return snapshots


def rows(*batches: list[tuple], lang: str | None = None) -> list[tuple]:
    """The rows of `batches` (FIRST, SECOND), only those in `lang` when given."""
    return [r for batch in batches for r in batch if lang is None or r[3] == lang]


def write_delta(uri: str) -> list[int]:
    """Write a Delta table at `uri` (a local folder, or s3://): FIRST, then SECOND appended. Returns the two versions,
    oldest first. On s3:// the table is written in a local folder and its files copied up: `deltalake` commits with
    conditional PUTs, which the stack's Swift does not support (a table's readers need none)."""
    import tempfile

    from deltalake import DeltaTable, write_deltalake

    from core import storage

    if storage.is_s3(uri):
        with tempfile.TemporaryDirectory() as local:
            versions = write_delta(local)
            storage.copy_tree(local, uri)
        return versions
    for i, batch in enumerate((FIRST, SECOND)):
        write_deltalake(uri, pa.table(list(zip(*batch)), schema=SCHEMA), mode="append" if i else "error")
    current = DeltaTable(uri).version()
    return [current - 1, current]


def segments(manifest_uri: str, tok) -> list[str]:
    """Every packed example of the train split, decoded."""
    from data.prepared import read_split

    out = []
    for batch in read_split(manifest_uri, "train").iter_batches(batch_size=256, batch_format="numpy"):
        for ids, seg in zip(batch["input_ids"], batch["segment_ids"]):
            out += [tok.decode(ids[seg == s]) for s in range(1, seg.max() + 1)]
    return out


def rendered(table_rows: list[tuple], tok) -> Counter:
    """The chat-template text of every valid row (the empty answer is not one)."""
    return Counter(tok.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                           tokenize=False) for _, q, a, _ in table_rows if a)


def rejects(version_uri: str) -> list[dict]:
    from core import storage

    folder = storage.join(version_uri, "rejects")
    return [json.loads(line) for f in storage.list_files(folder)
            for line in storage.read_text(storage.join(folder, f)).splitlines()]


def prepare_on_stack(cfg):
    """The data stage's main, imported after the stack's variables are set (see test_prepare.py)."""
    from data.prepare import main

    return main(cfg)


def check_two_commits(config, pin: str, first: int, second: int, source: str, tok) -> dict:
    """The scenario both table readers must pass, on a table written as FIRST then SECOND: `config(**fields)` makes
    the stage config for the table (English rows only, question/answer mapped to prompt/response) with `pin`, the
    field that pins a commit, set when given; `source` the rejects' source of commit `first`. Returns version A's
    manifest entry of the table for the caller's own checks."""
    # Version A: pinned to the first commit.
    cfg_a = config(**{pin: first})
    a = prepare_on_stack(cfg_a)
    m = a.manifest
    kind = source.split(":", 1)[0]
    assert m["sources"] == [source]
    assert m[kind]["snapshot_id"] == first and m[kind]["row_filter"] == "lang = 'en'"
    assert m[kind]["columns"] == {"question": "prompt", "answer": "response"}
    english = rows(FIRST, lang="en")
    assert m["counts"]["read"] == len(english) and m["counts"]["rejected_by_reason"] == {"empty_text": 1}
    assert Counter(segments(a.manifest_uri, tok)) == rendered(english, tok)

    # The bad row's reject names the table, the commit and the row's key, and keeps the row as read (mapped).
    (bad,) = rejects(a.version_uri)
    assert (bad["source"], bad["line"], bad["reason"]) == (source, BAD_ID, "empty_text")
    assert json.loads(bad["raw"])["prompt"] == FIRST[BAD_ID - 1][1] and json.loads(bad["raw"])["response"] == ""

    # Version B: the current commit (the second) -> another version, holding both commits' English rows.
    b = prepare_on_stack(config())
    assert b.version != a.version and b.manifest[kind]["snapshot_id"] == second
    assert b.manifest["counts"]["read"] == len(rows(FIRST, SECOND, lang="en"))
    assert Counter(segments(b.manifest_uri, tok)) == rendered(rows(FIRST, SECOND, lang="en"), tok)

    # Re-runs: A again is A, untouched; the second commit named outright is B.
    again = prepare_on_stack(cfg_a)
    assert again.skipped and again.version == a.version and again.manifest == a.manifest
    named = prepare_on_stack(config(**{pin: second}))
    assert named.skipped and named.version == b.version
    return m[kind]
