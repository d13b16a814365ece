"""Input files: finding them under the configured URIs, hashing their bytes, and reading them as raw lines.

`read_lines` streams a file as blocks of (source, line, raw bytes) without parsing (the stage's Ray Data
datasource, `data.datasource.LinesDatasource`, runs it in read tasks), so a malformed line is a row like
any other and becomes a reject with its line number instead of failing the read. JSONL and text files are
read line by line (blank lines are separators, not records); Parquet rows are re-serialised as JSON, with
their 0-based row index as `line`. JSONL and text files compressed with gzip (`.gz`) or zstd (`.zst`) are
decompressed as a stream inside the read task (pyarrow's compressed input stream), never to disk; their line
numbers are those of the decompressed text. A compressed file cannot be entered in the middle, so it is read by
one task, whole.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import posixpath
from dataclasses import dataclass
from typing import Iterator

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from core import storage

UTF8_BOM = b"\xef\xbb\xbf"
EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".txt": "text"}
# Compression by extension, as pyarrow's codecs name it; the extension before it gives the kind (`a.jsonl.zst`).
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}
LINES_SCHEMA = pa.schema([
    ("source", pa.string()), ("line", pa.int64()), ("raw", pa.large_binary()), ("kind", pa.string()),
    ("split", pa.int8()),
])
_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class SourceFile:
    uri: str
    kind: str  # jsonl | parquet | text
    split: int  # 0: from `inputs`, 1: from `eval_inputs`
    size: int  # bytes as stored (compressed, for a compressed file)
    compression: str | None = None  # gzip | zstd: decompressed as a stream while read

    @property
    def splittable(self) -> bool:
        """Whether read tasks may each take a byte range of it: plain JSONL and text only."""
        return self.kind != "parquet" and self.compression is None


def _compression(uri: str, where: str) -> tuple[str, str | None]:
    """(the name without its compression extension, the codec) for `uri`."""
    stem, ext = posixpath.splitext(posixpath.basename(uri))
    codec = COMPRESSIONS.get(ext.lower())
    if codec is None:
        return posixpath.basename(uri), None
    if posixpath.splitext(stem)[1].lower() == ".parquet":
        raise ValueError(f"{where}: {uri} is a compressed Parquet file; Parquet compresses its own pages, "
                         "write it uncompressed (e.g. compression='zstd' inside the Parquet file)")
    return stem, codec


def _kind(uri: str, file_format: str, where: str) -> tuple[str, str | None] | None:
    """(kind, compression) of an input file, or None for a file that is not data."""
    name, codec = _compression(uri, where)
    if file_format != "auto":
        if codec and file_format == "parquet":
            raise ValueError(f"{where}: {uri} is compressed, but file_format is parquet")
        return file_format, codec
    if name.startswith((".", "_")):
        return None  # _SUCCESS markers, .crc files and the like are not data
    ext = posixpath.splitext(name)[1].lower()
    if ext not in EXTENSIONS:
        raise ValueError(f"{where}: {uri} has extension {ext or '(none)'!r}; expected one of "
                         f"{', '.join(sorted(EXTENSIONS))} (JSONL and text also with {', '.join(sorted(COMPRESSIONS))}) "
                         "or set file_format")
    return EXTENSIONS[ext], codec


def discover(uris: list[str], file_format: str, split: int, field: str) -> list[SourceFile]:
    """Every input file under `uris` (files or directories, local or s3://), in a stable order."""
    out: list[SourceFile] = []
    for i, uri in enumerate(uris):
        where = f"{field}[{i}]"
        fs, path = storage.resolve(uri)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"{where}: {uri} does not exist")
        if info.type == pafs.FileType.File:
            found = [(uri, info.size)]
        else:
            selector = pafs.FileSelector(path, recursive=True)
            infos = sorted((i for i in fs.get_file_info(selector) if i.type == pafs.FileType.File), key=lambda i: i.path)
            found = [(storage.join(uri, posixpath.relpath(i.path, path)), i.size) for i in infos]
        files = [SourceFile(u, *k[:1], split, size, k[1]) for u, size in found if (k := _kind(u, file_format, where))]
        if not files:
            raise FileNotFoundError(f"{where}: {uri} holds no input files ({', '.join(sorted(EXTENSIONS))})")
        out.extend(files)
    return out


@dataclass(frozen=True)
class FilePart:
    """Lines [first_line, ...) of a file, at bytes [start, end): a big JSONL or text file is read by several
    tasks at once. Parquet files are read whole (one part)."""

    file: SourceFile
    start: int = 0
    end: int | None = None  # None: to the end of the file
    first_line: int = 1

    @property
    def size(self) -> int:
        return (self.file.size if self.end is None else self.end) - self.start


def hash_file(uri: str) -> str:
    """sha256 of a file's bytes, streamed."""
    return scan_file(uri, 0)[0]


