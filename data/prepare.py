"""The data stage: input records -> a versioned, tokenized, packed dataset in Parquet with a manifest.

    python -m pipelines.prepare_data --config configs/data/sample.yaml [key=value ...]

On Ray Data, streaming: read raw lines -> validate, clean, render with the chat template and hash
(fused with the reads) -> hash-shuffle by content bucket -> per bucket: exact dedup, seeded order,
tokenize, pack, train/eval shards and rejects -> a small stats row per bucket back to the driver, which
writes `manifest.json` last. A version whose manifest exists is returned as it is.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import ray
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from data import manifest as mf
from data import tracking
from data.config import Config, content_config_hash
from data.prepared import load_manifest
from data.examples import EVAL, TRAIN, ExamplePlan, TemplateSpec, to_examples
from data.records import RecordRules
from data.shards import ShardBuilder, ShardPlan
from data.sources import LINES_SCHEMA, SourceFile, discover, group_files, hash_file, read_lines
from data.tokens import check_template, load_tokenizer, read_tokenizer_files, tokenizer_identity
from pipelines import storage
from pipelines.ray_cluster import cluster_cpus, init_ray


@dataclass
class Result:
    version: str
    manifest_uri: str
    version_uri: str
    counts: dict
    splits: dict
    packing_efficiency: float
    skipped: bool = False
    wall_s: float = 0.0
    mlflow_run_id: str | None = None
    manifest: dict = field(default_factory=dict, repr=False)


class LinesDatasource(Datasource):
    """Ray Data datasource over the input files: raw lines (see `data.sources.read_lines`), one read task
    per file, or per group of files when there are many small ones."""

    def __init__(self, files: list[SourceFile], block_rows: int = 8192):
        super().__init__()
        self.files = files
        self.block_rows = block_rows

    def estimate_inmemory_data_size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def supports_distributed_reads(self) -> bool:
        # A local path exists on the driver's node only (unless it is a shared mount, which we cannot tell).
        return all(storage.is_remote(f.uri) for f in self.files)

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
        tasks = []
        for group in group_files(self.files, parallelism):
            meta = BlockMetadata(num_rows=None, size_bytes=sum(f.size for f in group), exec_stats=None,
                                 input_files=[f.uri for f in group])

            def read(group=group, block_rows=self.block_rows):
                for f in group:
                    yield from read_lines(f, block_rows)

            tasks.append(ReadTask(read, meta, schema=LINES_SCHEMA, per_task_row_limit=per_task_row_limit))
        return tasks


def _pool_size(cpus: float, num_shards: int) -> tuple[int, int]:
    """(tokenizer actors, threads per actor). An actor pool holding every logical CPU starves the read
    tasks that feed it (a deadlock on a 2-CPU box), so one CPU always stays free for them; the Rust
    tokenizer's own threads then use the cores the pool does not hold."""
    actors = max(1, min(int(cpus) - 1, num_shards))
    return actors, max(1, int(cpus) // actors)


def _hash_sources(files: list[SourceFile]) -> dict[str, str]:
    """sha256 of every input's bytes: local files here (where they are), s3:// objects as Ray tasks."""
    remote = [f.uri for f in files if storage.is_remote(f.uri)]
    refs = [ray.remote(num_cpus=0.5)(hash_file).remote(uri) for uri in remote]
    hashes = {f.uri: hash_file(f.uri) for f in files if not storage.is_remote(f.uri)}
    hashes.update(zip(remote, ray.get(refs)))
    return {f.uri: hashes[f.uri] for f in files}


def _template_spec(cfg: Config, tok) -> TemplateSpec:
    special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
    return TemplateSpec(tok.chat_template, special, tok.eos_token or "", cfg.append_eos)


def build_dataset(cfg: Config, files: list[SourceFile], example_plan: ExamplePlan, shard_plan: ShardPlan,
                  actors: int) -> ray.data.Dataset:
    """The lazy pipeline; iterating it runs the stage and yields one stats row per bucket."""
    return (
        ray.data.read_datasource(LinesDatasource(files))
        .map_batches(to_examples, batch_format="pyarrow", batch_size=None, fn_kwargs={"plan": example_plan})
        .groupby("bucket", num_partitions=cfg.num_shards)
        .map_groups(ShardBuilder, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=actors),
                    num_cpus=1, fn_constructor_kwargs={"plan": shard_plan})
    )


