"""The dataset version, the manifest written beside the shards, the reject-fraction gate and the summary table.

The version is content-addressed: a hash of the input files' bytes, the tokenizer's files, the chat
template and the content part of the config (`data.config.version_config`). Same inputs, same version;
that is what makes a re-run a no-op and lets a training run name exactly what it trained on.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from datetime import datetime, timezone

from data.config import Config, content_config_hash
from core import storage
from core.config import to_dict

SPLIT_NAMES = ("train", "eval")


class RejectFractionError(RuntimeError):
    """More records were rejected than `max_reject_fraction` allows."""


def dataset_version(source_hashes: dict[str, str], tokenizer: dict, config_hash: str) -> str:
    blob = json.dumps({
        "sources": sorted(source_hashes.values()), "tokenizer": tokenizer["hash"],
        "chat_template": tokenizer["chat_template_hash"], "config": config_hash,
    }, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def add_up(shard_stats: list[dict]) -> dict:
    """Sum the per-shard counts of `data.shards.build_shard` into run totals."""
    seen = Counter(s["shard"] for s in shard_stats)
    twice = sorted(b for b, n in seen.items() if n > 1)
    if twice:
        # Two tasks naming the same shard would have overwritten each other's files.
        raise RuntimeError(f"shards {twice[:5]} were built by more than one task; the shuffle split a partition")
    reasons: Counter = Counter()
    splits = {name: Counter() for name in SPLIT_NAMES}
    totals = Counter()
    for s in shard_stats:
        reasons.update(s["rejected_by_reason"])
        totals.update({k: s.get(k, 0) for k in ("read", "deduplicated", "near_deduplicated", "truncated")})
        for name in SPLIT_NAMES:
            splits[name].update(s["splits"][name])
    rejected = sum(reasons.values())
    written = sum(splits[n]["examples"] for n in SPLIT_NAMES)
    counts = {
        "read": totals["read"], "rejected": rejected,
        "rejected_by_reason": dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
        "deduplicated": totals["deduplicated"], "near_deduplicated": totals["near_deduplicated"],
        "truncated": totals["truncated"], "written_examples": written,
    }
    return {"counts": counts, "splits": {n: {k: int(splits[n][k]) for k in ("rows", "examples", "tokens", "loss_tokens")}
                                        for n in SPLIT_NAMES}}


def check_reject_fraction(counts: dict, max_fraction: float, rejects_uri: str) -> None:
    """Raise RejectFractionError naming the top reasons when too many records were rejected."""
    read, rejected = counts["read"], counts["rejected"]
    if read == 0:
        raise RejectFractionError("no records were read from the inputs")
    if rejected / read <= max_fraction:
        return
    top = ", ".join(f"{reason} {n}" for reason, n in list(counts["rejected_by_reason"].items())[:3])
    raise RejectFractionError(
        f"{rejected} of {read} records rejected ({rejected / read:.1%}; max_reject_fraction is "
        f"{max_fraction:.1%}); top reasons: {top}. Each reject is in {rejects_uri} with its source, line and "
        "reason; fix the inputs or raise max_reject_fraction"
    )


def build_manifest(cfg: Config, version: str, version_uri: str, sources: list[str], source_hashes: dict[str, str],
                   tokenizer: dict, totals: dict, mlflow_run_id: str | None, num_shards: int) -> dict:
    seq_len = cfg.seq_len
    rows = sum(totals["splits"][n]["rows"] for n in SPLIT_NAMES)
    tokens = sum(totals["splits"][n]["tokens"] for n in SPLIT_NAMES)
    base = version_uri if storage.is_remote(version_uri) else storage.resolve(version_uri)[1]
    return {
        "version": version,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "format": cfg.format,
        "sources": sources,
        "source_hashes": source_hashes,
        "tokenizer": tokenizer,
        "seq_len": seq_len,
        "packing": cfg.packing,
        "num_shards": num_shards,  # the shards built (data.config.shard_count: num_shards 0 = by input size)
        "splits": {n: {"path": storage.join(base, n), **totals["splits"][n]} for n in SPLIT_NAMES},
        "counts": totals["counts"],
        "packing_efficiency": round(tokens / (rows * seq_len), 6) if rows else 0.0,
        "config": to_dict(cfg),
        "config_hash": content_config_hash(cfg),
        "output_uri": cfg.output_uri,
        "mlflow_run_id": mlflow_run_id,
    }


def summary_table(manifest: dict, manifest_uri: str, wall_s: float | None = None, skipped: bool = False) -> str:
    """The few lines printed at the end of a run."""
    c, s = manifest["counts"], manifest["splits"]
    tokens = s["train"]["tokens"] + s["eval"]["tokens"]
    lines = [
        ("version", manifest["version"] + ("  (already prepared; nothing done)" if skipped else "")),
        ("output", manifest_uri.rsplit("/", 1)[0]),
        ("records read", f"{c['read']:,}"),
        ("rejected", f"{c['rejected']:,}" + "".join(f"\n{'':>16}  {r}: {n:,}" for r, n in c["rejected_by_reason"].items())),
        ("deduplicated", f"{c['deduplicated']:,}" + (f" (+ {c['near_deduplicated']:,} near copies)"
                                                     if c.get("near_deduplicated") else "")),
        ("truncated", f"{c['truncated']:,}"),
        ("examples out", f"{c['written_examples']:,} (train {s['train']['examples']:,}, eval {s['eval']['examples']:,})"),
        ("rows out", f"{s['train']['rows']:,} train, {s['eval']['rows']:,} eval  x {manifest['seq_len']} tokens"),
        ("tokens", f"{tokens:,} (loss tokens {s['train']['loss_tokens'] + s['eval']['loss_tokens']:,})"),
        ("packing", f"{manifest['packing']}, efficiency {manifest['packing_efficiency']:.1%}"),
    ]
    if wall_s is not None and not skipped:
        lines.append(("time", f"{wall_s:.1f}s ({tokens / max(wall_s, 1e-9):,.0f} tokens/s)"))
    return "\n".join(f"{k:>16}  {v}" for k, v in lines)


def write_manifest(manifest: dict, manifest_uri: str) -> None:
    storage.write_text(manifest_uri, json.dumps(manifest, indent=2, sort_keys=False) + "\n")