def scan_file(uri: str, part_bytes: int) -> tuple[str, list[tuple[int, int]]]:
    """sha256 of a file's bytes and, when `part_bytes` > 0, where parts of about that size start:
    (byte offset of a line start, that line's 1-based number) at the first line start at or after every
    multiple of `part_bytes`. One streamed pass does both, so splitting a file costs no extra read."""
    fs, path = storage.resolve(uri)
    h = hashlib.sha256()
    cuts: list[tuple[int, int]] = []
    target = part_bytes or None
    offset = newlines = 0
    with fs.open_input_stream(path) as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
            while target is not None and target - 1 < offset + len(chunk):
                i = chunk.find(b"\n", max(target - 1 - offset, 0))
                if i < 0:
                    break  # no line ends in this chunk past the target: look on in the next one
                start = offset + i + 1
                cuts.append((start, newlines + chunk.count(b"\n", 0, i + 1) + 1))
                target = (start // part_bytes + 1) * part_bytes
            newlines += chunk.count(b"\n")
            offset += len(chunk)
    return h.hexdigest(), [(start, line) for start, line in cuts if start < offset]


def scan_files(files: list[tuple[str, int]]) -> list[tuple[str, list[tuple[int, int]]]]:
    """`scan_file` for each (uri, part_bytes), in order: one task's worth of small objects."""
    return [scan_file(uri, part_bytes) for uri, part_bytes in files]


def split_file(f: SourceFile, cuts: list[tuple[int, int]]) -> list[FilePart]:
    """The parts of `f` that `cuts` (from `scan_file`) mark; Parquet, compressed and uncut files are one part."""
    if not f.splittable or not cuts:
        return [FilePart(f)]
    starts = [(0, 1), *cuts]
    ends = [start for start, _ in cuts] + [None]
    return [FilePart(f, start, end, line) for (start, line), end in zip(starts, ends)]


def _block(f: SourceFile, lines: list[int], raws: list[bytes]) -> pa.Table:
    n = len(lines)
    return pa.table({
        "source": pa.array([f.uri] * n, pa.string()), "line": pa.array(lines, pa.int64()),
        "raw": pa.array(raws, pa.large_binary()), "kind": pa.array([f.kind] * n, pa.string()),
        "split": pa.array([f.split] * n, pa.int8()),
    }, schema=LINES_SCHEMA)


def read_lines(part: FilePart | SourceFile, block_rows: int) -> Iterator[pa.Table]:
    """Blocks of up to `block_rows` records from one file or part of one; line numbers are 1-based
    (Parquet: 0-based row index)."""
    part = part if isinstance(part, FilePart) else FilePart(part)
    f = part.file
    fs, path = storage.resolve(f.uri)
    if f.kind == "parquet":
        row = 0
        for batch in pq.ParquetFile(fs.open_input_file(path)).iter_batches(batch_size=block_rows):
            raws = [json.dumps(r, ensure_ascii=False, default=str).encode("utf-8") for r in batch.to_pylist()]
            yield _block(f, list(range(row, row + len(raws))), raws)
            row += len(raws)
        return
    if f.compression:
        try:
            with fs.open_input_stream(path, compression=f.compression) as stream:
                yield from _line_blocks(f, stream, part.first_line, None, True, block_rows)
        except OSError as e:  # a truncated or corrupt archive: say which file, not just the codec's complaint
            raise ValueError(f"{f.uri}: cannot read it as {f.compression} ({e}); is the file whole and "
                             f"compressed with {f.compression}?") from e
        return
    with fs.open_input_file(path) as stream:
        stream.seek(part.start)
        yield from _line_blocks(f, stream, part.first_line, part.size, part.start == 0, block_rows)


def _line_blocks(f: SourceFile, stream, first_line: int, size: int | None, at_file_start: bool,
                 block_rows: int) -> Iterator[pa.Table]:
    """Blocks of the non-blank lines in the next `size` bytes of `stream` (None: to its end)."""
    lines: list[int] = []
    raws: list[bytes] = []
    number = first_line - 1
    rest = b""
    left = size
    while True:
        chunk = stream.read(_CHUNK_BYTES if left is None else min(_CHUNK_BYTES, left))
        if at_file_start and chunk.startswith(UTF8_BOM):
            chunk = chunk[len(UTF8_BOM):]  # a byte-order mark (Windows tools write one) opens the file, not its first record
        at_file_start = False
        left = None if left is None else left - len(chunk)
        parts = (rest + chunk).split(b"\n")
        rest = parts.pop() if chunk else b""  # a line the next chunk ends
        for line in parts:
            number += 1
            if line.strip():
                lines.append(number)
                raws.append(line[:-1] if line.endswith(b"\r") else line)
        if len(lines) >= block_rows or (not chunk and lines):
            yield _block(f, lines, raws)
            lines, raws = [], []
        if not chunk:
            return


def group_files(files: list[FilePart], parallelism: int) -> list[list[FilePart]]:
    """Files (or parts) per read task: one each, unless there are many more than tasks wanted, then
    `parallelism` groups balanced by size (largest first, into the currently smallest group)."""
    if len(files) <= 2 * max(parallelism, 1):
        return [[f] for f in files]
    groups: list[list[FilePart]] = [[] for _ in range(max(parallelism, 1))]
    heap = [(0, i) for i in range(len(groups))]
    for f in sorted(files, key=lambda f: -f.size):
        size, i = heapq.heappop(heap)
        groups[i].append(f)
        heapq.heappush(heap, (size + f.size, i))
    return [g for g in groups if g]
