"""API keys of the OpenAI endpoint: made, hashed, stored; the local stack's keys; the admin key rayline's calls send.

A key is a random secret a client sends as `Authorization: Bearer <key>`. The serving app never holds a key, only its
sha256 in a keys file (JSON, 0600) beside what the key may do:

    {"keys": [{"id": "client", "sha256": "<hex>", "role": "client", "requests_per_minute": 600, "max_concurrent": 64}]}

`role`: `client` (the OpenAI routes) or `admin` (also the canary's force header and rayline's own `/-/rayline/`
routes). `id` is what logs and metrics may name; the key itself never appears there. The serving config's
`auth.keys_file`, else $RAYLINE_API_KEYS_FILE, names the file (serve/online/api_auth.py reads it in each replica); on
Kubernetes it is the Secret `rayline-openai-keys` (key `keys.json`) mounted at /var/run/secrets/rayline/openai.

Its command line is pipelines/api_keys.py (`rayline keys add ...`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from core.secret_files import ensure_secret, read_secret, write_secret

KEYS_FILE_ENV = "RAYLINE_API_KEYS_FILE"
"""The keys file of the serving replicas when the serving config names none."""
ADMIN_KEY_FILE_ENV = "RAYLINE_ADMIN_KEY_FILE"
"""The admin key rayline's own requests send (rollout smoke requests, canary probe) when the config names none."""
ROLES = ("client", "admin")
KEY_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
STACK_KEYS_DIR = "credentials/openai"
"""Under a local stack's state dir: `client_key`, `admin_key` (the keys, 0600) and `keys.json` (their hashes)."""
STACK_LIMITS = {"requests_per_minute": 6000, "max_concurrent": 256}
"""The local stack's keys: generous (the serving benches run 64 streams on them); a deployment sets its own."""


@dataclass(frozen=True)
class ApiKey:
    """One entry of a keys file: a key's hash and what it may do."""

    id: str
    sha256: str
    role: str = "client"
    requests_per_minute: int = 600
    """A token bucket per key and replica: it holds this many requests and refills at this rate."""
    max_concurrent: int = 64
    """Requests of this key one replica answers at once."""

    def __post_init__(self) -> None:
        problems = [
            (not isinstance(self.id, str) or not KEY_ID.match(self.id), "id", "letters, digits, '.', '_', '-' (1-64)"),
            (not isinstance(self.sha256, str) or not SHA256_HEX.match(self.sha256), "sha256",
             "the key's sha256 as 64 lowercase hex digits (core.api_keys.hash_key)"),
            (self.role not in ROLES, "role", f"one of {', '.join(ROLES)}"),
            (type(self.requests_per_minute) is not int or self.requests_per_minute < 1, "requests_per_minute",
             "an integer >= 1"),
            (type(self.max_concurrent) is not int or self.max_concurrent < 1, "max_concurrent", "an integer >= 1"),
        ]
        for bad, field, want in problems:
            if bad:
                raise ValueError(f"{field}: must be {want}, got {getattr(self, field)!r}")

    @classmethod
    def of(cls, key_id: str, key: str, role: str = "client", **limits: int) -> "ApiKey":
        """The entry for the key `key` (hashed here; the key itself is not kept)."""
        return cls(key_id, hash_key(key), role, **limits)


def new_key() -> str:
    """A fresh key: 256 random bits as hex (what `ensure_secret` makes, so every rayline key looks alike)."""
    return secrets.token_hex(32)


def hash_key(key: str) -> str:
    """The hex sha256 a keys file holds for `key`. A plain hash is enough: the keys are random, not passwords."""
    return hashlib.sha256(key.encode()).hexdigest()


