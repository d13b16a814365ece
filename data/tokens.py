"""The model's tokenizer: finding its files, its identity for the dataset version, and batched encoding
with labels masked to the assistant (or, for raw text, every) character span.

The driver reads the tokenizer's files once and ships their bytes to the workers, so a tokenizer on
the driver's disk, in s3:// or behind `models:/` works the same on every node of a cluster.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import tempfile
from pathlib import Path

import numpy as np

from core import storage

IGNORE = -100
# Files a Hugging Face tokenizer may load from; weights and model config are not needed here.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model",
    "spiece.model",
)
_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def read_tokenizer_files(ref: str) -> tuple[str, dict[str, bytes]]:
    """(where the files came from, {file name: bytes}) for a path, s3:// URI, `models:/` ref or hub id."""
    if ref.startswith("models:/"):
        from core import registry  # MLflow, only when asked for: workers import this module too

        location = registry.resolve_model_uri(ref)
    else:
        location = ref
    if not storage.is_remote(location) and not Path(location).exists():
        if not _HUB_ID.fullmatch(location):
            raise FileNotFoundError(f"tokenizer: {location} does not exist (give a path, s3:// URI, "
                                    "Hugging Face id or models:/name@alias)")
        from huggingface_hub import snapshot_download

        location = snapshot_download(location, allow_patterns=list(TOKENIZER_FILES))
    names = set(storage.list_files(location)) if storage.exists(location) else set()
    files = {name: storage.read_bytes(storage.join(location, name)) for name in TOKENIZER_FILES if name in names}
    if "tokenizer.json" not in files and "tokenizer.model" not in files and "vocab.json" not in files:
        raise FileNotFoundError(f"tokenizer: {location} has no tokenizer.json, tokenizer.model or vocab.json "
                                f"(found: {', '.join(sorted(names)) or 'nothing'})")
    return location, files


def load_tokenizer(files: dict[str, bytes], chat_template: str | None = None):
    """A transformers tokenizer from file bytes (written to a private temp dir), with an optional template."""
    from transformers import AutoTokenizer

    folder = tempfile.mkdtemp(prefix="rayline-tokenizer-")
    for name, data in files.items():
        Path(folder, name).write_bytes(data)
    tok = AutoTokenizer.from_pretrained(folder)
    if chat_template is not None:
        tok.chat_template = chat_template
    if not getattr(tok, "is_fast", False):
        raise ValueError("tokenizer: only fast (Rust) tokenizers are supported; this one has no tokenizer.json")
    return tok


def load_backend(backend_json: str):
    """The Rust tokenizer from its JSON (`tokenizer.backend_tokenizer.to_str()`): all that encoding needs,
    without importing transformers in every worker."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(backend_json)


def check_template(chat_template: str | None, where: str) -> None:
    """Chat formats need a template that marks assistant turns, or there is nothing to put labels on."""
    if not chat_template:
        raise ValueError(f"{where}: the tokenizer has no chat template; set `chat_template` to a Jinja file")
    if not _GENERATION_BLOCK.search(chat_template):
        raise ValueError(f"{where}: the chat template has no {{% generation %}} block, so assistant tokens "
                         "cannot be told from prompt tokens; set `chat_template` to a template that wraps "
                         "assistant content in {% generation %}...{% endgeneration %}")


def tokenizer_identity(name_or_path: str, files: dict[str, bytes], tok) -> dict:
    """What the manifest records about the tokenizer; `hash` covers every tokenizer file's bytes."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    template = tok.chat_template or ""
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return {
        "name_or_path": name_or_path, "hash": h.hexdigest(), "vocab_size": len(tok),
        "eos_token_id": tok.eos_token_id, "pad_token_id": pad_id,
        "chat_template_hash": hashlib.sha256(template.encode()).hexdigest()[:16] if template else None,
    }


def byte_lengths(backend) -> np.ndarray | None:
    """Bytes of text each token id stands for, when the tokenizer is byte-level BPE with no normalizer
    (GPT-2, Llama 3, Qwen and the tiny model's family): its tokens then spell the text's UTF-8 bytes end
    to end, and label spans can be found from ids alone. None for any other tokenizer."""
    import json

    spec = json.loads(backend.to_str())
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    byte_level = [p for p in steps if p.get("type") == "ByteLevel"]
    model = spec.get("model") or {}
    if (spec.get("normalizer") or len(byte_level) != 1 or byte_level[0].get("add_prefix_space")
            or model.get("type") != "BPE" or model.get("byte_fallback")
            or any(p.get("type") not in ("ByteLevel", "Digits", "Split", "Punctuation") for p in steps)):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    added = {t["content"] for t in spec.get("added_tokens", [])}
    lengths = np.zeros(max(vocab.values()) + 1, np.int64)
    for token, i in vocab.items():
        lengths[i] = len(token.encode("utf-8")) if token in added else len(token)  # one char per byte
    return lengths


