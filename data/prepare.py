"""The data stage: input records -> a versioned, tokenized, packed dataset in Parquet with a manifest.

    python -m pipelines.prepare_data --config configs/data/sample.yaml [key=value ...]

On Ray, streaming: read raw lines (Ray Data; compressed files as streams; a mixture's lines repeated as often as
they are taken, `data.mixture`; an Iceberg table's rows at a pinned snapshot, `data.iceberg_source`, or a Delta
table's at a pinned version, `data.delta_source`) -> validate,
clean, render with the chat template and hash (fused with the reads)
-> shuffle by content hash through storage, one file per read task and shard (`data.shuffle`) -> [near_dedup: one
task per LSH band partition names the near copies, `data.near_phase`] -> per shard, one task: exact (and near)
dedup, seeded order, tokenize, pack, train/eval files and rejects -> a small stats dict per shard back to the
driver, which writes `manifest.json` last. A version whose manifest exists is returned as it is.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import ray

from data import manifest as mf
from data import tracking
from data.config import Config, content_config_hash, shard_count
from data.datasource import LinesDatasource
from data.examples import EVAL, TRAIN, ExamplePlan, to_examples
from data.delta_source import read_delta_table, resolve_delta
from data.iceberg_source import TableRead, read_table, resolve_table, shuffle_rows
from data.mixture import plan_mixture
from data.prepared import load_manifest
from data.records import RecordRules
from data.shards import ShardPlan, build_shard_files
from data.near_dedup import NearDupPlan
from data.near_phase import find_near_copies
from data.shuffle import BANDS, EXAMPLES, FILES_SCHEMA, NEAR, shuffle_uri, write_partitions
from data.sources import FilePart, SourceFile, discover, group_files, scan_file, scan_files, split_file
from data.template import ChatRenderer, TemplateSpec
from data.tokens import (
    check_template,
    load_tokenizer,
    read_tokenizer_files,
    tokenizer_identity,
)
from core import metrics, storage, usage
from core.usage import Usage
from core.ray_cluster import cluster_cpus, init_ray, node_free_cpus
from core.resource_wait import ResourceWatch


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
    usage: Usage | None = None
    """What the job used (None: the version existed already and nothing ran)."""


def _task_threads(cpus: float, num_shards: int, node_cpus: float) -> int:
    """Rust tokenizer threads (and CPUs) per shard task: the cluster's CPUs shared by the shards, so a few
    shards on a big cluster still use it; one each when there are more shards than CPUs. A task runs on one
    node: never more than `node_cpus`, the most one node has free, or it could never be scheduled."""
    return max(1, min(int(cpus) // max(num_shards, 1), int(node_cpus), 16))


def _part_bytes(files: list[SourceFile], cpus: float) -> int:
    """Bytes per read task: about four tasks per CPU, each between 8 and 256 MiB of input."""
    return min(max(8 << 20, -(-sum(f.size for f in files) // max(4 * int(cpus), 1))), 256 << 20)


def scan_sources(files: list[SourceFile], part_bytes: int) -> tuple[dict[str, str], list[FilePart]]:
    """sha256 of every input's bytes and the parts the read tasks take (a file over 1.5 parts is cut at
    line starts): local files here, where they are; s3:// objects as Ray tasks, next to the data."""
    def cut(f: SourceFile) -> int:
        return part_bytes if f.splittable and f.size > 1.5 * part_bytes else 0

    remote = [f for f in files if storage.is_remote(f.uri)]
    scans = {f.uri: scan_file(f.uri, cut(f)) for f in files if not storage.is_remote(f.uri)}
    # One task per group of objects, as the reads are grouped: thousands of small objects are not thousands of tasks.
    groups = group_files([FilePart(f) for f in remote], 4 * max(int(cluster_cpus()), 1))
    scan_task = ray.remote(num_cpus=0.5)(scan_files)
    refs = [scan_task.remote([(p.file.uri, cut(p.file)) for p in group]) for group in groups]
    for group, result in zip(groups, ray.get(refs)):
        scans.update(zip([p.file.uri for p in group], result))
    parts = [part for f in files for part in split_file(f, scans[f.uri][1])]
    return {f.uri: scans[f.uri][0] for f in files}, parts


def check_distinct(files: list[SourceFile]) -> None:
    """A file named twice (in two mixture sources, or in inputs and eval_inputs) would be read twice: refuse it."""
    seen: dict[str, SourceFile] = {}
    for f in files:
        if f.uri in seen:
            raise ValueError(f"{f.uri} is named twice in the inputs (inputs, mixture[].inputs, eval_inputs); "
                             "name each file once")
        seen[f.uri] = f


def _template_spec(cfg: Config, tok) -> TemplateSpec:
    special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
    return TemplateSpec(tok.chat_template, special, tok.eos_token or "", cfg.append_eos)


