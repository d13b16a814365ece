"""Secrets on disk: created 0600 from the first byte (never written, then chmod-ed), in 0700 folders, read back trimmed.

A role's credentials are a folder holding `username` and `password` (the keys of a Kubernetes
`kubernetes.io/basic-auth` Secret, so the same folder shape comes from a Secret volume in a pod).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def private_dir(path: str | Path) -> Path:
    """`path` (and missing parents) created 0700; an existing one is narrowed to 0700."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True, mode=0o700)
    p.chmod(0o700)
    return p


def write_secret(path: str | Path, text: str) -> Path:
    """Write `text` to `path` through a file that is 0600 from creation, replacing any old one atomically."""
    p = Path(path)
    private_dir(p.parent)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, p)
    return p


def read_secret(path: str | Path) -> str:
    return Path(path).read_text().strip()


def ensure_secret(path: str | Path, nbytes: int = 32) -> str:
    """The secret at `path`, created (random, hex) when absent."""
    p = Path(path)
    if not p.exists():
        write_secret(p, secrets.token_hex(nbytes))
    return read_secret(p)


def write_login(folder: str | Path, username: str, password: str) -> Path:
    """A role's credentials folder: `username` and `password`, each 0600, the folder 0700."""
    d = private_dir(folder)
    write_secret(d / "username", username)
    write_secret(d / "password", password)
    return d


def read_login(folder: str | Path) -> tuple[str, str]:
    """(username, password) from a credentials folder; a clear error naming the folder when it is incomplete."""
    d = Path(folder)
    try:
        return read_secret(d / "username"), read_secret(d / "password")
    except OSError as e:
        raise PermissionError(f"{d}: no readable credentials (expected files username and password): {e}") from None
