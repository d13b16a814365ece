"""Batch inference and evaluation: Ray Data reads prompts, a vLLM engine actor pool answers them, Parquet out.

    read (JSONL lines | Parquet rows)        tasks, cpu_stage_num_cpus each; every row with its `source`
                                             (file:line), serve/batch/inputs.py
      -> ray.data.llm vLLM engine stage      actor pool of num_engines, placement from serve/online/engine.py; the
                                             UDF is serve/batch/engine_stage.py's: rows.PromptValidator (chat
                                             template, tokenize, refuse bad rows with a reason), then Ray's
                                             stage (EngineCore forked on CPU)
      -> result_rows                         tasks: one schema for answered and refused rows
      -> write_parquet(output_uri)            with Ray Data's job-level checkpoint: a job started again after a
                                             crash answers only the rows not written yet (serve/batch/resume.py)
then, from the written Parquet: totals, eval metrics, and in eval mode an MLflow run plus `eval.*` tags on
the model version. ray.data.llm's own chat-template/tokenize/detokenize stages are off: the validator has
to tokenize anyway to refuse over-long prompts, and vLLM detokenizes as it generates, so each would only
be one more actor pool competing for the same cores. The driver builds the plan without importing vLLM, torch
or transformers' model code (serve/batch/driver_start.py): only the engine actors import them."""

from __future__ import annotations

import os
import time
from pathlib import Path
from dataclasses import dataclass, field

import pyarrow.parquet as pq
import ray
import ray.data

from core import metrics, storage, usage
from core.ray_cluster import init_ray
from core.resource_wait import ResourceWatch
from core.usage import Usage
from serve.online import engine as eng
from serve.batch import metrics as batch_metrics
from serve.batch.config import Config
from serve.batch.driver_start import plan_without_engine_imports
from serve.batch.inputs import count_input_rows, input_format, read_inputs
from serve.batch.progress import ProgressReporter
from serve.batch.resume import job_checkpoint, job_done, job_identity, prepare_output
from serve.batch.results import result_batches
from serve.batch.rows import result_rows
from serve.batch.rows import MODEL_COLUMN
from serve.batch import report
from serve.batch.tracking import EVAL_TAG_PREFIX, record_eval
from serve.online.adapters import Adapter, lora_engine_kwargs, resolve_adapter

@dataclass
class Result:
    output_uri: str
    model: str
    """The model version label (`name/N`, else the reference)."""
    rows: int
    errors: int
    error_codes: dict[str, int]
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    """End to end: model resolution, engine start-up, inference and writing."""
    output_tokens_per_s: float
    """This run's output tokens over wall_s."""
    steady_output_tokens_per_s: float | None
    """Output tokens over the engine's busy time (first request queued -> last token): start-up excluded."""
    scores: dict[str, float] = field(default_factory=dict)
    eval_run_id: str | None = None
    resumed_rows: int = 0
    """Rows an interrupted earlier run of the job had written (kept, not answered again); the totals count
    them, the throughput figures do not."""
    adapters: dict[str, dict[str, float]] = field(default_factory=dict)
    """In a job with adapters: each adapter's label (`name/N`) -> its scores (eval mode) over the same rows as
    `scores`, which are the base's; every other figure above counts all the models' rows together."""
    adapter_eval_run_ids: dict[str, str] = field(default_factory=dict)
    compared: dict[str, dict[str, float]] = field(default_factory=dict)
    """In a job with `compare`: each compared model's label -> its scores over the same rows (eval mode)."""
    compared_eval_run_ids: dict[str, str] = field(default_factory=dict)
    usage: Usage | None = None
    """CPU- and GPU-seconds of this run's processes, engines included (core/usage.py); in eval mode each model's
    eval run and version carry its share, by the rows it answered."""


def metric_tags(cfg: Config, info: eng.ModelInfo) -> dict[str, str]:
    """Labels of this job's batch metrics (core/metrics.py): the output's name, the model version, the mode."""
    return {"run": storage.basename(cfg.output_uri), "model": info.label, "mode": cfg.mode}


