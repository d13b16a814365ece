"""Promotion evidence: what a person sees on a model version's page before setting an alias on it.

After an eval job, each registered model it scored gets, on its own eval run, `eval_report.md` (and the same as
`eval_report.json`): its metrics next to those of the version it would replace, the examples where their answers
differ (when both answered in this job: same rows, same prompts), and its lineage. Version tags point at it and
carry the verdict:
  eval.report                runs:/<eval run>/eval_report.md
  eval.compared_with         the version it was measured against and why: `rayline-tiny/3 (champion)`, or its base
                             `rayline-tiny-base/1 (base)` when no champion of its name serves yet
  eval.delta.<metric>        this version's score minus the other's (+0.7500)
  gate.verdict, gate.reasons what the promotion gate (`gate_config`: a rollout YAML's `gate`) says of it now:
                             pass | refused, and every reason
The version's lineage tags (dataset version, base model, git commit, source run) are already on the page.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from core import registry
from serve.batch.metrics import normalize
from serve.online.engine import ModelInfo

TAG_REPORT = "eval.report"
TAG_COMPARED_WITH = "eval.compared_with"
TAG_DELTA = "eval.delta."
TAG_GATE_VERDICT = "gate.verdict"
TAG_GATE_REASONS = "gate.reasons"
MAX_EXAMPLES = 20
LINEAGE = (registry.TAG_DATASET_VERSION, registry.TAG_BASE_MODEL, registry.TAG_GIT_COMMIT, registry.TAG_SOURCE_RUN,
           registry.TAG_ADAPTER)


@dataclass
class Against:
    label: str
    """`name/N` of the version compared with."""
    role: str
    """champion | base"""
    scores: dict[str, float]
    in_job: bool
    """It answered the same rows in this job (examples where the answers differ are in the report)."""


@dataclass
class Report:
    model: str
    scores: dict[str, float]
    against: Against | None
    lineage: dict[str, str]
    both: int = 0
    differ: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)

    def deltas(self) -> dict[str, float]:
        if self.against is None:
            return {}
        return {m: self.scores[m] - self.against.scores[m] for m in self.scores if m in self.against.scores}

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "scores": self.scores, "lineage": self.lineage, "deltas": self.deltas(),
                "against": self.against.__dict__ if self.against else None, "rows_compared": self.both,
                "rows_answered_differently": self.differ, "examples": self.examples}

    def markdown(self) -> str:
        a = self.against
        lines = [f"# Eval report: {self.model}", ""]
        if a is None:
            lines += ["No version to compare with: no champion of this model serves and its base was not evaluated "
                      "in this job.", ""]
        else:
            lines += [f"Compared with **{a.label}** ({a.role}"
                      + (", answering the same rows in this job" if a.in_job else ", from its own eval tags") + ").",
                      "", f"| metric | {self.model} | {a.label} | delta |", "|---|---|---|---|"]
            for m, v in self.scores.items():
                other = a.scores.get(m)
                lines.append(f"| {m} | {v:.4f} | " + (f"{other:.4f} | {v - other:+.4f} |" if other is not None
                                                      else "n/a | |"))
            lines.append("")
        lines += ["## Lineage", ""] + [f"- `{k}`: {v}" for k, v in self.lineage.items()] + [""]
        if a is not None and a.in_job:
            lines += [f"## Answers that differ ({self.differ} of {self.both} rows; first {len(self.examples)})", ""]
            lines += [f"| prompt | reference | {self.model} | {a.label} |", "|---|---|---|---|"]
            for e in self.examples:
                cells = [e["prompt"], e["reference"] or "", _marked(e["answer"], e["right"]),
                         _marked(e["other_answer"], e["other_right"])]
                lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        return "\n".join(lines) + "\n"


def _marked(text: str | None, right: bool | None) -> str:
    mark = "" if right is None else (" ✓" if right else " ✗")
    return ("(no answer)" if text is None else text) + mark


def _cell(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def against_for(model: ModelInfo, scores_in_job: dict[str, dict[str, float]], metrics: list[str]) -> Against | None:
    """What `model` would replace: its name's champion (when another version), else its base when the job scored
    it; None for unregistered models or when there is neither."""
    if not (model.name and model.version):
        return None
    champion = registry.get_alias(model.name, registry.DEFAULT_ALIAS)
    if champion is not None and str(champion.version) != str(model.version):
        label = f"{model.name}/{champion.version}"
        if label in scores_in_job:
            return Against(label, "champion", scores_in_job[label], True)
        tags = champion.tags or {}
        scores = {m: float(tags[f"eval.{m}"]) for m in metrics if f"eval.{m}" in tags}
        return Against(label, "champion", scores, False)
    base = (model.tags or {}).get(registry.TAG_BASE_MODEL, "")
    if base.startswith("models:/"):
        label = base.removeprefix("models:/")
        if label in scores_in_job:
            return Against(label, "base", scores_in_job[label], True)
    return None


def differing_answers(output_uri: str, model: str, other: str, scorer, limit: int = MAX_EXAMPLES
                      ) -> tuple[int, int, list[dict[str, Any]]]:
    """(rows both were given, rows they answered differently, the first `limit` of those) from the job's result
    Parquet (a row refused for both, same prompt, is not a difference);
    holds one output per row of the two models (an eval set, not a corpus)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from serve.batch.results import result_batches
    from serve.batch.rows import MODEL_COLUMN

    seen: dict[str, dict[str, dict]] = {model: {}, other: {}}
    for batch in result_batches(output_uri, ["id", "prompt", "reference", "output", MODEL_COLUMN]):
        mask = pc.is_in(batch.column(MODEL_COLUMN), value_set=pa.array([model, other]))
        for row in batch.filter(mask).to_pylist():
            seen[row[MODEL_COLUMN]][row["id"]] = row
    both = differ = 0
    examples = []
    for rid, mine in seen[model].items():
        theirs = seen[other].get(rid)
        if theirs is None:
            continue
        both += 1
        if normalize(mine["output"]) == normalize(theirs["output"]) and (mine["output"] is None) == (theirs["output"] is None):
            continue
        differ += 1
        if len(examples) < limit:
            ref = mine["reference"]
            examples.append({"id": rid, "prompt": mine["prompt"], "reference": ref, "answer": mine["output"],
                             "other_answer": theirs["output"],
                             "right": scorer(mine["output"], ref) if ref is not None else None,
                             "other_right": scorer(theirs["output"], ref) if ref is not None else None})
    return both, differ, examples


