"""Batch inference / eval stage: unit tests of placement and storage ends, then one real run (row rules:
test_batch_rows.py).

The real run (module-scoped, the vLLM engine starts once) goes through the real Ray head of the test stack
with real vLLM on CPU and the real MLflow server: the model is registered and addressed as
`models:/<name>@candidate`, and the input mixes eval-split records with bad rows of every kind.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pyarrow as pa
import pytest

from core import registry
from core.config import ConfigError, from_dict, load_config, to_dict
from serve.online import engine as eng
from serve.batch import metrics, rows
from serve.batch.config import Config
from serve.batch.tracking import EVAL_TAG_PREFIX, TAG_MODEL_NAME, TAG_MODEL_VERSION

N_GOOD = 20
CPU_ENGINE = {
    "accelerator": "cpu", "max_model_len": 256, "max_num_seqs": 16, "dtype": "float32", "enforce_eager": True,
    "kv_cache_memory_bytes": 64 * eng.MiB, "cpus_per_engine": 1.0,
}


# ---- engine config -> placement (no engine) ----

def test_cpu_engine_asks_for_no_gpu_and_an_explicit_kv_cache():
    cfg = from_dict(eng.EngineConfig, {"model": "/m", **CPU_ENGINE, "cpus_per_engine": 0.5})
    assert eng.placement_group_config(cfg) == {"bundles": [{"CPU": 0.5}], "strategy": "PACK"}
    kwargs = eng.vllm_engine_kwargs(cfg)
    assert kwargs["kv_cache_memory_bytes"] == 64 * eng.MiB and "gpu_memory_utilization" not in kwargs
    assert "model" not in kwargs and cfg.accelerator_type is None
    env = eng.runtime_env(cfg)["env_vars"]
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == "1"


def test_gpu_config_renders_strict_pack_tensor_parallel_placement():
    cfg = load_config(Config, "configs/batch/gpu_example.yaml")
    e = cfg.engine
    assert eng.placement_group_config(e) == {
        "bundles": [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}], "strategy": "STRICT_PACK",
    }
    assert e.accelerator_type == "L4"
    kwargs = eng.vllm_engine_kwargs(e)
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["gpu_memory_utilization"] == 0.9
    assert "kv_cache_memory_bytes" not in kwargs


@pytest.mark.parametrize("name", ["eval_tiny", "infer_tiny"])
def test_cpu_configs_fit_two_cores(name):
    cfg = load_config(Config, f"configs/batch/{name}.yaml")
    # The engine pool holds its CPUs for the whole run; at least two 0.25-CPU task slots must stay free for
    # read/map/write tasks, or the pipeline waits forever on a 2-core node.
    held = cfg.engine.cpus_per_engine * cfg.num_engines
    assert held + 2 * cfg.cpu_stage_num_cpus <= 2
    assert cfg.batch_size * cfg.max_concurrent_batches >= cfg.engine.max_num_seqs


def test_reads_give_every_engine_batch_slot_blocks_and_large_inputs_ray_data_s_own_count():
    from serve.batch.inputs import read_blocks

    cfg = from_dict(Config, {"input_uri": "p.jsonl", "output_uri": "out", "engine": {"model": "m"},
                             "num_engines": 2, "max_concurrent_batches": 6})
    # A 100 KB prompt file would be 4 blocks by Ray Data's default, and the first engine up would take them all.
    assert read_blocks(cfg, 100_000) == 2 * 2 * 6
    assert read_blocks(cfg, 50 * eng.MiB) == 50 and read_blocks(cfg, 50 * 1024 * eng.MiB) == 200


def test_unset_max_concurrent_batches_keeps_four_times_max_num_seqs_rows_in_flight():
    def batches(**fields):
        base = {"input_uri": "p.jsonl", "output_uri": "out", "engine": {"model": "m", "max_num_seqs": 128}}
        return from_dict(Config, {**base, **fields}).max_concurrent_batches

    assert batches(batch_size=32) == 16
    assert batches(batch_size=48) == 11  # rounded up: never fewer rows in flight than 4 x max_num_seqs
    assert batches(batch_size=32, max_concurrent_batches=3) == 3  # said outright, kept


def test_demo_eval_fits_beside_the_serve_app():
    """A second `make demo` evaluates while the first one's Serve app (configs/serve/tiny_cpu.yaml) serves."""
    from serve.online.serve_config import Config as ServeConfig

    cfg = load_config(Config, "configs/batch/eval_tiny.yaml")
    app = load_config(ServeConfig, "configs/serve/tiny_cpu.yaml")
    serving = app.engine.cpus_per_engine * app.autoscaling.max_replicas + app.ingress_cpus * app.ingress_replicas
    held = cfg.engine.cpus_per_engine * cfg.num_engines
    assert serving + held + cfg.cpu_stage_num_cpus <= 2, (serving, held)


