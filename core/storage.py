"""One way from a URI to bytes: local paths, `file://` and `s3://` (AWS or any S3-compatible store).

`resolve(uri)` returns a pyarrow filesystem and the path inside it; Ray Data (`filesystem=`) and Ray
Train (`RunConfig(storage_path=path, storage_filesystem=fs)`) take both as they are. Note that with an
explicit filesystem Ray wants the bucket/key path *without* the `s3://` scheme, which is what
`resolve` returns.

S3 settings come from the standard AWS variables: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_DEFAULT_REGION / AWS_REGION and AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) for
a non-AWS endpoint such as MinIO, Ceph or Swift's s3api.
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs as pafs

# Swift's s3api (and some other S3 servers) reject the default CRC checksums of newer AWS SDKs.
os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")

S3_ENV_VARS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REQUEST_CHECKSUM_CALCULATION",
    "AWS_RESPONSE_CHECKSUM_VALIDATION",
)


def is_s3(uri: str) -> bool:
    return str(uri).startswith("s3://")


def is_remote(uri: str) -> bool:
    return "://" in str(uri) and not str(uri).startswith("file://")


def s3_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def s3_region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


def s3_filesystem(keys: bool = True) -> pafs.S3FileSystem:
    """A pyarrow S3 filesystem configured from the AWS environment variables. `keys=False` leaves the keys out: the
    filesystem then finds them in the environment of whichever process uses it, so pickling it (into a Ray task)
    carries none."""
    kwargs: dict = {"region": s3_region()}
    endpoint = s3_endpoint()
    if endpoint:
        parsed = urlparse(endpoint)
        kwargs["endpoint_override"] = parsed.netloc or parsed.path
        kwargs["scheme"] = parsed.scheme or "http"
        # S3-compatible stores are addressed by path, not virtual-host buckets.
        kwargs["force_virtual_addressing"] = False
    if keys and os.environ.get("AWS_ACCESS_KEY_ID"):
        kwargs["access_key"] = os.environ["AWS_ACCESS_KEY_ID"]
        kwargs["secret_key"] = os.environ.get("AWS_SECRET_ACCESS_KEY", "")
        if os.environ.get("AWS_SESSION_TOKEN"):
            kwargs["session_token"] = os.environ["AWS_SESSION_TOKEN"]
    return pafs.S3FileSystem(**kwargs)


def resolve(uri: str | Path) -> tuple[pafs.FileSystem, str]:
    """URI -> (filesystem, path in that filesystem). Plain paths are made absolute."""
    uri = str(uri)
    if is_s3(uri):
        return s3_filesystem(), uri[len("s3://") :].rstrip("/")
    if uri.startswith("file://"):
        return pafs.LocalFileSystem(), os.path.abspath(urlparse(uri).path)
    if "://" in uri:
        raise ValueError(f"{uri}: unsupported storage scheme (use a local path, file:// or s3://)")
    return pafs.LocalFileSystem(), os.path.abspath(uri)


def basename(uri: str) -> str:
    """The last path component of a local path or URI (`s3://b/data/arith/` -> `arith`)."""
    return uri.rstrip("/").rsplit("/", 1)[-1]


def join(uri: str, *parts: str) -> str:
    """Join path parts onto a URI, keeping its scheme."""
    uri = str(uri)
    if "://" in uri:
        scheme, rest = uri.split("://", 1)
        return f"{scheme}://" + posixpath.join(rest.rstrip("/"), *parts)
    return os.path.join(uri, *parts)


def exists(uri: str) -> bool:
    fs, path = resolve(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def makedirs(uri: str) -> None:
    fs, path = resolve(uri)
    fs.create_dir(path, recursive=True)


def read_bytes(uri: str) -> bytes:
    fs, path = resolve(uri)
    try:
        with fs.open_input_stream(path) as f:
            return f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{uri}: no such file") from None


def parquet_metadata(uri: str):
    """A Parquet file's footer (`num_rows`, schema), read without its data."""
    import pyarrow.parquet as pq

    fs, path = resolve(uri)
    with fs.open_input_file(path) as f:
        return pq.ParquetFile(f).metadata


def read_text(uri: str) -> str:
    return read_bytes(uri).decode("utf-8")


def write_bytes(uri: str, data: bytes) -> None:
    fs, path = resolve(uri)
    parent = posixpath.dirname(path)
    if parent:
        fs.create_dir(parent, recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(data)


def write_text(uri: str, text: str) -> None:
    write_bytes(uri, text.encode("utf-8"))


def list_files(uri: str) -> list[str]:
    """Relative paths of every file under a directory URI, sorted."""
    fs, path = resolve(uri)
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    return sorted(posixpath.relpath(i.path, path) for i in infos if i.type == pafs.FileType.File)


def total_bytes(uri: str) -> int:
    """Size of a file, or of every file under a directory URI (0 when nothing is there)."""
    fs, path = resolve(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return info.size
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    return sum(i.size for i in infos if i.type == pafs.FileType.File)


def copy_tree(src_uri: str, dst_uri: str) -> None:
    """Copy a directory tree between any two supported URIs (local <-> s3)."""
    src_fs, src = resolve(src_uri)
    dst_fs, dst = resolve(dst_uri)
    dst_fs.create_dir(dst, recursive=True)
    pafs.copy_files(src, dst, source_filesystem=src_fs, destination_filesystem=dst_fs)


def delete_tree(uri: str) -> None:
    fs, path = resolve(uri)
    if fs.get_file_info(path).type == pafs.FileType.Directory:
        fs.delete_dir(path)
    elif fs.get_file_info(path).type == pafs.FileType.File:
        fs.delete_file(path)


def local_copy(uri: str, cache_dir: str | Path) -> str:
    """A local directory holding the tree at `uri`: the path itself when local, else a copy in cache_dir."""
    if not is_remote(uri):
        return resolve(uri)[1]
    target = Path(cache_dir) / uri.replace("://", "/").replace("/", "_")
    if not (target / ".complete").exists():
        copy_tree(uri, str(target))
        (target / ".complete").write_text(uri)
    return str(target)
