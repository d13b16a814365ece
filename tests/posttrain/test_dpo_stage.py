"""The DPO stage in the chain, on the test stack: a version's wrong answers in a batch eval become a preference version
(the flywheel), `python -m pipelines.dpo` trains on it as the trainer role, the policy registers with its lineage, and
the batch eval and gate take the new version like any fine-tune.

Lean: the tiny model as the "fine-tune" v1, 48 eval rows, 4 DPO steps; two short eval jobs on one CPU engine.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from stack import mlflow_auth
from core import registry, usage
from posttrain import dpo_stage

ROOT = Path(__file__).resolve().parents[2]
N_ROWS = 48
STEPS = 4


def _run(module: str, args: list[str], role: str, timeout: int = 900) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "RAYLINE_ROLE": role})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    results = [line for line in proc.stdout.splitlines() if line.startswith("result: ")]
    return (json.loads(results[-1][len("result: "):]) if results else {}), proc.stdout


def _eval(model_ref: str, prompts: Path, out: Path, gate: Path, compare: str = "") -> dict[str, str]:
    """Run the batch eval (as the evaluator) of `model_ref` with the gate, beside `compare` in the same job when
    given (an engine pool each); returns the version's tags."""
    engines = [f"compare=[{compare}]", "engine.cpus_per_engine=0.5"] if compare else ["engine.cpus_per_engine=1.0"]
    _run("pipelines.batch_infer", ["--config", str(ROOT / "configs/batch/eval_tiny.yaml"), f"input_uri={prompts}",
                                   f"output_uri={out}", f"engine.model={model_ref}", f"gate_config={gate}",
                                   *engines], "evaluator")
    name, version = model_ref.removeprefix("models:/").rsplit("/", 1)
    return registry.client().get_model_version(name, version).tags


