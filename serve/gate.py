"""The rollout gate: a version's eval tags against thresholds, and its exported checkpoint checked for completeness.

Each check returns reasons (empty = pass), written so the person who promoted the version can act on
them: which tag, what value, which threshold; which file is missing, cut short, or does not match
config.json. Only headers are read (a few KB per file, local or s3://), never the weights.
"""

from __future__ import annotations

import json
import math
import posixpath
import struct

from pipelines import storage
from serve.rollout_config import GateConfig

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def metric_problems(tags: dict[str, str], gate: GateConfig) -> list[str]:
    """Eval tags (`eval.exact_match`, ...) outside the configured bounds, missing or not numbers."""
    problems = []
    bounds = [(k, v, "min") for k, v in gate.min_metrics.items()] + [(k, v, "max") for k, v in gate.max_metrics.items()]
    for tag, bound, kind in bounds:
        raw = tags.get(tag)
        if raw is None:
            problems.append(f"tag {tag} is missing (run batch eval on this version first); gate needs {kind} {bound}")
            continue
        try:
            value = float(raw)
        except ValueError:
            problems.append(f"tag {tag}={raw!r} is not a number; gate needs {kind} {bound}")
            continue
        if math.isnan(value) or (kind == "min" and value < bound) or (kind == "max" and value > bound):
            op = "<" if kind == "min" else ">"
            problems.append(f"{tag}={value:g} {op} {bound:g} (gate.{kind}_metrics)")
    return problems


EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")


def safetensors_header(uri: str) -> tuple[dict | None, str | None]:
    """(header, None) when the file parses and is as long as its header says; else (None, what is wrong)."""
    fs, path = storage.resolve(uri)
    try:
        size = fs.get_file_info(path).size
        with fs.open_input_file(path) as f:
            head = f.read(8)
            if len(head) < 8:
                return None, f"{uri}: {size} bytes, too short for a safetensors header"
            (n,) = struct.unpack("<Q", head)
            if n > 100 * 2**20 or 8 + n > size:
                return None, f"{uri}: header length {n} does not fit in a {size}-byte file (cut short or not safetensors)"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        return None, f"{uri}: unreadable safetensors ({e})"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        return None, f"{uri}: {size} bytes but its header describes {8 + n + end} (cut short or padded)"
    return header, None


def _embedding_problem(config: dict, header: dict, where: str) -> str | None:
    """The token embedding must be [vocab_size, hidden size] of config.json (weights of another model otherwise)."""
    hidden = config.get("hidden_size") or config.get("n_embd") or config.get("d_model")
    vocab = config.get("vocab_size")
    for name, meta in header.items():
        if name.endswith(EMBEDDING_SUFFIXES) and vocab and hidden:
            if list(meta.get("shape", [])) != [vocab, hidden]:
                return (f"{where}: {name} has shape {meta.get('shape')} but config.json says "
                        f"[vocab_size, hidden_size] = [{vocab}, {hidden}] (weights and config do not match)")
    return None


def checkpoint_problems(source: str) -> list[str]:
    """What keeps the Hugging Face checkpoint at `source` (local dir or s3:// URI) from loading, if anything."""
    try:
        files = set(storage.list_files(source))
    except (OSError, ValueError) as e:
        return [f"{source}: cannot list the checkpoint ({e})"]
    if not files:
        return [f"{source}: no files (checkpoint missing or empty)"]
    problems = []
    config: dict = {}
    if "config.json" not in files:
        problems.append(f"{source}: config.json is missing")
    else:
        try:
            config = json.loads(storage.read_text(storage.join(source, "config.json")))
        except ValueError as e:
            problems.append(f"{source}/config.json: not valid JSON ({e})")
    if not any(f in files for f in TOKENIZER_FILES):
        problems.append(f"{source}: no tokenizer (expected one of {', '.join(TOKENIZER_FILES)})")
    weights = sorted(f for f in files if f.endswith(WEIGHT_SUFFIXES) and posixpath.dirname(f) == "")
    index = "model.safetensors.index.json"
    if index in files:
        try:
            shards = set(json.loads(storage.read_text(storage.join(source, index)))["weight_map"].values())
        except (ValueError, KeyError) as e:
            return problems + [f"{source}/{index}: unreadable ({e})"]
        problems += [f"{source}: shard {s} listed in {index} is missing" for s in sorted(shards - files)]
    elif not weights:
        problems.append(f"{source}: no weight files (*.safetensors or *.bin)")
    for w in weights:
        if w.endswith(".safetensors"):
            header, problem = safetensors_header(storage.join(source, w))
            problem = problem or _embedding_problem(config if isinstance(config, dict) else {}, header, f"{source}/{w}")
            if problem:
                problems.append(problem)
    return problems


def gate_problems(tags: dict[str, str], source: str | None, gate: GateConfig) -> list[str]:
    """Every reason the version must not be deployed: eval metrics first, then the checkpoint."""
    problems = metric_problems(tags, gate)
    if gate.check_artifacts and source is not None:
        problems += checkpoint_problems(source)
    return problems