def engine_processor(cfg: Config, model_path: str, jsonl: bool = True, models: dict[str, str] | None = None,
                     adapters: list[Adapter] = ()):
    """The ray.data.llm vLLM processor, its engine kwargs and placement taken from serve/online/engine.py, whose
    engine stage validates raw input rows (JSONL lines if `jsonl`, else Parquet rows). With `adapters`, the
    engines run LoRA and each row goes to the model its `model_version` names (`models`: label -> the base's
    path or an adapter's directory). Built without importing vLLM, torch or transformers' model code
    (serve/batch/driver_start.py), from the imports to the plan."""
    with plan_without_engine_imports():
        return _engine_processor(cfg, model_path, jsonl, models, list(adapters))


def _engine_processor(cfg: Config, model_path: str, jsonl: bool, models: dict[str, str] | None,
                      adapters: list[Adapter]):
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    from serve.batch.engine_stage import use_rayline_engine_stage

    e = cfg.engine
    engine_kwargs = eng.vllm_engine_kwargs(e)
    for name, value in lora_engine_kwargs(adapters).items():
        engine_kwargs.setdefault(name, value)  # what engine_kwargs says wins
    config = vLLMEngineProcessorConfig(
        model_source=model_path,
        engine_kwargs=engine_kwargs,
        placement_group_config=eng.placement_group_config(e),
        accelerator_type=e.accelerator_type,
        runtime_env=eng.runtime_env(e) or None,
        # (n, n): a fixed pool. A bare int means an autoscaling pool of 1..n for this stage, which starts one
        # engine and only adds more when Ray Data's autoscaler sees a queue (on a small cluster: never).
        concurrency=(cfg.num_engines, cfg.num_engines),
        batch_size=cfg.batch_size,
        max_concurrent_batches=cfg.max_concurrent_batches,
        # Ray's default (2x) lets the first engine up take the whole queue while the others are still loading
        # (with read_blocks' small blocks, a task is about one batch).
        max_tasks_in_flight_per_actor=cfg.max_concurrent_batches,
        should_continue_on_error=True,
        chat_template_stage=False,
        tokenize_stage=False,
        detokenize_stage=False,
        log_engine_metrics=False,
    )
    # The processor's pre/post maps are tasks that default to 1 CPU each: fractional, or they wait forever
    # for a CPU the engine holds.
    cpu = {"num_cpus": cfg.cpu_stage_num_cpus}
    # build_processor calls ray.init(ignore_reinit_error=True), which parses RAY_ADDRESS before noticing Ray
    # is up, and refuses the Jobs API's http:// address that a Ray job (and the local stack) sets.
    address = os.environ.pop("RAY_ADDRESS", None) if os.environ.get("RAY_ADDRESS", "").startswith("http") else None
    try:
        processor = build_processor(config, preprocess_map_kwargs=cpu, postprocess_map_kwargs=cpu)
    finally:
        if address:
            os.environ["RAY_ADDRESS"] = address
    use_rayline_engine_stage(processor, validator=dict(
        max_model_len=cfg.engine.max_model_len, sampling_defaults=cfg.sampling.as_params(), jsonl=jsonl,
        models=models,
    ), node_labels=cfg.node_labels)
    return processor