@pytest.fixture(scope="module")
def chain(local_stack, tiny_model_dir, sample_corpus_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo")
    production = f"rayline-test-dpo-{uuid.uuid4().hex[:6]}"
    mlflow_auth.provision(registry.tracking_uri(), local_stack.state, [production])  # as `stack up` does its models
    name = production + mlflow_auth.CANDIDATES_SUFFIX  # trainers and evaluators write it
    rows = (Path(sample_corpus_dir) / "eval.jsonl").read_text().splitlines()[:N_ROWS]
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("\n".join(rows) + "\n")
    gate = tmp / "gate.yaml"  # any score passes: the gate's other checks (the evaluated bytes) are what is tested
    gate.write_text(yaml.safe_dump({"gate": {"min_metrics": {"eval.exact_match": 0.0}}}))
    with registry.start_run("rayline-train", "sft-stand-in", tags=registry.lineage_tags("train")) as run:
        parent = registry.register_checkpoint(name, str(tiny_model_dir), run_id=run.info.run_id)
    parent_ref = f"models:/{name}/{parent.version}"
    parent_tags = _eval(parent_ref, prompts, tmp / "eval-parent", gate)
    eval_run = parent_tags["eval.run_id"]

    result, stdout = _run("pipelines.dpo", [
        "--config", str(ROOT / "configs/post_train/dpo_tiny.yaml"), f"run_name=dpo-{uuid.uuid4().hex[:8]}",
        f"model.path={parent_ref}", "preferences.inputs=[]", "preferences.eval_inputs=[]",
        "preferences.eval_fraction=0.25", f"preferences.output_uri={tmp / 'preferences'}",
        f"dpo.from_eval_run={eval_run}", f"checkpoint.storage_path={tmp / 'runs'}", f"mlflow.register_as={name}",
        f"train.max_steps={STEPS}", "train.micro_batch_size=4", "train.eval_batch_size=8",
        "train.checkpoint_every_steps=2"], "trainer")
    dpo_ref = f"models:/{name}/{result['model_version']}"
    dpo_tags = _eval(dpo_ref, prompts, tmp / "eval-dpo", gate, compare=parent_ref)
    return {"name": name, "parent": parent_ref, "eval_run": eval_run, "result": result, "stdout": stdout,
            "dpo_ref": dpo_ref, "dpo_tags": dpo_tags, "tmp": tmp}


def test_wrong_answers_of_a_version_become_a_preference_version_naming_it_and_its_batch_run(chain):
    result = chain["result"]
    manifest = json.loads(Path(result["scored_manifest_uri"]).read_text())
    assert manifest["format"] == "preference" and manifest["version"] == result["preference_version"]
    assert manifest["lineage"]["source_model"] == chain["parent"]
    assert manifest["lineage"]["batch_run"] == chain["eval_run"]
    pairs = [json.loads(line) for line in
             (chain["tmp"] / "preferences" / "from-eval" / chain["eval_run"] / "pairs.jsonl").read_text().splitlines()]
    answers = {r["id"]: r for r in map(json.loads, (chain["tmp"] / "prompts.jsonl").read_text().splitlines())}
    assert pairs, "the tiny untrained model answers every eval row wrong"
    for p in pairs:
        assert p["chosen"] == answers[p["id"]]["messages"][-1]["content"] != p["rejected"]
    assert manifest["counts"]["read"] == len(pairs)


def test_reference_log_probs_are_stored_once_with_the_preference_version(chain):
    result = chain["result"]
    manifest = json.loads(Path(result["scored_manifest_uri"]).read_text())
    assert manifest["reference"]["model"] == chain["parent"]
    version_dir = Path(manifest["preference_manifest"]).parent
    assert Path(result["scored_manifest_uri"]).parent.parent == version_dir / "reference"
    assert manifest["columns"][-2:] == ["ref_chosen_logp", "ref_rejected_logp"]
    # The policy starts as its reference: the first eval loss is exactly -log sigmoid(0) = log 2 when the stored
    # log-probs are the reference's own.
    assert result["first_eval_loss"] == pytest.approx(math.log(2), abs=1e-4)


def test_dpo_trains_and_registers_with_its_lineage_as_a_candidate(chain):
    result = chain["result"]
    assert result["final_step"] == STEPS
    c = registry.client()
    history = [m.value for m in c.get_metric_history(result["mlflow_run_id"], "loss")]
    assert len(history) == STEPS and history[-1] < history[0]
    mv = c.get_model_version(chain["name"], result["model_version"])
    tags = mv.tags
    assert tags[registry.TAG_STAGE] == "dpo"
    assert tags[dpo_stage.TAG_REFERENCE_MODEL] == chain["parent"]
    assert tags[dpo_stage.TAG_PREFERENCE_VERSION] == result["preference_version"]
    assert tags[registry.TAG_DATASET_VERSION] == result["preference_version"]
    assert tags[registry.TAG_BASE_MODEL] == chain["parent"]
    assert tags[dpo_stage.TAG_PREFERENCE_PREFIX + "batch_run"] == chain["eval_run"]
    assert tags[registry.TAG_WEIGHTS_DIGEST] and tags[registry.TAG_WEIGHTS_MANIFEST]
    assert c.get_run(result["mlflow_run_id"]).data.tags[registry.TAG_STAGE] == "dpo"
    # What the job used (core/usage.py), its pair preparation and reference scoring included: on the run and the
    # version, which carries no data stage of its own (the job prepared its pairs itself), only its eval's share (the
    # fixture evaluated it beside its parent).
    assert c.get_run(result["mlflow_run_id"]).data.metrics["usage/cpu_s"] == pytest.approx(result["usage"]["cpu_s"])
    assert tags["rayline.usage.dpo_cpu_s"] == f"{result['usage']['cpu_s']:.1f}"
    by_stage = usage.version_usage(tags)
    assert list(by_stage) == ["dpo", "eval"]
    assert float(tags["rayline.usage.total_cpu_s"]) == pytest.approx(sum(u.cpu_s for u in by_stage.values()), abs=0.11)


def test_the_dpo_version_is_evaluated_beside_its_parent_and_judged_by_the_gate(chain):
    """One eval job answers with the DPO version and its parent; the version's report compares it with the parent
    (its base model tag) on the same rows, and the gate checks the eval run of its exact bytes."""
    tags = chain["dpo_tags"]
    assert tags["gate.verdict"] == "pass", tags.get("gate.reasons")
    assert tags["eval.compared_with"] == f"{chain['parent'].removeprefix('models:/')} (base)"
    eval_run = registry.client().get_run(tags["eval.run_id"])
    assert eval_run.data.tags[registry.TAG_WEIGHTS_DIGEST] == tags[registry.TAG_WEIGHTS_DIGEST]