def read_keys_file(path: str | Path) -> list[ApiKey]:
    """The entries of a keys file; ValueError naming the file, the entry and the field when one is wrong."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"API keys file {path}: cannot be read ({e.strerror})") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"API keys file {path}: not JSON ({e})") from None
    entries = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f'API keys file {path}: expected {{"keys": [{{"id", "sha256", "role", ...}}, ...]}}')
    known = {f.name for f in fields(ApiKey)}
    keys: list[ApiKey] = []
    for i, entry in enumerate(entries):
        where = f"API keys file {path}: keys[{i}]"
        if not isinstance(entry, dict) or set(entry) - known or not {"id", "sha256"} <= set(entry):
            got = f"keys {sorted(entry)}" if isinstance(entry, dict) else repr(entry)
            raise ValueError(f"{where}: expected an object with id and sha256 and optionally role, "
                             f"requests_per_minute, max_concurrent; got {got}")
        try:
            keys.append(ApiKey(**entry))
        except ValueError as e:
            raise ValueError(f"{where}.{e}") from None
    for attr in ("id", "sha256"):
        seen = [getattr(k, attr) for k in keys]
        dupes = sorted({v for v in seen if seen.count(v) > 1})
        if dupes:
            shown = dupes if attr == "id" else [k.id for k in keys if k.sha256 in dupes]
            raise ValueError(f"API keys file {path}: the same {attr} appears twice ({', '.join(shown)})")
    return keys


def write_keys_file(path: str | Path, keys: list[ApiKey]) -> Path:
    """Write the entries (0600, replacing the file atomically, so a replica re-reading it never sees half of it)."""
    return write_secret(path, json.dumps({"keys": [asdict(k) for k in keys]}, indent=2) + "\n")


def add_key(path: str | Path, key: ApiKey) -> list[ApiKey]:
    """Add `key` to the keys file at `path` (created when absent), replacing an entry with the same id."""
    keys = read_keys_file(path) if Path(path).exists() else []
    keys = [k for k in keys if k.id != key.id] + [key]
    write_keys_file(path, keys)
    return keys


@dataclass(frozen=True)
class StackKeys:
    """Where a local stack keeps its keys."""

    folder: Path

    @property
    def client_key_file(self) -> Path:
        return self.folder / "client_key"

    @property
    def admin_key_file(self) -> Path:
        return self.folder / "admin_key"

    @property
    def keys_file(self) -> Path:
        return self.folder / "keys.json"


def stack_keys(state_dir: str | Path) -> StackKeys:
    return StackKeys(Path(state_dir) / STACK_KEYS_DIR)


def create_stack_keys(state_dir: str | Path, extra: list[ApiKey] | tuple[ApiKey, ...] = ()) -> StackKeys:
    """A local stack's keys: a client key and an admin key (each 0600, made once and kept), and the keys file the app
    reads with their hashes (STACK_LIMITS) and `extra` (e.g. a test's own keys). Idempotent; entries of the keys file
    under other ids (added with `python -m pipelines.api_keys add`) are kept."""
    where = stack_keys(state_dir)
    for role, path in (("client", where.client_key_file), ("admin", where.admin_key_file)):  # each key's id is its role
        add_key(where.keys_file, ApiKey.of(role, ensure_secret(path), role, **STACK_LIMITS))
    for key in extra:
        add_key(where.keys_file, key)
    return where


def server_env(state_dir: str | Path) -> dict[str, str]:
    """The env a stack's Ray processes need: the keys file its serving replicas read, the admin key rollouts send."""
    where = stack_keys(state_dir)
    return {KEYS_FILE_ENV: str(where.keys_file), ADMIN_KEY_FILE_ENV: str(where.admin_key_file)}


def client_env(state_dir: str | Path) -> dict[str, str]:
    """`server_env` plus OPENAI_API_KEY (the client key, which the `openai` SDK reads) once the stack made it."""
    where = stack_keys(state_dir)
    env = server_env(state_dir)
    if where.client_key_file.exists():
        env["OPENAI_API_KEY"] = read_secret(where.client_key_file)
    return env


def admin_key(path: str = "") -> str:
    """The admin key rayline's own requests to the app send: read from `path`, else from $RAYLINE_ADMIN_KEY_FILE."""
    path = path or os.environ.get(ADMIN_KEY_FILE_ENV, "")
    if not path:
        raise ValueError(f"no admin API key: set auth.admin_key_file in the serving config or {ADMIN_KEY_FILE_ENV} "
                         "(`python -m pipelines.stack env` sets it for the local stack)")
    try:
        key = read_secret(path)
    except OSError as e:
        raise ValueError(f"admin API key file {path} cannot be read: {e.strerror}") from None
    if not key:
        raise ValueError(f"admin API key file {path} is empty")
    return key
