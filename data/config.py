"""The data stage's config: what to read, how to clean and tokenize it, where the prepared version goes.

`configs/data/*.yaml` mirror this dataclass field for field; `python -m pipelines.prepare_data --config
FILE key=value ...` builds it with `core.config.load_config`, so a bad field fails before Ray starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from core.config import config_hash, require, to_dict

# Fields that say where or how to run, not what the data is: they stay out of the dataset version.
NOT_IN_VERSION = ("output_uri", "overwrite", "mlflow_experiment", "tokenizer", "tokenize_batch_size")
# An Iceberg or Delta table counts as a source, not as config: what it holds (table id, the resolved snapshot or
# version, filter, mapping) is hashed with the input files (data/iceberg_source.py, data/delta_source.py), so the
# current snapshot and the same one named outright are one version, and a table moved elsewhere keeps it.
IN_SOURCES = ("iceberg", "delta")


@dataclass
class MixtureSource:
    """One named source of a mixture: its files and its share of the records taken."""

    name: str
    inputs: list[str]
    """Files or directories (local paths or s3:// URIs), as `Config.inputs`."""
    weight: float
    """Its share of `mixture_records` (weights are normalised: 7/2/1 and 0.7/0.2/0.1 are the same mixture)."""


@dataclass
class IcebergCatalog:
    """A pyiceberg SQL catalog on SQLite. No credentials here: a warehouse on s3:// is read with the AWS_* variables
    of each process (core/storage.py), as every other s3:// input is."""

    uri: str
    """The catalog database, `sqlite:///relative/path.db` or `sqlite:////absolute/path.db`."""
    warehouse: str
    """Where the catalog's tables keep their files: a local path, file:// or s3:// URI."""
    name: str = "default"
    type: Literal["sql"] = "sql"


def require_distinct_fields(columns: dict[str, str], where: str) -> None:
    """A table's column mapping gives each column a record field of its own (ConfigError naming `<where>.<column>`)."""
    fields = list(columns.values())
    for i, (column, name) in enumerate(columns.items()):
        require(bool(name.strip()) and name not in fields[:i], f"{where}.{column}",
                f"{name!r}: each column needs a field name of its own")


@dataclass
class IcebergTable:
    """An Apache Iceberg table read as training records (data/iceberg_source.py), at one snapshot."""

    table: str
    """The table identifier, `namespace.table`."""
    catalog: IcebergCatalog
    key_column: str
    """An integer column that names a row: a reject's `line` is its value (the table has no line numbers)."""
    columns: dict[str, str] = field(default_factory=dict)
    """Table column -> record field the format expects (`{question: prompt, answer: response}`); other columns
    keep their names."""
    snapshot_id: int = 0
    """The snapshot to read; 0 = the table's current one, resolved once at the start and recorded in the manifest."""
    row_filter: str = ""
    """pyiceberg's filter syntax (`lang = 'en' and id > 10`); only rows it matches are read. Empty = every row."""

    def __post_init__(self):
        require(self.table.count(".") >= 1 and all(p.strip() for p in self.table.split(".")), "iceberg.table",
                f"{self.table!r}: give namespace.table")
        require(self.catalog.uri.startswith("sqlite:///"), "iceberg.catalog.uri",
                f"{self.catalog.uri!r}: give a sqlite:/// URI (a catalog database with a password would put a "
                "secret in the config)")
        require(bool(self.catalog.warehouse.strip()), "iceberg.catalog.warehouse", "empty path")
        require(bool(self.key_column.strip()), "iceberg.key_column", "name an integer column that identifies a row")
        require(self.snapshot_id >= 0, "iceberg.snapshot_id", f"{self.snapshot_id} must be >= 0 (0 = current)")
        require_distinct_fields(self.columns, "iceberg.columns")


@dataclass
class DeltaSource:
    """A Delta Lake table read as training records (data/delta_source.py), at one version of its log."""

    uri: str
    """The table's directory: a local path, file:// or s3:// URI (s3:// read with each process's AWS_* variables)."""
    key_column: str
    """An integer column that names a row: a reject's `line` is its value (the table has no line numbers)."""
    columns: dict[str, str] = field(default_factory=dict)
    """Table column -> record field the format expects (`{question: prompt, answer: response}`); other columns
    keep their names."""
    version: int = -1
    """The table version to read (Delta numbers them from 0); -1 = the current one, resolved once at the start and
    recorded in the manifest."""
    row_filter: str = ""
    """The same filter syntax as `iceberg.row_filter` (`lang = 'en' and id > 10`). Empty = every row."""

    def __post_init__(self):
        require(bool(self.uri.strip()), "delta.uri", "empty path")
        require(bool(self.key_column.strip()), "delta.key_column", "name an integer column that identifies a row")
        require(self.version >= -1, "delta.version", f"{self.version} must be >= 0, or -1 for the current version")
        require_distinct_fields(self.columns, "delta.columns")


@dataclass
class Config:
    inputs: list[str]
    """Files or directories (local paths or s3:// URIs) of training records; [] when `mixture` names them."""
    output_uri: str
    """Where versions go: `<output_uri>/<version>/{manifest.json,train/,eval/,rejects/}`."""
    tokenizer: str
    """A local path, an s3:// URI, a Hugging Face id or `models:/name@alias` (its tokenizer files are used)."""
    format: Literal["chat", "instruction", "text"] = "chat"
    """Record format, declared rather than guessed: chat `messages`, instruction `prompt`/`response`, raw `text`."""
    eval_inputs: list[str] = field(default_factory=list)
    """Records that form the eval split as they are; when given, no random split of `inputs` happens."""
    file_format: Literal["auto", "jsonl", "parquet", "text"] = "auto"
    """`auto` picks by extension (.jsonl/.json/.ndjson, .parquet, .txt) and refuses any other file."""
    seq_len: int = 2048
    """Tokens per output row."""
    packing: Literal["pack", "pad"] = "pack"
    """`pack` puts several examples in a row (segment_ids keep them apart); `pad` gives each its own row."""
    eval_fraction: float = 0.05
    """Share of `inputs` records that go to eval, chosen by a hash of content and seed (ignored with eval_inputs)."""
    seed: int = 0
    """Seeds the shuffle order and the train/eval split."""
    num_shards: int = 0
    """Hash partitions of the examples by content; each becomes one Parquet file per split, built by one task.
    0 = by input size, one per `shard_bytes` of input, so a shard task's memory does not grow with the input."""
    shard_bytes: int = 64 << 20
    """With num_shards 0: input bytes per shard (a shard task holds its shard in memory, a few times this)."""
    max_reject_fraction: float = 0.05
    """The run fails at the end (rejects still written, no manifest) when more records than this are rejected."""
    min_chars: int = 1
    """Records whose cleaned content is shorter are rejected as too_short."""
    max_chars: int = 200_000
    """Records whose cleaned content is longer are rejected as too_long_chars (before tokenizing)."""
    truncate: bool = False
    """Chat/instruction examples over seq_len tokens: cut to seq_len if true, else rejected as too_long.
    Raw text documents over seq_len are always split into seq_len pieces, as continued pre-training does."""
    dedup: bool = True
    """Drop exact duplicates of normalised content (across all inputs; an eval copy wins over a train copy)."""
    unicode_form: Literal["NFC", "NFKC", "none"] = "NFC"
    """Unicode normalisation applied to every text field."""
    append_eos: bool = True
    """Raw text format: end each document with the tokenizer's eos token."""
    text_field: str = "text"
    """Raw text format in JSONL/Parquet: the field holding the text (plain .txt files: one record per line)."""
    prompt_field: str = "prompt"
    response_field: str = "response"
    system_field: str = "system"
    """Instruction format: field names; the optional system field becomes a system message."""
    chat_template: str | None = None
    """A Jinja chat template file (path or s3://) used instead of the tokenizer's; it must mark assistant
    turns with `{% generation %}` so labels can be masked."""
    tokenize_batch_size: int = 1024
    """Records per batched tokenizer call."""
    overwrite: bool = False
    """Rebuild a version whose manifest already exists (otherwise the run returns it untouched)."""
    mlflow_experiment: str = "rayline-data"
    max_wait_s: float = 0.0
    """Seconds this stage may wait for cluster resources before it fails with the wait's report (what it asked for,
    what is free, what holds the rest, whether an autoscaler can add nodes: core/resource_wait.py); 0 = wait as
    long as it takes (the report is printed all the same, 10 s into a wait and every minute after)."""
    mixture: list[MixtureSource] = field(default_factory=list)
    """Instead of `inputs`: named sources sampled by weight into `mixture_records` training records, chosen
    deterministically from `seed` (data/mixture.py). A source asked for more records than it has is repeated whole
    before any record of it a second time. The manifest's `mixture` lists each source's weight and records taken."""
    mixture_records: int = 0
    """Records (input lines) a mixture takes in all; 0 = the most it can take without repeating any source."""
    near_dedup: bool = False
    """Also drop near-duplicates: records whose word shingles have an estimated Jaccard similarity of about
    `near_dedup_threshold` or more with an earlier record (MinHash LSH, data/near_dedup.py). Each one removed is in
    the rejects as near_duplicate, naming the record it is a near copy of."""
    near_dedup_threshold: float = 0.8
    """Jaccard similarity of shingle sets from which records count as near copies (LSH bands are chosen for it)."""
    near_dedup_ngram: int = 5
    """Words per shingle."""
    near_dedup_num_perm: int = 128
    """MinHash permutations (signature length): more is a sharper threshold and more work per record."""
    iceberg: IcebergTable | None = None
    """An Iceberg table read as training records, beside or instead of `inputs` (docs/DATA.md, "Iceberg tables")."""
    delta: DeltaSource | None = None
    """A Delta Lake table read as training records, beside or instead of `inputs` (docs/DATA.md, "Delta tables")."""

    def __post_init__(self):
        if self.mixture:
            require(not self.inputs, "inputs", "give inputs or mixture, not both (a mixture's sources name their files)")
            names = [m.name for m in self.mixture]
            for i, m in enumerate(self.mixture):
                require(bool(m.name.strip()) and m.name not in names[:i], f"mixture[{i}].name",
                        f"{m.name!r}: each source needs a name of its own")
                require(len(m.inputs) > 0, f"mixture[{i}].inputs", "give at least one file or directory")
                require(m.weight > 0, f"mixture[{i}].weight", f"{m.weight} must be > 0")
                for j, uri in enumerate(m.inputs):
                    require(bool(str(uri).strip()), f"mixture[{i}].inputs[{j}]", "empty path")
            require(self.iceberg is None, "iceberg", "a mixture's sources are files; read the table without a mixture")
            require(self.delta is None, "delta", "a mixture's sources are files; read the table without a mixture")
        else:
            require(len(self.inputs) > 0 or self.iceberg is not None or self.delta is not None, "inputs",
                    "give at least one file or directory (or a mixture, an iceberg table or a delta table)")
        require(self.iceberg is None or self.delta is None, "delta", "one table per dataset: give iceberg or delta")
        require(self.mixture_records >= 0, "mixture_records", f"{self.mixture_records} must be >= 0")
        require(0.0 < self.near_dedup_threshold < 1.0, "near_dedup_threshold",
                f"{self.near_dedup_threshold} must be in (0, 1)")
        require(1 <= self.near_dedup_ngram <= 64, "near_dedup_ngram", f"{self.near_dedup_ngram} must be in 1 .. 64")
        require(16 <= self.near_dedup_num_perm <= 1024, "near_dedup_num_perm",
                f"{self.near_dedup_num_perm} must be in 16 .. 1024")
        for name in ("inputs", "eval_inputs"):
            for i, uri in enumerate(getattr(self, name)):
                require(bool(str(uri).strip()), f"{name}[{i}]", "empty path")
        require(bool(self.output_uri.strip()), "output_uri", "empty path")
        require(self.max_wait_s >= 0, "max_wait_s", f"must be >= 0 (0 = no limit), got {self.max_wait_s}")
        require(bool(self.tokenizer.strip()), "tokenizer", "empty; give a path, s3:// URI, hub id or models:/ ref")
        require(8 <= self.seq_len <= 1 << 20, "seq_len", f"{self.seq_len} is out of range (8 .. 1048576)")
        require(0.0 <= self.eval_fraction < 1.0, "eval_fraction", f"{self.eval_fraction} must be in [0, 1)")
        require(0.0 <= self.max_reject_fraction <= 1.0, "max_reject_fraction", "must be in [0, 1]")
        require(0 <= self.num_shards <= 100_000, "num_shards", f"{self.num_shards} must be in 0 (by input size) .. 100000")
        require(self.shard_bytes >= 1 << 20, "shard_bytes", f"{self.shard_bytes} must be at least 1 MiB")
        require(0 <= self.min_chars <= self.max_chars, "min_chars", "must be >= 0 and <= max_chars")
        require(self.tokenize_batch_size >= 1, "tokenize_batch_size", "must be >= 1")


# Fields added after versions were first built: at their defaults they stay out of the hash, so a config that does
# not use them keeps the version it had (a re-run stays a no-op across the upgrade).
LATER_FIELDS = ("mixture", "mixture_records", "near_dedup", "near_dedup_threshold", "near_dedup_ngram",
                "near_dedup_num_perm")


def version_config(cfg: Config) -> dict:
    """The part of the config that decides the output's content (what the version hashes)."""
    defaults = to_dict(Config(inputs=["-"], output_uri="-", tokenizer="-"))
    return {k: v for k, v in to_dict(cfg).items()
            if k not in NOT_IN_VERSION + IN_SOURCES and not (k in LATER_FIELDS and v == defaults[k])}


def shard_count(cfg: Config, input_bytes: int) -> int:
    """The shards a run builds: `num_shards`, or (0) one per `shard_bytes` of input. It depends on the input and the
    config only, never on the cluster, so a dataset version has one content wherever it is built."""
    return cfg.num_shards or min(100_000, max(1, -(-input_bytes // cfg.shard_bytes)))


def content_config_hash(cfg: Config) -> str:
    return config_hash(version_config(cfg))