def run_pipeline(cfg: Config, fmt: str, model_path: str, info: eng.ModelInfo, adapters: list[Adapter] = (),
                 compared: list[tuple[str, eng.ModelInfo]] = ()) -> None:
    """Read (`fmt`: jsonl or parquet; each row once per model when the job answers with more than one) ->
    validate + engine -> results -> Parquet at output_uri (blocks until written). The base and its `adapters`
    share one engine pool; each `compared` model ((path, info)) gets a pool of its own, on its own copy of the
    rows, and the branches meet before the write."""
    tagged = bool(adapters or compared)
    branches = []
    for path, model, own in [(model_path, info, list(adapters))] + [(p, i, []) for p, i in compared]:
        models = {model.label: path, **{a.info.label: a.path for a in own}} if tagged else None
        ds = read_inputs(cfg, fmt, list(models) if models else None)
        ds = engine_processor(cfg, path, jsonl=fmt == "jsonl", models=models, adapters=own)(ds)
        branches.append(ds.map_batches(
            result_rows, fn_kwargs=dict(model_version=model.label, max_model_len=cfg.engine.max_model_len,
                                        metric_tags=metric_tags(cfg, model)),
            batch_format="pyarrow", num_cpus=cfg.cpu_stage_num_cpus,
        ))
    write_results(branches[0].union(*branches[1:]) if len(branches) > 1 else branches[0], cfg)


def write_results(ds: ray.data.Dataset, cfg: Config) -> None:
    """Result rows -> Parquet files under output_uri (local or s3://; blocks until written)."""
    fs, path = storage.resolve(cfg.output_uri)
    ds.write_parquet(path, filesystem=fs, ray_remote_args={"num_cpus": cfg.cpu_stage_num_cpus})


def read_results(output_uri: str):
    """The whole result table (every Parquet file under output_uri)."""
    fs, path = storage.resolve(output_uri)
    return pq.read_table(path, filesystem=fs)


def tally_results(output_uri: str, metrics: list[str], batch_rows: int = 65_536,
                  skip: frozenset[str] = frozenset(), by_model: bool = False):
    """Totals and scores of the results under output_uri (less the files named in `skip`, relative), read a
    batch of rows at a time and only the columns they need: the driver's memory stays flat however large
    the job. With `by_model`: (the whole job's Tally, {model_version: that model's rows' Tally})."""
    import pyarrow.compute as pc

    tally, per_model = batch_metrics.Tally(metrics), {}
    columns = tally.columns + ([MODEL_COLUMN] if by_model else [])
    for batch in result_batches(output_uri, columns, batch_rows, skip):
        tally.add(batch)
        for label in pc.unique(batch.column(MODEL_COLUMN)).to_pylist() if by_model else ():
            rows = batch.filter(pc.equal(batch.column(MODEL_COLUMN), label))
            per_model.setdefault(label, batch_metrics.Tally(metrics)).add(rows)
    return (tally, per_model) if by_model else tally


def resolve_adapters(cfg: Config, model_path: str, info: eng.ModelInfo) -> list[Adapter]:
    """cfg.adapters, each copied here and checked against the base before any engine starts."""
    return [resolve_adapter(ref, model_path, info, cfg.cache_dir, where=f"adapters[{i}]")
            for i, ref in enumerate(cfg.adapters)]


def resolve_compared(cfg: Config) -> list[tuple[str, eng.ModelInfo]]:
    """cfg.compare, each resolved to a local checkpoint whose context fits engine.max_model_len."""
    out = []
    for i, ref in enumerate(cfg.compare):
        path, info = eng.resolve_checkpoint(ref, cfg.cache_dir)
        if (Path(path) / "adapter_config.json").is_file():
            raise ValueError(f"compare[{i}]: {ref} is a LoRA adapter; list it under adapters (of its base)")
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"compare[{i}]: {ref}: no Hugging Face checkpoint (config.json) at {path}")
        eng.check_max_model_len(cfg.engine, path)
        out.append((path, info))
    return out


def check_distinct(cfg: Config, labels: list[str]) -> None:
    """Every model of the job is a different version: two references to one version would answer twice."""
    fields = ["engine.model"] + [f"adapters[{i}]" for i in range(len(cfg.adapters))] + \
        [f"compare[{i}]" for i in range(len(cfg.compare))]
    refs = [cfg.engine.model] + list(cfg.adapters) + list(cfg.compare)
    for i, label in enumerate(labels):
        first = labels.index(label)
        if first != i:
            raise ValueError(f"{fields[i]}: {refs[i]} is {label}, which {fields[first]} already answers with")