@pytest.mark.parametrize("override, field", [
    (["engine.accelerator_type=H100"], "engine.accelerator_type"),
    (["engine.kv_cache_memory_bytes=0"], "engine.kv_cache_memory_bytes"),
    (["engine.tensor_parallel_size=2"], "engine.tensor_parallel_size"),
    # config._build skips the "engine." prefix when the message starts with "engine" (engine_kwargs...)
    (["engine.engine_kwargs={max_num_seqs: 4}"], "engine_kwargs.max_num_seqs"),
    (["sampling.temperature=-1"], "sampling.temperature"),
    (["metrics=[bleu]"], "metrics"),
    (["max_concurrent_batches=0"], "max_concurrent_batches"),
    (["node_labels={rayline.io/node: '!in(a,'}"], "node_labels.rayline.io/node"),
])
def test_config_errors_name_the_field(override, field):
    with pytest.raises(ConfigError, match=r"configs/batch/eval_tiny\.yaml: (engine\.)?" + re.escape(field)):
        load_config(Config, "configs/batch/eval_tiny.yaml", override)


@pytest.mark.slow  # Ray Data on the test stack's Ray, Swift's S3 API
def test_s3_input_model_and_output_go_through_the_shared_storage(ray_session, s3_bucket, tiny_model_dir, tmp_path):
    """The stage's S3 ends without an engine: prompts read from an s3:// prefix, an s3:// checkpoint copied for
    vLLM, result Parquet written to and read back from s3://, an existing output refused unless overwritten."""
    import pyarrow.parquet as pq
    import ray.data

    from core import storage
    from serve.batch.inputs import input_format, read_inputs
    from serve.batch.pipeline import read_results, write_results
    from serve.batch.resume import checkpoint_uri, prepare_output

    root = f"{s3_bucket}/batch-tests/{uuid.uuid4().hex[:8]}"
    lines = [json.dumps({"id": f"r{i}", "prompt": f"What is {i} + 1?"}) for i in range(5)]
    (tmp_path / "in").mkdir()
    # Saved as Windows tools save UTF-8: a byte-order mark first, which must not spoil the first record.
    (tmp_path / "in" / "prompts.jsonl").write_bytes(b"\xef\xbb\xbf" + ("\r\n".join(lines) + "\r\n").encode())
    storage.copy_tree(str(tmp_path / "in"), f"{root}/in")
    storage.copy_tree(str(tiny_model_dir), f"{root}/model")
    cfg = from_dict(Config, {"input_uri": f"{root}/in", "output_uri": f"{root}/out", "engine": {"model": f"{root}/model"}})

    assert input_format(cfg) == "jsonl"
    read = sorted((r["source"], r["text"]) for r in read_inputs(cfg, "jsonl").take_all())
    assert read == [(f"prompts.jsonl:{i + 1}", line) for i, line in enumerate(lines)]
    local, info = eng.resolve_model(cfg.engine.model, tmp_path / "cache")
    assert info.uri == f"{root}/model" and (tmp_path / "cache") in Path(local).parents
    assert json.loads(open(f"{local}/config.json").read()) == json.loads((tiny_model_dir / "config.json").read_text())

    results = [{**{k: None for k in rows.RESULT_SCHEMA.names}, "id": f"r{i}", "prompt": "p", "output": str(i),
                "prompt_tokens": 3, "output_tokens": 1, "model_version": "m/1"} for i in range(5)]
    write_results(ray.data.from_arrow(pa.Table.from_pylist(results, schema=rows.RESULT_SCHEMA)), cfg)
    table = read_results(cfg.output_uri)
    assert sorted(table.column("output").to_pylist()) == ["0", "1", "2", "3", "4"]
    with pytest.raises(FileExistsError, match=f"output_uri {root}/out: already holds results of a finished run"):
        prepare_output(cfg)
    # An interrupted run's record beside the output: the same config resumes, keeping what was written.
    assert checkpoint_uri(cfg) == f"{root}/out.checkpoint"
    for name, n in (("done", 3), ("half-written.pending", 2)):  # rows of committed and pending record files
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({"source": [f"prompts.jsonl:{i}" for i in range(n)]}), sink)
        storage.write_bytes(f"{checkpoint_uri(cfg)}/{name}.parquet", sink.getvalue().to_pybytes())
    assert prepare_output(cfg) == 3 and prepare_output(from_dict(Config, {**to_dict(cfg), "overwrite": True})) == 3
    assert storage.list_files(cfg.output_uri)
    # Not resumable: the record is stale, and with overwrite both go.
    prepare_output(from_dict(Config, {**to_dict(cfg), "overwrite": True, "resumable": False}))
    for uri in (cfg.output_uri, checkpoint_uri(cfg)):
        assert not storage.exists(uri) or not storage.list_files(uri)