@contextmanager
def _no_reservation():
    """Datasets made inside run without Ray Data's per-operator resource reservation. The read phase is one
    operator (the read with its fused transform), which the reservation holds to one task at a time on a 2-CPU node
    until its first task reports: 0.8-1.3 s of one idle CPU out of a ~3.5 s phase, measured on this machine. A
    dataset keeps the context it was made with (a copy), so the switch ends with the block."""
    ctx = ray.data.DataContext.get_current()
    before = ctx.op_resource_reservation_enabled
    ctx.op_resource_reservation_enabled = False
    try:
        yield
    finally:
        ctx.op_resource_reservation_enabled = before


def _by_partition(written: list[dict]) -> dict[str, dict[int, list[str]]]:
    """Shuffle files (data.shuffle's FILES_SCHEMA rows) by kind and partition, each list in a fixed order."""
    files: dict[str, dict[int, list[str]]] = {}
    for row in sorted(written, key=lambda r: r["uri"]):
        files.setdefault(row["kind"], {}).setdefault(row["part"], []).append(row["uri"])
    return files


def run_pipeline(parts: list[FilePart], part_bytes: int, example_plan: ExamplePlan,
                 shard_plan: ShardPlan, table: TableRead | None = None) -> list[dict]:
    """Run the stage on Ray; returns the stats of every shard (see `data.shards.build_shard`).

    Two phases of Ray tasks. Reads (Ray Data, about one task per `part_bytes` of input): each task validates,
    cleans, renders and hashes its lines block by block (`to_examples`, fused into the datasource) and streams
    the examples into one shuffle file per shard (`data.shuffle`; shard = content hash modulo num_shards, so
    every copy of an example meets in one shard). Then one task per shard reads its files, dedups, tokenizes,
    packs and writes that shard. Tasks hold a CPU only while they run, so nothing can sit on every CPU and
    starve the reads (the deadlock an actor pool risks on a 2-CPU machine), and no phase holds more than a
    block per read task or a shard per shard task in memory, however large the input. An Iceberg or Delta `table` is
    read by Ray Data's own reader, its blocks going through the same per-block work.
    """
    # About one read task per `part_bytes` of input (small files grouped, big ones already cut): Ray Data
    # would otherwise cut the reads into 200.
    read_tasks = min(len(parts), max(1, -(-sum(p.size for p in parts) // part_bytes)))
    near = example_plan.near
    transform = functools.partial(to_examples, plan=example_plan)
    sink = functools.partial(write_partitions, version_uri=shard_plan.version_uri,
                             band_partitions=near.partitions if near else 0)
    build = ray.remote(build_shard_files).options(num_cpus=shard_plan.tokenizer_threads)
    try:
        reads = []
        with _no_reservation():
            if parts:
                lines = LinesDatasource(parts, transform=transform, sink=sink, schema=FILES_SCHEMA)
                reads.append(ray.data.read_datasource(lines, override_num_blocks=read_tasks))
            if table:
                reader = read_delta_table if table.kind == "delta" else read_table
                reads.append(reader(table, functools.partial(shuffle_rows, read=table, transform=transform, sink=sink)))
        files = _by_partition([row for ds in reads for row in ds.take_all()])
        near_files: dict[int, list[str]] = {}
        if near:  # one task per band partition, between the reads and the shard tasks (data/near_phase.py)
            find = ray.remote(find_near_copies).options(num_cpus=1)
            found = ray.get([find.remote(uris, part, example_plan.num_shards, shard_plan.version_uri)
                             for part, uris in sorted(files.get(BANDS, {}).items())])
            near_files = _by_partition([row for rows in found for row in rows]).get(NEAR, {})
        return ray.get([build.remote(uris, shard_plan, near_files.get(part))
                        for part, uris in sorted(files.get(EXAMPLES, {}).items())])
    finally:  # after a failed task too: the files are as large as the rendered input
        storage.delete_tree(shuffle_uri(shard_plan.version_uri))


def record_metrics(cfg: Config, manifest: dict, wall_s: float) -> None:
    """The run's counts as rayline's Prometheus metrics (core/metrics.py), labelled by dataset and version."""
    tags = {"dataset": storage.basename(cfg.output_uri), "version": manifest["version"]}
    counts, splits = manifest["counts"], manifest["splits"]
    metrics.inc("rayline_data_records_read", counts["read"], **tags)
    metrics.inc("rayline_data_records_deduplicated", counts["deduplicated"], **tags)
    for reason, n in counts["rejected_by_reason"].items():
        metrics.inc("rayline_data_records_rejected", n, reason=reason, **tags)
    for split, s in splits.items():
        metrics.inc("rayline_data_tokens_written", s["tokens"], split=split, **tags)
    metrics.observe("rayline_data_duration_seconds", wall_s, **tags)


def main(cfg: Config) -> Result:
    """Prepare (or find already prepared) the dataset version for `cfg`; see the module docstring."""
    t0 = time.perf_counter()
    init_ray()
    meter = usage.StageUsage.start()
    mixture_files = [discover(m.inputs, cfg.file_format, TRAIN, f"mixture[{i}].inputs") for i, m in enumerate(cfg.mixture)]
    files = discover(cfg.inputs, cfg.file_format, TRAIN, "inputs") if cfg.inputs else []
    files += [f for source in mixture_files for f in source]
    files += discover(cfg.eval_inputs, cfg.file_format, EVAL, "eval_inputs")
    check_distinct(files)
    # A table's snapshot (Iceberg) or version (Delta) is pinned now, once.
    table = resolve_table(cfg.iceberg) if cfg.iceberg else resolve_delta(cfg.delta) if cfg.delta else None
    if cfg.format != "text" and any(f.kind == "text" for f in files):
        bad = next(f.uri for f in files if f.kind == "text")
        raise ValueError(f"inputs: {bad} is plain text, but format is {cfg.format}; plain text files need format: text")

    _, tok_files = read_tokenizer_files(cfg.tokenizer)
    chat_template = storage.read_text(cfg.chat_template) if cfg.chat_template else None
    tok = load_tokenizer(tok_files, chat_template)
    if cfg.format != "text":
        check_template(tok.chat_template, f"tokenizer {cfg.tokenizer}")
    identity = tokenizer_identity(cfg.tokenizer, tok_files, tok)

    cpus = cluster_cpus()
    part_bytes = _part_bytes(files, cpus)
    source_hashes, parts = scan_sources(files, part_bytes)
    if table:
        source_hashes[table.source] = table.identity()
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

    mixture, mixture_rows = plan_mixture(cfg, mixture_files) if cfg.mixture else (None, [])
    # Shards by the bytes the run takes: a mixture source's repeats (or its left-out records) counted.
    taken = {f.uri: r["taken"] / r["records"] for source, r in zip(mixture_files, mixture_rows) for f in source}
    input_bytes = int(sum(f.size * taken.get(f.uri, 1.0) for f in files)) + (table.bytes if table else 0)
    num_shards = shard_count(cfg, input_bytes)
    # Band partitions as many as shards: a band task holds `bands` small rows per example of its share.
    near = NearDupPlan.from_config(cfg, num_shards) if cfg.near_dedup else None
    example_plan = ExamplePlan(RecordRules.from_config(cfg), ChatRenderer.build(_template_spec(cfg, tok)), cfg.seed,
                               0.0 if cfg.eval_inputs else cfg.eval_fraction, cfg.seq_len, num_shards, mixture, near)
    threads = _task_threads(cpus, num_shards, node_free_cpus())
    shard_plan = ShardPlan(version_uri, tok.backend_tokenizer.to_str(), cfg.format, cfg.seq_len, cfg.packing,
                           cfg.truncate, cfg.dedup, cfg.seed, identity["pad_token_id"], cfg.tokenize_batch_size,
                           threads)
    with tracking.data_run(cfg, version, manifest_uri) as run_id:
        with ResourceWatch("prepare_data", max_wait_s=cfg.max_wait_s):
            totals = mf.add_up(run_pipeline(parts, part_bytes, example_plan, shard_plan, table))
        sources = [f.uri for f in files] + ([table.source] if table else [])
        manifest = mf.build_manifest(cfg, version, version_uri, sources, source_hashes, identity, totals, run_id,
                                     num_shards)
        if mixture_rows:
            manifest["mixture"] = mixture_rows
        if table:
            manifest[table.kind] = table.manifest_entry()
        if near:
            manifest["near_dedup"] = {"threshold": cfg.near_dedup_threshold, "ngram": near.ngram,
                                      "num_perm": near.num_perm, "bands": near.bands, "rows": near.rows}
        # How it was built, not what it holds: the same version built elsewhere has other values here.
        manifest["built_with"] = {"cluster_cpus": cpus, "tokenizer_threads_per_shard": threads}
        wall_s = time.perf_counter() - t0
        used = meter.totals()
        usage.record("data", used, run_id, version=version)
        if run_id:
            tracking.log_outcome(manifest, manifest_uri, wall_s)
        mf.check_reject_fraction(manifest["counts"], cfg.max_reject_fraction, storage.join(version_uri, "rejects"))
        mf.write_manifest(manifest, manifest_uri)
        if run_id:
            tracking.log_manifest(manifest_uri)
    record_metrics(cfg, manifest, wall_s)
    return Result(version, manifest_uri, version_uri, manifest["counts"], manifest["splits"],
                  manifest["packing_efficiency"], wall_s=wall_s, mlflow_run_id=run_id, manifest=manifest,
                  usage=used)