def main(cfg: Config, judge=None) -> Result:
    """Run the stage end to end (or, after a crash, its unfinished rows); print and return the summary."""
    started = time.perf_counter()
    model_path, info = eng.resolve_model(cfg.engine.model, cfg.cache_dir)
    eng.check_max_model_len(cfg.engine, model_path)
    adapters = resolve_adapters(cfg, model_path, info)
    compared = resolve_compared(cfg)
    fmt = input_format(cfg)
    labels = [info.label] + [a.info.label for a in adapters] + [i.label for _, i in compared]
    check_distinct(cfg, labels)
    resumed_rows = prepare_output(cfg, job_identity(cfg, fmt, ", ".join(labels)))
    earlier = frozenset(storage.list_files(cfg.output_uri)) if resumed_rows else frozenset()
    init_ray()
    meter = usage.StageUsage.start()
    planned = count_input_rows(cfg, fmt)
    if resumed_rows:
        print(f"batch_infer: resuming, {resumed_rows:,} of {planned:,} rows already written to {cfg.output_uri}; "
              f"answering the rest", flush=True)
    metrics.gauge("rayline_batch_rows_planned", planned, **metric_tags(cfg, info))
    with job_checkpoint(cfg), ResourceWatch("batch_infer", max_wait_s=cfg.max_wait_s):
        if cfg.progress_every_s:
            with ProgressReporter(cfg.output_uri, planned, cfg.progress_every_s):
                run_pipeline(cfg, fmt, model_path, info, adapters, compared)
        else:
            run_pipeline(cfg, fmt, model_path, info, adapters, compared)
    job_done(cfg)
    wall = time.perf_counter() - started

    several = len(labels) > 1
    tallies = tally_results(cfg.output_uri, cfg.metrics if cfg.mode == "eval" else [], by_model=several)
    tally, per_model = tallies if several else (tallies, {info.label: tallies})
    t = tally.totals()
    # Throughput is this run's: the rows it wrote (an earlier run's engines ran on other clocks).
    now = tally_results(cfg.output_uri, [], skip=earlier).totals() if earlier else t
    result = Result(
        output_uri=cfg.output_uri, model=info.label, rows=t.rows, errors=t.errors, error_codes=t.error_codes,
        prompt_tokens=t.prompt_tokens, output_tokens=t.output_tokens, wall_s=wall,
        output_tokens_per_s=now.output_tokens / wall,
        steady_output_tokens_per_s=(now.output_tokens / now.engine_busy_s) if now.engine_busy_s else None,
        resumed_rows=resumed_rows, usage=meter.totals(),
    )
    if cfg.mode != "eval":
        usage.record("batch", result.usage, None, model=info.name or "", version=info.version or "")
    else:
        job = {"resumed_rows": resumed_rows, "wall_s": wall, "output_tokens_per_s": result.output_tokens_per_s,
               **({"steady_output_tokens_per_s": result.steady_output_tokens_per_s} if now.engine_busy_s else {})}
        runs: dict[str, str] = {}
        models = [info] + [a.info for a in adapters] + [i for _, i in compared]
        for model in models:
            own = per_model.get(model.label) or batch_metrics.Tally(cfg.metrics)
            mt, scores = own.totals(), own.scores()
            counts = {"rows": mt.rows, "errors": mt.errors, "prompt_tokens": mt.prompt_tokens,
                      "output_tokens": mt.output_tokens, **job}
            run_id = record_eval(cfg, model, scores, counts, compared=labels if several else None)
            runs[model.label] = run_id
            record_eval_usage(result.usage.share(mt.rows / t.rows if t.rows else 1 / len(models)), model, run_id)
            if model is info:
                result.scores, result.eval_run_id = scores, run_id
            elif any(model is a.info for a in adapters):
                result.adapters[model.label], result.adapter_eval_run_ids[model.label] = scores, run_id
            else:
                result.compared[model.label], result.compared_eval_run_ids[model.label] = scores, run_id
        publish_reports(cfg, runs, {info.label: model_path, **{a.info.label: a.path for a in adapters},
                                    **{i.label: p for p, i in compared}}, models, per_model,
                        {a.info.label for a in adapters}, judge)
    print(summary(result, cfg, info))
    return result