def test_max_model_len_beyond_the_checkpoint_is_refused_before_any_engine(tiny_model_dir):
    with pytest.raises(ValueError, match="engine.max_model_len: 4096 is more than the model's context"):
        eng.check_max_model_len(from_dict(eng.EngineConfig, {"model": "m", "max_model_len": 4096}), str(tiny_model_dir))


# ---- one real run: Ray + vLLM on CPU + MLflow ----
# The timeout is generous because on a loaded 2-core machine the vLLM engine alone can take minutes to
# start; a placement deadlock would hang forever, so finishing inside it is the no-deadlock check.

BAD_ROWS = {
    "bad-missing": ({"id": "bad-missing", "task": "none"}, "missing_prompt"),
    "bad-long": ({"id": "bad-long", "prompt": "apple kiwi lemon " * 200}, "prompt_too_long"),
    "bad-max-tokens": ({"id": "bad-max-tokens", "prompt": "What is 1 + 1?", "sampling_params": {"max_tokens": -3}},
                       "invalid_sampling_params"),
    "bad-temperature": ({"id": "bad-temperature", "messages": [{"role": "user", "content": "Is 3 even or odd?"}],
                         "sampling_params": {"temperature": -1.0}}, "invalid_sampling_params"),
}


@pytest.fixture(scope="module")
def registered(local_stack, tiny_model_dir):
    name = f"batch-tiny-{uuid.uuid4().hex[:8]}"
    with registry.start_run("rayline-test-batch", "register", tags=registry.lineage_tags("test")) as run:
        mv = registry.register_checkpoint(name, str(tiny_model_dir), run_id=run.info.run_id,
                                          tags={registry.TAG_DATASET_VERSION: "ds-test"})
    registry.set_alias(name, "candidate", mv.version)
    return name, str(mv.version)


@pytest.fixture(scope="module")
def input_file(tmp_path_factory, sample_corpus_dir):
    good = [json.loads(line) for line in (sample_corpus_dir / "eval.jsonl").read_text().splitlines()[:N_GOOD]]
    extra = [
        {"id": "plain", "prompt": "What is 2 + 2?"},
        {"id": "exact-2", "messages": [{"role": "user", "content": "Repeat exactly: kiwi"}],
         "sampling_params": {"max_tokens": 2, "ignore_eos": True}},
    ]
    lines = [json.dumps(r) for r in good + extra + [r for r, _ in BAD_ROWS.values()]] + ['{"id": "bad-json", ']
    path = tmp_path_factory.mktemp("batch-input") / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, [r["id"] for r in good + extra] + list(BAD_ROWS)


@pytest.fixture(scope="module")
def run(local_stack, registered, input_file, tmp_path_factory):
    from core.ray_cluster import init_ray
    from serve.batch.pipeline import main, read_results

    name, _ = registered
    cfg = from_dict(Config, {
        "mode": "eval", "input_uri": str(input_file[0]), "output_uri": str(tmp_path_factory.mktemp("batch-out") / "r"),
        "metrics": ["exact_match", "contains"], "sampling": {"max_tokens": 8, "temperature": 0.0},
        "engine": {"model": f"models:/{name}@candidate", **CPU_ENGINE},
        "batch_size": 8, "max_concurrent_batches": 2, "cpu_stage_num_cpus": 0.25,
        "mlflow_experiment": "rayline-test-batch", "dataset_name": "sample-corpus-eval",
    })
    init_ray()
    try:
        result = main(cfg)
    finally:
        import ray

        ray.shutdown()
    table = read_results(cfg.output_uri)
    return cfg, result, {r["id"]: r for r in table.to_pylist()}, table


