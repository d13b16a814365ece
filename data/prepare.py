"""The data stage: input records -> a versioned, tokenized, packed dataset in Parquet with a manifest.

    python -m pipelines.prepare_data --config configs/data/sample.yaml [key=value ...]

On Ray Data, streaming: read raw lines -> validate, clean, render with the chat template and hash
(fused with the reads) -> hash-shuffle by content hash -> per shard: exact dedup, seeded order,
tokenize, pack, train/eval files and rejects -> a small stats row per shard back to the driver, which
writes `manifest.json` last. A version whose manifest exists is returned as it is.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import ray

from data import manifest as mf
from data import tracking
from data.config import Config, content_config_hash
from data.datasource import LinesDatasource
from data.examples import EVAL, TRAIN, ExamplePlan, TemplateSpec, to_examples
from data.prepared import load_manifest
from data.records import RecordRules
from data.shards import ShardBuilder, ShardPlan
from data.sources import SourceFile, discover, hash_file
from data.tokens import (
    check_template,
    load_tokenizer,
    read_tokenizer_files,
    tokenizer_identity,
)
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


def _pool_size(cpus: float, num_shards: int) -> tuple[int, int]:
    """(most tokenizer actors, Rust tokenizer threads per actor) for `cpus` logical CPUs: an actor per
    CPU (never more than there are shards to build), and the CPUs no actor can use as tokenizer threads."""
    actors = max(1, min(int(cpus), num_shards))
    return actors, max(1, int(cpus) // actors)


def _hash_sources(files: list[SourceFile]) -> dict[str, str]:
    """sha256 of every input's bytes: local files here (where they are), s3:// objects as Ray tasks."""
    remote = [f.uri for f in files if storage.is_remote(f.uri)]
    hash_task = ray.remote(num_cpus=0.5)(hash_file)
    refs = [hash_task.remote(uri) for uri in remote]
    hashes = {f.uri: hash_file(f.uri) for f in files if not storage.is_remote(f.uri)}
    hashes.update(zip(remote, ray.get(refs)))
    return {f.uri: hashes[f.uri] for f in files}


def _template_spec(cfg: Config, tok) -> TemplateSpec:
    special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
    return TemplateSpec(tok.chat_template, special, tok.eos_token or "", cfg.append_eos)


def run_pipeline(cfg: Config, files: list[SourceFile], example_plan: ExamplePlan, shard_plan: ShardPlan,
                 actors: int) -> list[dict]:
    """Run the stage on Ray Data; returns the stats of every shard (see `data.shards.build_shard`).

    Two executions, so that each has every CPU. First the reads, validation and rendering (tasks) and the
    hash shuffle by content hash, whose output stays in the object store: the shuffle is a barrier anyway,
    so this holds nothing the shuffle would not. Then the tokenizer actors, one shard (partition) per call.
    Started together, the actor pool would hold CPUs idle while the reads need them, and a pool holding
    every CPU would leave the reads none at all (a deadlock on a 2-CPU machine); started after, nothing
    upstream needs a CPU, so the pool may grow to every CPU.
    """
    shards = (
        ray.data.read_datasource(LinesDatasource(files))
        .map_batches(to_examples, batch_format="pyarrow", batch_size=None, fn_kwargs={"plan": example_plan})
        # Hash shuffle on the content hash: duplicates share a partition, and each partition is one block.
        .repartition(cfg.num_shards, keys=["key0"])
        .materialize()
    )
    pool = ray.data.ActorPoolStrategy(min_size=1, max_size=actors, max_tasks_in_flight_per_actor=1)
    built = shards.map_batches(ShardBuilder, batch_format="pyarrow", batch_size=None, compute=pool, num_cpus=1,
                                fn_constructor_kwargs={"plan": shard_plan})
    return [json.loads(row["stats"]) for row in built.iter_rows()]


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

    example_plan = ExamplePlan(RecordRules.from_config(cfg), _template_spec(cfg, tok), cfg.seed,
                               0.0 if cfg.eval_inputs else cfg.eval_fraction, cfg.seq_len)
    actors, threads = _pool_size(cluster_cpus(), cfg.num_shards)
    shard_plan = ShardPlan(version_uri, tok.backend_tokenizer.to_str(), cfg.format, cfg.seq_len, cfg.packing,
                           cfg.truncate, cfg.dedup, cfg.seed, identity["pad_token_id"], cfg.tokenize_batch_size,
                           threads)
    with tracking.data_run(cfg, version, manifest_uri) as run_id:
        totals = mf.add_up(run_pipeline(cfg, files, example_plan, shard_plan, actors))
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