def record_eval_usage(share: Usage, model: eng.ModelInfo, run_id: str) -> None:
    """A model's share of the job's usage on its eval run and, for a registered version, on the version (a tag for
    people: a role that may not write it leaves it off)."""
    usage.record("eval", share, run_id, model=model.name or "", version=model.version or "")
    if model.name and model.version:
        usage.tag_version(model.name, model.version, "eval", share)


def publish_reports(cfg: Config, runs: dict[str, str], sources: dict[str, str], models: list[eng.ModelInfo],
                    per_model: dict, adapters: set[str], judge=None) -> None:
    """Each registered model's promotion evidence (serve/batch/report.py): its report on its eval run, and tags.
    `judge(model, source, adapter)`, when given (the entry point passes serve/promotion/gate.py `judge_for`), says
    every reason the promotion gate would refuse the version now."""
    scores = {label: tally.scores() for label, tally in per_model.items()}
    for model in models:
        if not (model.name and model.version):
            continue
        rep = report.build_report(model, scores.get(model.label, {}), scores, cfg.output_uri, cfg.metrics)
        verdict = judge(model, sources[model.label], model.label in adapters) if judge else None
        tags = report.publish(rep, model, runs[model.label], verdict)
        print(f"batch_infer: {model.label}: eval report {tags[report.TAG_REPORT]}"
              + (f", vs {tags[report.TAG_COMPARED_WITH]}" if report.TAG_COMPARED_WITH in tags else "")
              + (f", gate {tags[report.TAG_GATE_VERDICT]}" if report.TAG_GATE_VERDICT in tags else ""), flush=True)


def summary(r: Result, cfg: Config, info: eng.ModelInfo) -> str:
    codes = ", ".join(f"{n} {c}" for c, n in sorted(r.error_codes.items()))
    steady = f"{r.steady_output_tokens_per_s:,.1f} output tok/s steady state" if r.steady_output_tokens_per_s else "n/a"
    lines = [
        f"batch_infer ({cfg.mode}) done: {r.rows} rows, {r.rows - r.errors} answered, {r.errors} errors"
        + (f" ({codes})" if codes else "") + (f"; {r.resumed_rows} of them by the interrupted run" if r.resumed_rows else ""),
        f"  tokens:     {r.prompt_tokens:,} prompt, {r.output_tokens:,} output",
        f"  throughput: {r.output_tokens_per_s:,.1f} output tok/s end to end ({r.wall_s:,.1f} s wall); {steady}",
        f"  model:      {info.label}" + (f" ({info.ref})" if info.ref != info.label else ""),
        f"  output:     {r.output_uri}",
    ]
    if r.adapters:
        lines[3] += f" and {len(r.adapters)} adapter(s): {', '.join(r.adapters)}; each answered every row"
    if cfg.compare:
        lines[3] += f"; compared with {', '.join(i for i in r.compared) or ', '.join(cfg.compare)} (an engine pool each)"
    if r.scores:
        scored = ", ".join(f"{m} {r.scores[m]:.4f}" for m in cfg.metrics)
        where = f"tags {EVAL_TAG_PREFIX}* on {info.label}" if info.name else "no version tags (not a registry model)"
        lines.append(f"  eval:       {scored} over {int(r.scores['scored_rows'])} rows; MLflow run {r.eval_run_id}, {where}")
        for label, scores in {**r.adapters, **r.compared}.items():
            scored = ", ".join(f"{m} {scores[m]:.4f}" for m in cfg.metrics)
            run_id = r.adapter_eval_run_ids.get(label) or r.compared_eval_run_ids[label]
            lines.append(f"    {label}: {scored}; MLflow run {run_id}, tags {EVAL_TAG_PREFIX}* on it")
    return "\n".join(lines)