def _token_range(enc, start: int, end: int) -> tuple[int, int] | None:
    """Tokens [first, last] covering characters [start, end); chars no token covers are skipped."""
    first = next((t for c in range(start, end) if (t := enc.char_to_token(c)) is not None), None)
    if first is None:
        return None
    last = next(t for c in range(end - 1, start - 1, -1) if (t := enc.char_to_token(c)) is not None)
    return first, last


def _flatten(id_lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Flat int32 ids and int64 lengths, each read in one C loop over the Python lists."""
    lengths = np.fromiter(map(len, id_lists), np.int64, len(id_lists))
    return np.fromiter(itertools.chain.from_iterable(id_lists), np.int32, int(lengths.sum())), lengths


def _byte_labels(ids, lengths, texts: list[str], spans: list[list[int]], token_bytes: np.ndarray) -> np.ndarray | None:
    """Labels from token byte lengths (see `byte_lengths`); None when a text's tokens do not spell its bytes."""
    ends = np.cumsum(token_bytes[ids])
    text_bytes = np.fromiter((len(t) if t.isascii() else len(t.encode("utf-8")) for t in texts), np.int64, len(texts))
    last = np.cumsum(lengths) - 1
    spelled = ends[last[lengths > 0]] if len(ids) else np.zeros(0, np.int64)
    if not np.array_equal(spelled, np.cumsum(text_bytes)[lengths > 0]) or np.any(text_bytes[lengths == 0]):
        return None
    base = (np.cumsum(text_bytes) - text_bytes).tolist()
    bounds = []
    for text, flat, b in zip(texts, spans, base):
        if text.isascii():
            bounds.extend(b + pos for pos in flat)
        else:
            bounds.extend(b + len(text[:pos].encode("utf-8")) for pos in flat)
    bounds = np.asarray(bounds, np.int64)
    first = np.searchsorted(ends, bounds[0::2], side="right")  # first token ending after the span starts
    stop = np.searchsorted(ends, bounds[1::2], side="left") + 1  # one past the token holding its last byte
    marks = np.zeros(len(ids) + 1, np.int64)
    np.add.at(marks, first, 1)
    np.add.at(marks, stop, -1)
    return np.where(np.cumsum(marks[:-1]) > 0, ids, IGNORE).astype(np.int32)


def encode_with_labels(backend, texts: list[str], spans: list[list[int]] | None,
                       token_bytes: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batch-encode `texts` (no special tokens added: the template has them) with the Rust tokenizer.

    `spans[i]` is a flat [start, end, ...] list of character spans of text i whose tokens are labels; the
    rest is -100. `spans=None` makes every token a label (raw text). With `token_bytes` (from
    `byte_lengths`) labels come from the ids alone and the tokenizer skips computing offsets; a batch
    whose tokens do not spell its texts is encoded again with offsets. Returns flat int32 ids, flat int32
    labels and int64 lengths.
    """
    if spans is None or token_bytes is not None:
        ids, lengths = _flatten([e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)])
        if spans is None:
            return ids, ids.copy(), lengths
        labels = _byte_labels(ids, lengths, texts, spans, token_bytes)
        if labels is not None:
            return ids, labels, lengths
    encodings = backend.encode_batch(texts, add_special_tokens=False)
    ids, lengths = _flatten([e.ids for e in encodings])
    labels = np.full(len(ids), IGNORE, np.int32)
    starts = np.cumsum(lengths) - lengths
    for enc, flat, base in zip(encodings, spans, starts.tolist()):
        for s, e in zip(flat[::2], flat[1::2]):
            found = _token_range(enc, s, e)
            if found:
                a, b = found
                labels[base + a:base + b + 1] = ids[base + a:base + b + 1]
    return ids, labels, lengths


def set_thread_count(threads: int) -> None:
    """Let the Rust tokenizer use `threads` threads in this process (set before its first batch call)."""
    os.environ["RAYON_NUM_THREADS"] = str(max(1, threads))
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
