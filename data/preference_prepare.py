"""Prepare a preference dataset version: JSONL pairs -> validated, deduplicated, tokenized Parquet with a manifest.

    from data.preference_prepare import prepare_preferences
    result = prepare_preferences(cfg)   # cfg: data.preference_config.PreferenceConfig

Layout, beside the chat data stage's (data/prepare.py):
    <output_uri>/<version>/manifest.json          written last: a version without one is unfinished
    <output_uri>/<version>/{train,eval}/part-00000.parquet   rows of data.preferences.ROW_SCHEMA
    <output_uri>/<version>/rejects/rejects.jsonl  every rejected record: source, line, reason, detail, raw

The version is content-addressed like a chat version (data/manifest.py `dataset_version`): the input bytes, the
tokenizer and the content part of the config, lineage included. Preference sets are small next to pre-training or
SFT corpora (thousands to a few hundred thousand pairs), so the driver parses and tokenizes them in one pass; the
reference model's log-probs, the costly part, are a Ray Data pass (posttrain/dpo_reference.py).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.parquet as pq

from data import manifest as mf
from data.examples import keys
from data.packing import IGNORE
from data.preference_config import PreferenceConfig, content_config_hash
from data.preferences import COLUMNS, ROW_SCHEMA, PreferenceRules, parse_preference, tokenize_preference
from data.prepared import load_manifest
from data.records import Reject
from data.sources import discover, hash_file, read_lines
from data.tokens import check_template, load_tokenizer, read_tokenizer_files, tokenizer_identity
from core import storage
from core.config import to_dict

FORMAT = "preference"
TRAIN, EVAL = 0, 1


@dataclass
class PreparedPreferences:
    version: str
    manifest_uri: str
    version_uri: str
    counts: dict
    skipped: bool = False
    manifest: dict = field(default_factory=dict, repr=False)


def _write_split(rows: list[dict], uri: str) -> None:
    table = pa.Table.from_pylist(rows, schema=ROW_SCHEMA)
    fs, path = storage.resolve(uri)
    fs.create_dir(path, recursive=True)
    pq.write_table(table, f"{path}/part-00000.parquet", filesystem=fs)


def _split_stats(rows: list[dict]) -> dict:
    tokens = sum(r["chosen_length"] + r["rejected_length"] for r in rows)
    loss = sum(sum(1 for t in r[f"{a}_labels"] if t != IGNORE) for r in rows for a in ("chosen", "rejected"))
    return {"rows": len(rows), "examples": len(rows), "tokens": tokens, "loss_tokens": loss}


def prepare_preferences(cfg: PreferenceConfig) -> PreparedPreferences:
    """Build (or find already built) the preference version of `cfg`; raises data.manifest.RejectFractionError
    naming the top reasons when too many records are rejected (the rejects file is written first)."""
    if not cfg.inputs:
        raise ValueError("preferences.inputs: no preference files given; list JSONL files or directories")
    files = discover(cfg.inputs, "jsonl", TRAIN, "preferences.inputs")
    files += discover(cfg.eval_inputs, "jsonl", EVAL, "preferences.eval_inputs")
    _, tok_files = read_tokenizer_files(cfg.tokenizer)
    tok = load_tokenizer(tok_files)
    check_template(tok.chat_template, f"preferences.tokenizer {cfg.tokenizer}")
    identity = tokenizer_identity(cfg.tokenizer, tok_files, tok)
    source_hashes = {f.uri: hash_file(f.uri) for f in files}
    version = mf.dataset_version(source_hashes, identity, content_config_hash(cfg))
    version_uri = storage.join(cfg.output_uri, version)
    manifest_uri = storage.join(version_uri, "manifest.json")
    if storage.exists(manifest_uri) and not cfg.overwrite:
        manifest = load_manifest(manifest_uri)
        return PreparedPreferences(version, manifest_uri, version_uri, manifest["counts"], True, manifest)
    if storage.exists(version_uri):
        storage.delete_tree(version_uri)  # an unfinished or overwritten earlier attempt

    rules = PreferenceRules(cfg.prompt_field, cfg.chosen_field, cfg.rejected_field, cfg.system_field,
                            cfg.unicode_form, cfg.max_chars)
    rejects: list[dict] = []
    seen: dict[bytes, int] = {}
    kept: list[tuple] = []  # (split, order, preference, source, line); eval files are read first: an eval copy wins
    read = deduplicated = 0
    for f in sorted(files, key=lambda f: -f.split):
        for block in read_lines(f, 4096):
            for line, raw in zip(block["line"].to_pylist(), block["raw"].to_pylist()):
                read += 1
                pref = parse_preference(raw, rules)
                if isinstance(pref, Reject):
                    rejects.append({"source": f.uri, "line": line, "reason": pref.reason, "detail": pref.detail,
                                    "raw": raw.decode("utf-8", "replace")})
                    continue
                key = pref.key()
                if cfg.dedup and key in seen:
                    deduplicated += 1
                    continue
                seen[key] = line
                _, _, order, u = keys(key, cfg.seed)
                split = f.split if cfg.eval_inputs else (EVAL if u < cfg.eval_fraction else TRAIN)
                kept.append((split, order, pref, f.uri, line))
    splits: dict[str, list[dict]] = {"train": [], "eval": []}
    pad_id = identity["pad_token_id"]
    for split, _, pref, source, line in sorted(kept, key=lambda k: (k[0], k[1])):
        row = tokenize_preference(tok, pref, cfg.seq_len, pad_id)
        if isinstance(row, Reject):
            rejects.append({"source": source, "line": line, "reason": row.reason, "detail": row.detail,
                            "raw": json.dumps({"prompt": pref.prompt, "chosen": pref.chosen,
                                               "rejected": pref.rejected}, ensure_ascii=False)})
            continue
        splits["eval" if split == EVAL else "train"].append(row)

    storage.write_text(storage.join(version_uri, "rejects", "rejects.jsonl"),
                       "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejects))
    reasons = Counter(r["reason"] for r in rejects)
    counts = {"read": read, "rejected": len(rejects),
              "rejected_by_reason": dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
              "deduplicated": deduplicated, "truncated": 0,
              "written_examples": len(splits["train"]) + len(splits["eval"])}
    mf.check_reject_fraction(counts, cfg.max_reject_fraction, storage.join(version_uri, "rejects"))
    base = version_uri if storage.is_remote(version_uri) else storage.resolve(version_uri)[1]
    for name, rows in splits.items():
        _write_split(rows, storage.join(base, name))
    manifest = {
        "version": version, "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "format": FORMAT, "columns": list(COLUMNS), "sources": [f.uri for f in files], "source_hashes": source_hashes,
        "tokenizer": identity, "seq_len": cfg.seq_len,
        "splits": {name: {"path": storage.join(base, name), **_split_stats(rows)} for name, rows in splits.items()},
        "counts": counts, "lineage": dict(cfg.lineage), "config": to_dict(cfg),
        "config_hash": content_config_hash(cfg), "output_uri": cfg.output_uri,
    }
    mf.write_manifest(manifest, manifest_uri)
    return PreparedPreferences(version, manifest_uri, version_uri, counts, False, manifest)
