"""The batch stage evaluates a base, several LoRA adapters of it and another full model in one job (issue 18): the
base and its adapters on one engine pool, the full model (`compare`) on a pool of its own, every prompt answered by
every model, each model's eval tags on its own version.

Adapters are written by peft on the tiny model and registered as versions of their own, each tagged with the base
version it belongs to. One is all zeros (peft's own initialisation: it must answer exactly as the base); two have
random weights (they must answer differently, and as peft answers with the same adapter). The full model is the
base with adapter `a` merged into its weights by peft: it must answer as `a` does.
"""

from __future__ import annotations

import json
import re
import uuid

import pyarrow as pa
import pytest
import yaml

from core import registry
from core.config import ConfigError, from_dict
from serve.online.adapter_check import ADAPTER_WEIGHTS
from serve.online.adapters import AdapterError, lora_engine_kwargs
from serve.batch.config import Config
from serve.batch.inputs import per_model
from serve.batch.tracking import EVAL_TAG_PREFIX, TAG_COMPARED
from tests.serve.lora_adapters import write_adapter
from tests.serve.test_batch_infer import CPU_ENGINE

N_ROWS = 12
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def models(local_stack, tiny_model_dir, tmp_path_factory):
    """The tiny model registered as the base, three adapters registered as versions 1-3 of `<base>-lora`, and the base
    with adapter `a` merged in, registered as `<base>-merged` (a full model: `compare`)."""
    base = f"batch-lora-{uuid.uuid4().hex[:8]}"
    root = tmp_path_factory.mktemp("adapters")
    with registry.start_run("rayline-test-batch", "register", tags=registry.lineage_tags("test")) as run:
        bv = registry.register_checkpoint(base, str(tiny_model_dir), run_id=run.info.run_id)
        base_ref = f"models:/{base}/{bv.version}"
        dirs = {"zero": None, "a": 1, "b": 2}
        for kind, seed in dirs.items():
            dirs[kind] = write_adapter(tiny_model_dir, root / kind, seed)
            registry.register_checkpoint(f"{base}-lora", str(dirs[kind]), run_id=run.info.run_id, tags={
                registry.TAG_BASE_MODEL: base_ref, registry.TAG_ADAPTER: "lora", registry.TAG_LORA_RANK: "4"})
        merged = merge_adapter(tiny_model_dir, dirs["a"], root / "merged")
        mv = registry.register_checkpoint(f"{base}-merged", str(merged), run_id=run.info.run_id)
    return base_ref, {kind: (f"models:/{base}-lora/{i + 1}", path) for i, (kind, path) in enumerate(dirs.items())}, \
        (f"models:/{base}-merged/{mv.version}", merged)


