"""What a model version's bytes are: a sha256 per file of its checkpoint (weights, config, tokenizer, adapter files)
and one digest over that list.

A version is registered with its manifest (an artifact of the producing run, its digest a version tag); the batch
stage records the digest of the bytes it evaluated on its eval run; the gate and every replica, batch engine and
adapter loader hash the files they are about to load and refuse on any difference, naming the file. Only the digest
the gate approved and the evaluator recorded is trusted: tags are editable, hashes of the bytes are not.
"""

from __future__ import annotations

import hashlib
import json
import struct

from core import storage

CHUNK = 4 * 2**20
# storage.local_copy's marker in a cached copy of a remote checkpoint: the cache's, not the checkpoint's.
IGNORED = frozenset({".complete"})


class ManifestMismatch(ValueError):
    """The bytes at a checkpoint are not the ones registered, evaluated or approved."""


def file_sha256(uri: str) -> tuple[str, int]:
    fs, path = storage.resolve(uri)
    h, size = hashlib.sha256(), 0
    with fs.open_input_stream(path) as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def build(uri: str) -> dict:
    """{"algorithm": "sha256", "files": {relative path: {"sha256", "size"}}, "digest"} of the checkpoint at `uri`."""
    files = {}
    for rel in storage.list_files(uri):
        if rel in IGNORED:
            continue
        sha, size = file_sha256(storage.join(uri, rel))
        files[rel] = {"sha256": sha, "size": size}
    if not files:
        raise ManifestMismatch(f"{uri}: no files to hash (checkpoint missing or empty)")
    return {"algorithm": "sha256", "files": files, "digest": digest(files)}


def digest(files: dict[str, dict]) -> str:
    """One sha256 over the sorted (path, sha256) pairs: equal exactly when every file is."""
    canon = json.dumps({k: v["sha256"] for k, v in sorted(files.items())}, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def differences(expected: dict, actual: dict, where: str) -> list[str]:
    """Each file that changed, went missing or was added between two manifests, named under `where`."""
    exp, act = expected.get("files", {}), actual.get("files", {})
    out = [f"{where}/{f}: changed since registration (sha256 {act[f]['sha256'][:12]}..., registered "
           f"{exp[f]['sha256'][:12]}...)" for f in sorted(exp.keys() & act.keys()) if exp[f]["sha256"] != act[f]["sha256"]]
    out += [f"{where}/{f}: missing (registered with the version)" for f in sorted(exp.keys() - act.keys())]
    out += [f"{where}/{f}: added after registration (not in the version's manifest)" for f in sorted(act.keys() - exp.keys())]
    return out


def verify(uri: str, expected_digest: str, expected: dict | None = None, what: str = "checkpoint") -> dict:
    """The manifest of `uri` when its digest is `expected_digest`; else ManifestMismatch naming each file that
    differs from `expected` (the registered manifest), or the two digests when no manifest is at hand."""
    actual = build(uri)
    if actual["digest"] == expected_digest:
        return actual
    named = differences(expected, actual, uri) if expected else []
    raise ManifestMismatch(
        f"{what} at {uri} is not the bytes that were approved (sha256 digest {actual['digest'][:16]}..., expected "
        f"{expected_digest[:16]}...)" + (": " + "; ".join(named) if named else "")
    )


def to_json(manifest: dict) -> str:
    return json.dumps(manifest, indent=1, sort_keys=True)


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