def build_report(model: ModelInfo, scores: dict[str, float], scores_in_job: dict[str, dict[str, float]],
                 output_uri: str, metrics: list[str]) -> Report:
    from serve.batch.metrics import SCORERS

    against = against_for(model, scores_in_job, metrics)
    lineage = {k: (model.tags or {})[k] for k in LINEAGE if (model.tags or {}).get(k)}
    report = Report(model.label, {m: scores[m] for m in metrics if m in scores}, against, lineage)
    if against is not None and against.in_job:
        scorer = SCORERS[metrics[0]] if metrics else SCORERS["exact_match"]
        report.both, report.differ, report.examples = differing_answers(output_uri, model.label, against.label, scorer)
    return report


def publish(report: Report, model: ModelInfo, run_id: str, gate_problems: list[str] | None) -> dict[str, str]:
    """Log the report on the eval run and tag the version; returns the tags set."""
    import mlflow

    client = mlflow.MlflowClient()
    client.log_text(run_id, report.markdown(), "eval_report.md")
    client.log_text(run_id, json.dumps(report.to_json(), indent=2), "eval_report.json")
    tags = {TAG_REPORT: f"runs:/{run_id}/eval_report.md"}
    if report.against is not None:
        tags[TAG_COMPARED_WITH] = f"{report.against.label} ({report.against.role})"
        tags.update({f"{TAG_DELTA}{m}": f"{d:+.4f}" for m, d in report.deltas().items()})
    if gate_problems is not None:
        tags[TAG_GATE_VERDICT] = "refused" if gate_problems else "pass"
        tags[TAG_GATE_REASONS] = "; ".join(gate_problems)[:4000]
    registry.set_display_tags(model.name, model.version, tags)
    return tags
