"""The flywheel: a model version's eval output becomes preference pairs that name where they came from.

An eval run of the batch stage (serve/batch/) scored a version's answers against each row's reference answer. Every
row it got wrong becomes a pair: the prompt (the input record's messages, less the reference turn), chosen = the
reference answer, rejected = the version's answer. Rows the engine refused or failed, and empty answers, are left out
(nothing to prefer against). The pairs file and its lineage (the version, the eval run, its output) feed the
preference data stage (data/preference_prepare.py), which records the lineage in the version's manifest; the DPO run
and its model version carry it as `rayline.preference_*` tags.

    <preferences.output_uri>/from-eval/<eval run id>/pairs.jsonl
"""

from __future__ import annotations

import json

from core import registry, storage
from serve.batch.metrics import exact_match
from serve.batch.pipeline import result_batches
from serve.batch.rows import MODEL_COLUMN, row_id, split_messages


def _input_records(input_uri: str) -> dict[str, list[dict]]:
    """id -> prompt messages of every chat record of the eval input (JSONL, a file or a directory), with the ids the
    batch stage gives its result rows (serve/batch/rows.py `row_id`)."""
    files = [input_uri] if input_uri.endswith(".jsonl") else [
        storage.join(input_uri, rel) for rel in storage.list_files(input_uri) if rel.endswith(".jsonl")]
    prompts: dict[str, list[dict]] = {}
    for uri in files:
        for line in storage.read_text(uri).splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # the batch stage refused it too: it has no answer to learn from
            if isinstance(record, dict) and record.get("messages") is not None:
                messages, _, problem = split_messages(record["messages"])
                if not problem:
                    prompts[row_id(record, line)] = messages
    return prompts


def pairs_from_eval(output_uri: str, input_uri: str, model_label: str | None = None) -> list[dict]:
    """The pairs of the wrong answers in the batch output at `output_uri` (of the eval input `input_uri`); with
    `model_label` (`name/N`), only that model's rows of a job that answered with several."""
    prompts = _input_records(input_uri)
    pairs = []
    for batch in result_batches(output_uri, ["id", "reference", "output", "error", MODEL_COLUMN]):
        for row in batch.to_pylist():
            if model_label and row[MODEL_COLUMN] != model_label:
                continue
            answer, reference = row["output"], row["reference"]
            if row["error"] or not answer or not answer.strip() or reference is None or row["id"] not in prompts:
                continue
            if not exact_match(answer, reference):
                pairs.append({"id": row["id"], "messages": prompts[row["id"]], "chosen": reference,
                              "rejected": answer})
    return sorted(pairs, key=lambda p: p["id"])


def pairs_from_eval_run(run_id: str, out_root: str) -> tuple[str, dict[str, str], int]:
    """Write the pairs of the eval run `run_id` (its input and output are its params, the version its tags) under
    `out_root`; returns (pairs file URI, lineage, pairs written)."""
    run = registry.client().get_run(run_id)
    params, tags = run.data.params, run.data.tags
    for key in ("input_uri", "output_uri"):
        if not params.get(key):
            raise ValueError(f"dpo.from_eval_run: run {run_id} has no {key!r} param; is it a batch eval run?")
    name, version = tags.get(registry.TAG_MODEL_NAME), tags.get(registry.TAG_MODEL_VERSION)
    label = f"{name}/{version}" if name and version else None
    pairs = pairs_from_eval(params["output_uri"], params["input_uri"], label)
    uri = storage.join(out_root, "from-eval", run_id, "pairs.jsonl")
    storage.write_text(uri, "".join(json.dumps(p, ensure_ascii=False, sort_keys=True) + "\n" for p in pairs))
    lineage = {"source_model": f"models:/{label}" if label else tags.get("rayline.model_ref", ""),
               "batch_run": run_id, "batch_output": params["output_uri"]}
    return uri, lineage, len(pairs)