def merge_adapter(base_dir, adapter_dir, out):
    """The base with the adapter folded into its weights (peft's merge_and_unload), saved as a full checkpoint."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(adapter_dir))
    model.merge_and_unload().save_pretrained(out)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def prompts(sample_corpus_dir, tmp_path_factory):
    rows = [json.loads(line) for line in (sample_corpus_dir / "eval.jsonl").read_text().splitlines()[:N_ROWS]]
    path = tmp_path_factory.mktemp("lora-input") / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows + [{"id": "bad", "task": "none"}]) + "\n")
    return path


def job(models, prompts, output_uri: str, adapters: list[str], compare: list[str] = ()) -> Config:
    base_ref = models[0]
    # Two engine pools (the base's, the compared model's) beside the test session's Serve app on 2 CPUs.
    engine = {"model": base_ref, **CPU_ENGINE, **({"cpus_per_engine": 0.5} if compare else {})}
    return from_dict(Config, {
        "mode": "eval", "input_uri": str(prompts), "output_uri": output_uri, "adapters": adapters,
        "compare": list(compare), "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0}, "engine": engine,
        "batch_size": 8, "max_concurrent_batches": 2, "mlflow_experiment": "rayline-test-batch",
    })


@pytest.fixture(scope="module")
def run(models, prompts, tmp_path_factory):
    from core.ray_cluster import init_ray
    from serve.batch.pipeline import main, read_results
    from serve.promotion.gate import judge_for

    adapters = [ref for ref, _ in models[1].values()]
    out = tmp_path_factory.mktemp("lora-out")
    (out / "gate.yaml").write_text(yaml.safe_dump({"gate": {"min_metrics": {"eval.exact_match": 0.5},
                                                            "eval_experiment": "rayline-test-batch"}}))
    cfg = job(models, prompts, str(out / "r"), adapters, [models[2][0]])
    cfg.gate_config = str(out / "gate.yaml")
    init_ray()
    try:
        result = main(cfg, judge_for(cfg.gate_config))
    finally:
        import ray

        ray.shutdown()
    return cfg, result, read_results(cfg.output_uri).to_pylist()


def labels(models) -> dict[str, str]:
    """kind ("base", "zero", "a", "b", "merged") -> the model_version label its rows carry (`name/N`)."""
    base_ref, adapters, (merged_ref, _) = models
    return {"base": base_ref.removeprefix("models:/"), **{k: ref.removeprefix("models:/") for k, (ref, _) in adapters.items()},
            "merged": merged_ref.removeprefix("models:/")}


# ---- no engine ----

def test_each_row_is_read_once_per_model_with_a_source_of_its_own():
    block = pa.table({"source": ["p.jsonl:1", "p.jsonl:2"], "text": ["x", "y"]})
    out = per_model(block, ["m/1", "a/2"])
    assert out.column("source").to_pylist() == ["p.jsonl:1@m/1", "p.jsonl:2@m/1", "p.jsonl:1@a/2", "p.jsonl:2@a/2"]
    assert out.column("model_version").to_pylist() == ["m/1", "m/1", "a/2", "a/2"]
    assert out.column("text").to_pylist() == ["x", "y", "x", "y"]


@pytest.mark.parametrize("adapters, field", [(["models:/x/1", "models:/x/1"], "adapters[1]"),
                                             (["models:/base/1"], "adapters[0]"), ([""], "adapters[0]")])
def test_adapter_list_errors_name_the_entry(adapters, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        from_dict(Config, {"input_uri": "p.jsonl", "output_uri": "out", "engine": {"model": "models:/base/1"},
                           "adapters": adapters})


@pytest.mark.parametrize("compare, field", [(["models:/x/1", "models:/x/1"], "compare[1]"), (["models:/base/1"], "compare[0]"),
                                            (["models:/a/1"], "compare[0]"), ([" "], "compare[0]")])
def test_compare_list_errors_name_the_entry(compare, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        from_dict(Config, {"input_uri": "p.jsonl", "output_uri": "out", "engine": {"model": "models:/base/1"},
                           "adapters": ["models:/a/1"], "compare": compare})


def test_engines_get_the_smallest_rank_vllm_takes_and_room_for_every_adapter():
    from serve.online.adapters import Adapter

    adapters = [Adapter(path="/a", info=None, rank=4), Adapter(path="/b", info=None, rank=12)]
    assert lora_engine_kwargs(adapters) == {"enable_lora": True, "max_lora_rank": 16, "max_loras": 2,
                                            "max_cpu_loras": 2}
    assert lora_engine_kwargs([]) == {}


def test_an_adapter_of_another_base_version_is_refused_before_any_engine(models, prompts, tmp_path, tiny_model_dir):
    from serve.batch.pipeline import main

    base_ref, adapters, _ = models
    name = base_ref.removeprefix("models:/").rsplit("/", 1)[0]
    with registry.start_run("rayline-test-batch", "register", tags=registry.lineage_tags("test")) as run:
        other = registry.register_checkpoint(f"{name}-lora", str(adapters["a"][1]), run_id=run.info.run_id,
                                             tags={registry.TAG_BASE_MODEL: f"models:/{name}/99"})
    with pytest.raises(AdapterError, match=rf"adapters\[0\]: {name}-lora/{other.version} was trained on "
                                           rf"models:/{name}/99, but the base here is {name}/1"):
        main(job(models, prompts, str(tmp_path / "out"), [f"models:/{name}-lora/{other.version}"]))
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in adapters["a"][1].iterdir():
        if f.name != ADAPTER_WEIGHTS:
            (broken / f.name).write_bytes(f.read_bytes())
    with pytest.raises(AdapterError, match=rf"adapters\[1\]: {broken} does not fit the base .*{ADAPTER_WEIGHTS} is missing"):
        main(job(models, prompts, str(tmp_path / "out"), [adapters["a"][0], str(broken)]))
    with pytest.raises(AdapterError, match=r"adapters\[0\]: .* is not a PEFT adapter .*it is a full model"):
        main(job(models, prompts, str(tmp_path / "out"), [str(tiny_model_dir)]))
    with pytest.raises(ValueError, match=r"compare\[0\]: .* is a LoRA adapter; list it under adapters"):
        main(job(models, prompts, str(tmp_path / "out"), [], [adapters["a"][0]]))
    registry.set_alias(name, "same", "1")  # another reference to the base's own version
    with pytest.raises(ValueError, match=rf"compare\[0\]: models:/{name}@same is {name}/1, which engine.model already"):
        main(job(models, prompts, str(tmp_path / "out"), [], [f"models:/{name}@same"]))
    assert not (tmp_path / "out").exists()  # refused before the job wrote anything


# ---- one job: the base, three adapters and a full model ----

@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_prompt_is_answered_once_by_every_model(run, models):
    cfg, result, rows = run
    by_kind = labels(models)
    assert sorted((r["source"], r["model_version"]) for r in rows) == sorted(
        (f"prompts.jsonl:{i}@{label}", label) for i in range(1, N_ROWS + 2) for label in by_kind.values())
    assert result.rows == 5 * (N_ROWS + 1) and result.errors == 5 and result.error_codes == {"missing_prompt": 5}
    from serve.batch.inputs import count_input_rows

    assert count_input_rows(cfg, "jsonl") == result.rows  # what the job planned (its progress, its ETA) it wrote
    assert all(r["output"] is not None for r in rows if r["id"] != "bad")


def outputs(rows, label) -> dict[str, str]:
    return {r["id"]: r["output"] for r in rows if r["model_version"] == label and r["id"] != "bad"}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_each_row_is_answered_by_the_adapter_it_names(run, models, tiny_model_dir):
    """The zero adapter answers as the base; the random ones answer otherwise, and as peft does with them."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, _, rows = run
    by_kind = {k: outputs(rows, label) for k, label in labels(models).items()}
    assert by_kind["zero"] == by_kind["base"]
    for kind in ("a", "b"):
        differ = sum(by_kind[kind][i] != by_kind["base"][i] for i in by_kind["base"])
        assert differ >= N_ROWS // 2, (kind, differ)
    assert sum(by_kind["a"][i] != by_kind["b"][i] for i in by_kind["a"]) >= N_ROWS // 2
    # The merged full model, on its own engine pool, answers as adapter a does on the base's pool (float rounding
    # between a merged weight and base + LoRA may flip a near-tie; most rows must agree).
    assert sum(by_kind["merged"][i] == by_kind["a"][i] for i in by_kind["a"]) >= N_ROWS * 3 // 4, by_kind

    # peft on the same prompt, greedy: what adapter a must have said on the first rows.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(models[1]["a"][1]))
    prompts = {r["id"]: r["prompt"] for r in rows if r["model_version"] == labels(models)["a"] and r["id"] != "bad"}
    agree = 0
    for rid in sorted(prompts)[:4]:
        ids = tokenizer(prompts[rid], add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        agree += tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == by_kind["a"][rid]
    assert agree >= 3, agree


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_each_model_s_scores_land_on_its_own_version(run, models):
    from serve.batch.metrics import exact_match

    cfg, result, rows = run
    c = registry.client()
    by_kind = labels(models)
    run_ids = set()
    for kind, label in by_kind.items():
        scored = [r for r in rows if r["model_version"] == label and r["reference"] is not None]
        assert len(scored) == N_ROWS
        expected = sum(exact_match(r["output"], r["reference"]) for r in scored) / N_ROWS
        got = {"base": result.scores, "merged": result.compared.get(label)}.get(kind) or result.adapters[label]
        assert got["exact_match"] == pytest.approx(expected) and got["scored_rows"] == N_ROWS
        name, version = label.rsplit("/", 1)
        tags = c.get_model_version(name, version).tags
        assert float(tags[f"{EVAL_TAG_PREFIX}exact_match"]) == pytest.approx(expected, abs=1e-4)
        run_id = tags[f"{EVAL_TAG_PREFIX}run_id"]
        assert run_id == {"base": result.eval_run_id, "merged": result.compared_eval_run_ids.get(label)}.get(
            kind, result.adapter_eval_run_ids.get(label))
        eval_run = c.get_run(run_id)
        assert eval_run.data.tags[TAG_COMPARED] == ", ".join(by_kind.values())
        assert eval_run.data.metrics["rows"] == N_ROWS + 1 and eval_run.data.metrics["errors"] == 1
        run_ids.add(run_id)
    assert len(run_ids) == 5


def test_each_version_page_gets_its_eval_report_and_the_gate_verdict(run, models):
    """Promotion evidence: each adapter measured against its base on the same rows (the examples where they differ),
    the merged model (no champion, no base tag) reported alone; the gate (eval.exact_match >= 0.5) refuses each."""
    from serve.batch.metrics import normalize

    cfg, result, rows = run
    c = registry.client()
    by_kind = labels(models)
    answers = {(r["model_version"], r["id"]): r["output"] for r in rows if r["reference"] is not None}
    base = by_kind["base"]
    for kind in ("zero", "a", "b", "merged"):
        name, version = by_kind[kind].rsplit("/", 1)
        tags = c.get_model_version(name, version).tags
        run_id = tags[f"{EVAL_TAG_PREFIX}run_id"]
        assert tags["eval.report"] == f"runs:/{run_id}/eval_report.md"
        with open(c.download_artifacts(run_id, "eval_report.json")) as f:
            report = json.load(f)
        own = float(tags[f"{EVAL_TAG_PREFIX}exact_match"])
        assert tags["gate.verdict"] == "refused" and f"eval.exact_match={own:g} < 0.5" in tags["gate.reasons"]
        if kind == "merged":
            assert "eval.compared_with" not in tags and report["against"] is None
            continue
        assert tags["eval.compared_with"] == f"{base} (base)"
        assert float(tags["eval.delta.exact_match"]) == pytest.approx(own - result.scores["exact_match"], abs=1e-4)
        differ = [rid for (label, rid), out in answers.items() if label == by_kind[kind]
                  and normalize(out) != normalize(answers[(base, rid)])]
        # Every row was given to both, the refused one ("bad") too: refused for both, no difference.
        assert report["rows_compared"] == N_ROWS + 1 and report["rows_answered_differently"] == len(differ)
        assert sorted(e["id"] for e in report["examples"]) == sorted(differ)
        if kind == "zero":
            assert differ == []  # a zero adapter answers as its base
        with open(c.download_artifacts(run_id, "eval_report.md")) as f:
            text = f.read()
        assert f"Compared with **{base}** (base, answering the same rows in this job)" in text
        assert f"## Answers that differ ({len(differ)} of {N_ROWS + 1} rows" in text