@pytest.mark.slow
def test_rows_and_errors_by_code_reach_prometheus(run, local_stack):
    """The result tasks' counts, scraped by the stack's Prometheus, add up to the result table."""
    import time

    from core import prometheus_query
    from stack.lifecycle import env_vars
    from serve.batch.inputs import count_input_rows

    cfg, result, _, table = run
    assert count_input_rows(cfg, "jsonl") == table.num_rows  # what the job planned is what it wrote
    url = env_vars(local_stack)["RAYLINE_PROMETHEUS_URL"]
    tags = f'run="r", model="{result.model}", mode="eval"'
    want = {"done": float(table.num_rows), "errors": {c: float(n) for c, n in result.error_codes.items()}}
    deadline = time.time() + 60
    while True:
        done = prometheus_query.query(url, f"sum(ray_rayline_batch_rows_done_total{{{tags}}})")
        errors = prometheus_query.query(url, f"sum by (code) (ray_rayline_batch_row_errors_total{{{tags}}})")
        got = {"done": float(done[0]["value"][1]) if done else 0.0,
               "errors": {e["metric"]["code"]: float(e["value"][1]) for e in errors}}
        if got == want or time.time() > deadline:
            break
        time.sleep(2)
    assert got == want and len(want["errors"]) >= 2


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_row_appears_once_with_output_or_error(run, input_file):
    _, result, by_id, table = run
    ids = table.column("id").to_pylist()
    expected = input_file[1]
    assert len(ids) == len(set(ids)) == len(expected) + 1  # + the unparseable line, under a content-hash id
    # Each row says which input line it answers: every line once, and the job's checkpoint is gone.
    assert sorted(table.column("source").to_pylist()) == sorted(f"prompts.jsonl:{i + 1}" for i in range(len(ids)))
    unparseable = [r for r in by_id.values() if (r["error"] or "").startswith("invalid_record: not valid JSON")]
    assert [r["source"] for r in unparseable] == [f"prompts.jsonl:{len(ids)}"]  # the input's last line
    assert not Path(str(run[0].output_uri) + ".checkpoint").exists()
    assert set(expected) <= set(ids)
    assert result.rows == table.num_rows and result.errors == len(BAD_ROWS) + 1
    for rid in expected:
        row = by_id[rid]
        if rid in BAD_ROWS:
            continue
        assert row["error"] is None and row["output"] is not None, row
        assert row["output_tokens"] > 0 and row["prompt_tokens"] > 0
        assert row["finish_reason"] in ("stop", "length")
    assert by_id["exact-2"]["output_tokens"] == 2 and by_id["exact-2"]["finish_reason"] == "length"
    assert result.output_tokens == sum(r["output_tokens"] for r in by_id.values()) > 0


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_bad_rows_carry_the_reason_and_never_reach_the_engine(run):
    _, result, by_id, _ = run
    for rid, (_, code) in BAD_ROWS.items():
        row = by_id[rid]
        assert row["error"].startswith(f"{code}: "), row
        assert row["output"] is None and row["output_tokens"] == 0 and row["engine_start_s"] is None
    assert "max_tokens" in by_id["bad-max-tokens"]["error"] and "temperature" in by_id["bad-temperature"]["error"]
    assert "max_model_len is 256" in by_id["bad-long"]["error"]
    (bad_json,) = [r for rid, r in by_id.items() if rid.startswith("sha1:")]
    assert bad_json["error"].startswith("invalid_record: not valid JSON")
    assert result.error_codes == {"missing_prompt": 1, "prompt_too_long": 1, "invalid_sampling_params": 2,
                                  "invalid_record": 1}


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_models_alias_resolves_to_the_registered_version(run, registered):
    _, result, by_id, _ = run
    name, version = registered
    assert result.model == f"{name}/{version}"
    assert {r["model_version"] for r in by_id.values()} == {f"{name}/{version}"}


