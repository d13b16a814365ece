"""The rollout gate: a version's eval figures against thresholds, and its exported checkpoint checked for completeness.

The figures are the metrics the batch stage logged on its eval run of exactly these bytes (`eval_figures`: the
run names the version and the sha256 digest of the files it evaluated, core/weights_manifest.py), in the
eval experiment that only the evaluator identity may write. Version tags (`eval.exact_match`, ...) stay for people
to read: changing one changes nothing the gate decides.

Each check returns reasons (empty = pass), written so the person who promoted the version can act on
them: which figure, what value, which threshold; which file is missing, cut short, or does not match
config.json. The completeness checks read headers only (a few KB per file, local or s3://); the hashing that
pins the bytes happens where the checkpoint is resolved (serve/online/engine.py `checked_digest`).
"""

from __future__ import annotations

import json
import math
import posixpath

from core import registry, storage
from core.weights_manifest import safetensors_header
from serve.promotion.rollout_config import GateConfig

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Pickle-based weights run code when loaded: the gate refuses them; only safetensors are served.
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


FIGURE_PREFIX = "eval."


def eval_figures(name: str, version: str, digest: str | None, experiment: str) -> tuple[dict[str, str], str | None]:
    """The metrics of the latest finished eval run of `name`/`version` (for a copied version: the version it was
    copied from) over the bytes with `digest`, in `experiment`, as the gate names them (`eval.<metric>`), and that
    run's id; ({}, None) when there is none."""
    if not digest:
        return {}, None
    c = registry.client()
    origin = registry.origin_version(c.get_model_version(name, str(version)))  # a copy's evidence is its origin's
    name, version = origin.name, str(origin.version)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return {}, None
    runs = c.search_runs(
        [exp.experiment_id],
        filter_string=(f"tags.`{registry.TAG_MODEL_NAME}` = '{name}' and tags.`{registry.TAG_MODEL_VERSION}` = "
                       f"'{version}' and tags.`{registry.TAG_WEIGHTS_DIGEST}` = '{digest}' and "
                       "attributes.status = 'FINISHED'"),
        order_by=["attributes.start_time DESC"], max_results=1,
    )
    if not runs:
        return {}, None
    return {f"{FIGURE_PREFIX}{k}": repr(v) for k, v in runs[0].data.metrics.items()}, runs[0].info.run_id


def evidence_problems(name: str, version: str, digest: str | None, gate: GateConfig) -> list[str]:
    """The gate's metric bounds against the eval run of exactly these bytes (eval_figures)."""
    figures, run_id = eval_figures(name, version, digest, gate.eval_experiment)
    if run_id is None and (gate.min_metrics or gate.max_metrics):
        return [f"no finished eval run of {name}/{version} over its bytes (sha256 {str(digest)[:16]}...) in the "
                f"experiment {gate.eval_experiment}: run batch eval on this version first (tags do not count)"]
    return metric_problems(figures, gate)


def metric_problems(tags: dict[str, str], gate: GateConfig) -> list[str]:
    """Eval figures (`eval.exact_match`, ...) outside the configured bounds, missing or not numbers."""
    problems = []
    bounds = [(k, v, "min") for k, v in gate.min_metrics.items()] + [(k, v, "max") for k, v in gate.max_metrics.items()]
    for tag, bound, kind in bounds:
        raw = tags.get(tag)
        if raw is None:
            problems.append(f"{tag} is missing (run batch eval on this version first); gate needs {kind} {bound}")
            continue
        try:
            value = float(raw)
        except ValueError:
            problems.append(f"{tag}={raw!r} is not a number; gate needs {kind} {bound}")
            continue
        if math.isnan(value) or (kind == "min" and value < bound) or (kind == "max" and value > bound):
            op = "<" if kind == "min" else ">"
            problems.append(f"{tag}={value:g} {op} {bound:g} (gate.{kind}_metrics)")
    return problems


EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")


def _embedding_problem(config: dict, header: dict, where: str) -> str | None:
    """The token embedding must be [vocab_size, hidden size] of config.json (weights of another model otherwise)."""
    hidden = config.get("hidden_size") or config.get("n_embd") or config.get("d_model")
    vocab = config.get("vocab_size")
    for name, meta in header.items():
        if name.endswith(EMBEDDING_SUFFIXES) and vocab and hidden:
            if list(meta.get("shape", [])) != [vocab, hidden]:
                return (f"{where}: {name} has shape {meta.get('shape')} but config.json says "
                        f"[vocab_size, hidden_size] = [{vocab}, {hidden}] (weights and config do not match)")
    return None


def checkpoint_problems(source: str) -> list[str]:
    """What keeps the Hugging Face checkpoint at `source` (local dir or s3:// URI) from loading, if anything."""
    try:
        files = set(storage.list_files(source))
    except (OSError, ValueError) as e:
        return [f"{source}: cannot list the checkpoint ({e})"]
    if not files:
        return [f"{source}: no files (checkpoint missing or empty)"]
    problems = []
    config: dict = {}
    if "config.json" not in files:
        problems.append(f"{source}: config.json is missing")
    else:
        try:
            config = json.loads(storage.read_text(storage.join(source, "config.json")))
        except ValueError as e:
            problems.append(f"{source}/config.json: not valid JSON ({e})")
    if not any(f in files for f in TOKENIZER_FILES):
        problems.append(f"{source}: no tokenizer (expected one of {', '.join(TOKENIZER_FILES)})")
    weights = sorted(f for f in files if f.endswith(WEIGHT_SUFFIXES) and posixpath.dirname(f) == "")
    index = "model.safetensors.index.json"
    if index in files:
        try:
            shards = set(json.loads(storage.read_text(storage.join(source, index)))["weight_map"].values())
        except (ValueError, KeyError) as e:
            return problems + [f"{source}/{index}: unreadable ({e})"]
        problems += [f"{source}: shard {s} listed in {index} is missing" for s in sorted(shards - files)]
    elif not weights:
        problems.append(f"{source}: no weight files (*.safetensors)")
    problems += [f"{source}/{f}: pickle-based weights are refused (loading one can run code); export safetensors"
                 for f in sorted(files) if f.endswith(PICKLED_SUFFIXES)]
    for w in weights:
        if w.endswith(".safetensors"):
            header, problem = safetensors_header(storage.join(source, w))
            problem = problem or _embedding_problem(config if isinstance(config, dict) else {}, header, f"{source}/{w}")
            if problem:
                problems.append(problem)
    return problems


def gate_problems(name: str, version: str, digest: str | None, source: str | None, gate: GateConfig) -> list[str]:
    """Every reason the version must not be deployed: its eval evidence first, then the checkpoint."""
    problems = evidence_problems(name, version, digest, gate)
    if gate.check_artifacts and source is not None:
        problems += checkpoint_problems(source)
    return problems


def judge_for(gate_config: str):
    """The judge the batch stage gives each version it scored (serve/batch/pipeline.py `main`): a callable
    (model, source, adapter) -> every reason the `gate` of the rollout YAML `gate_config` would refuse the version
    now, from the eval run just logged over its bytes (empty: pass). None without a gate_config."""
    if not gate_config:
        return None
    from core.config import load_config
    from serve.promotion.rollout_config import Config as RolloutConfig

    gate = load_config(RolloutConfig, registry.project_path(gate_config), []).gate

    def judge(model, source: str, adapter: bool) -> list[str]:
        if adapter:
            return evidence_problems(model.name, model.version, model.digest, gate)
        return gate_problems(model.name, model.version, model.digest, source, gate)

    return judge