def main(cfg: Config) -> Result:
    """Prepare (or find already prepared) the dataset version for `cfg`; see the module docstring."""
    t0 = time.perf_counter()
    init_ray()
    files = discover(cfg.inputs, cfg.file_format, TRAIN, "inputs")
    files += discover(cfg.eval_inputs, cfg.file_format, EVAL, "eval_inputs")
    if cfg.format != "text" and any(f.kind == "text" for f in files):
        bad = next(f.uri for f in files if f.kind == "text")
        raise ValueError(f"inputs: {bad} is plain text, but format is {cfg.format}; plain text files need format: text")

    _, tok_files = read_tokenizer_files(cfg.tokenizer)
    chat_template = storage.read_text(cfg.chat_template) if cfg.chat_template else None
    tok = load_tokenizer(tok_files, chat_template)
    if cfg.format != "text":
        check_template(tok.chat_template, f"tokenizer {cfg.tokenizer}")
    identity = tokenizer_identity(cfg.tokenizer, tok_files, tok)

    source_hashes = _hash_sources(files)
    version = mf.dataset_version(source_hashes, identity, content_config_hash(cfg))
    version_uri = storage.join(cfg.output_uri, version)
    manifest_uri = storage.join(version_uri, "manifest.json")
    if storage.exists(manifest_uri) and not cfg.overwrite:
        manifest = load_manifest(manifest_uri)
        return Result(version, manifest_uri, version_uri, manifest["counts"], manifest["splits"],
                      manifest["packing_efficiency"], skipped=True, wall_s=time.perf_counter() - t0,
                      mlflow_run_id=manifest.get("mlflow_run_id"), manifest=manifest)
    if storage.exists(version_uri):
        storage.delete_tree(version_uri)  # a failed or overwritten earlier attempt: start clean

    example_plan = ExamplePlan(RecordRules.from_config(cfg), _template_spec(cfg, tok), cfg.num_shards, cfg.seed,
                               0.0 if cfg.eval_inputs else cfg.eval_fraction, cfg.seq_len)
    actors, threads = _pool_size(cluster_cpus(), cfg.num_shards)
    shard_plan = ShardPlan(version_uri, tok.backend_tokenizer.to_str(), cfg.format, cfg.seq_len, cfg.packing,
                           cfg.truncate, cfg.dedup, cfg.seed, identity["pad_token_id"], cfg.tokenize_batch_size,
                           threads)
    with tracking.data_run(cfg, version, manifest_uri) as run_id:
        stats = [json.loads(row["stats"]) for row in build_dataset(cfg, files, example_plan, shard_plan, actors).iter_rows()]
        totals = mf.add_up(stats)
        manifest = mf.build_manifest(cfg, version, version_uri, [f.uri for f in files], source_hashes, identity,
                                     totals, run_id)
        wall_s = time.perf_counter() - t0
        if run_id:
            tracking.log_outcome(manifest, manifest_uri, wall_s)
        mf.check_reject_fraction(manifest["counts"], cfg.max_reject_fraction, storage.join(version_uri, "rejects"))
        mf.write_manifest(manifest, manifest_uri)
        if run_id:
            tracking.log_manifest(manifest_uri)
    return Result(version, manifest_uri, version_uri, manifest["counts"], manifest["splits"],
                  manifest["packing_efficiency"], wall_s=wall_s, mlflow_run_id=run_id, manifest=manifest)