def has_run(words: list[str], run: list[str]) -> bool:
    """`run` appears in `words` as consecutive whole words."""
    return any(words[i:i + len(run)] == run for i in range(len(words) - len(run) + 1))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_eval_metrics_come_from_the_outputs_and_land_on_the_model_version(run, registered):
    cfg, result, by_id, _ = run
    name, version = registered
    # Recompute from the written Parquet with an independent normaliser.
    scored = [r for r in by_id.values() if r["reference"] is not None]
    assert len(scored) == N_GOOD  # the eval records' trailing assistant messages; no other row has a reference
    words = lambda s: (s or "").lower().split()  # noqa: E731
    expected = sum(r["output"] is not None and words(r["output"]) == words(r["reference"]) for r in scored) / len(scored)
    expected_contains = sum(r["output"] is not None and has_run(words(r["output"]), words(r["reference"]))
                            for r in scored) / len(scored)
    assert result.scores["exact_match"] == pytest.approx(expected)
    assert result.scores["contains"] == pytest.approx(expected_contains)
    # The tiny model rarely says the reference, so the scorer must also find one where it is there: references
    # cut from the real outputs (their last words: contained, not exact) and ones no output holds.
    answered = [r["output"] for r in by_id.values() if len(words(r["output"])) >= 2]
    cut = [" ".join(words(o)[1:]) for o in answered] + [o + " zebra-not-said" for o in answered]
    probe = pa.table({"output": answered * 2, "reference": cut, "task": [None] * len(cut)})
    assert metrics.score(probe, ["exact_match", "contains"]) == {"scored_rows": len(cut), "exact_match": 0.0, "contains": 0.5}

    c = registry.client()
    mv = c.get_model_version(name, version)
    assert float(mv.tags[f"{EVAL_TAG_PREFIX}exact_match"]) == pytest.approx(expected, abs=1e-4)
    assert float(mv.tags[f"{EVAL_TAG_PREFIX}contains"]) == pytest.approx(expected_contains, abs=1e-4)
    assert mv.tags[f"{EVAL_TAG_PREFIX}run_id"] == result.eval_run_id
    assert mv.tags[f"{EVAL_TAG_PREFIX}dataset"] == "sample-corpus-eval"
    eval_run = c.get_run(result.eval_run_id)
    assert eval_run.data.metrics["exact_match"] == pytest.approx(expected)
    assert eval_run.data.metrics["contains"] == pytest.approx(expected_contains)
    assert eval_run.data.metrics["rows"] == result.rows
    assert eval_run.data.tags[TAG_MODEL_NAME] == name and eval_run.data.tags[TAG_MODEL_VERSION] == version
    assert eval_run.data.tags[registry.TAG_DATASET_VERSION] == "ds-test"
    assert eval_run.data.tags[registry.TAG_STAGE] == "batch_infer"
    # What the job used (one model: all of it) on its eval run and on the version; the engine's processes (the
    # actor and vLLM's engine core under it) start vLLM and answer every row: far more than the driver.
    used = result.usage
    assert eval_run.data.metrics["usage/cpu_s"] == pytest.approx(used.cpu_s)
    assert used.cpu_s - used.driver_cpu_s > 5.0 and used.processes >= 3, used
    assert mv.tags["rayline.usage.eval_cpu_s"] == f"{used.cpu_s:.1f}"  # tags hold tenths
    assert mv.tags["rayline.usage.total_cpu_s"] == mv.tags["rayline.usage.eval_cpu_s"]


@pytest.mark.slow  # imports vLLM through ray.data.llm; builds the plan on the test stack's Ray, runs nothing
def test_engine_stage_is_rayline_s_udf_with_ray_s_cpu_placement(ray_session, tiny_model_dir):
    from serve.batch.engine_stage import EngineStageUDF
    from serve.batch.pipeline import engine_processor

    cfg = from_dict(Config, {"input_uri": "p.jsonl", "output_uri": "out", "num_engines": 1,
                             "engine": {"model": str(tiny_model_dir), **CPU_ENGINE, "cpus_per_engine": 0.5}})
    stage = engine_processor(cfg, str(tiny_model_dir)).get_stage_by_name("vLLMEngineStage")
    kwargs = stage.get_dataset_map_batches_kwargs(batch_size=cfg.batch_size, data_column="__data")
    assert stage.fn is EngineStageUDF
    # Swapping the UDF must keep what Ray derived from the placement group: half a CPU and no GPU.
    assert kwargs["num_cpus"] == 0.5 and not kwargs.get("num_gpus"), kwargs
    assert kwargs["runtime_env"]["env_vars"][eng.ENGINE_CORE_START_ENV] == "fork"  # the actor forks EngineCore


@pytest.mark.slow  # imports vLLM
def test_engine_stage_requests_ask_vllm_for_the_final_output_only(tiny_model_dir):
    import asyncio

    from ray.llm._internal.batch.stages.vllm_engine_stage import vLLMEngineWrapper, vLLMTaskType
    from vllm.sampling_params import RequestOutputKind

    from serve.batch.engine_stage import final_outputs_only

    validator = rows.PromptValidator(str(tiny_model_dir), 256, {"max_tokens": 5}, jsonl=True)
    ok, refused = final_outputs_only(validator.requests([{"text": json.dumps({"prompt": "hi"})}, {"text": "{"}]))
    # Ray's own request preparation, without an engine behind it (it only reads these attributes).
    wrapper = object.__new__(vLLMEngineWrapper)
    wrapper.request_id, wrapper.task_type, wrapper.model = 0, vLLMTaskType.GENERATE, "m"
    wrapper.idx_in_batch_column = "__idx_in_batch"
    request = asyncio.run(wrapper._prepare_llm_request({**ok, "__idx_in_batch": 0}))
    assert request.params.output_kind == RequestOutputKind.FINAL_ONLY and request.params.max_tokens == 5
    assert "output_kind" not in refused["sampling_params"]  # a refused row never reaches vLLM
