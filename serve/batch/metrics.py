"""Eval metrics and run totals, computed from the result Parquet the stage wrote (so they can be recomputed).

A metric scores rows that have a reference; a row whose prompt was refused or failed in the engine counts as
wrong (the model gave no answer), so refusing rows can never raise a score.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa


def normalize(text: str | None) -> str:
    """Case- and whitespace-insensitive form: strip, collapse runs of whitespace, lower-case."""
    return re.sub(r"\s+", " ", text or "").strip().lower()


def exact_match(output: str | None, reference: str) -> bool:
    return output is not None and normalize(output) == normalize(reference)


def contains(output: str | None, reference: str) -> bool:
    """The reference appears in the output as whole words (an answer followed by chatter still counts)."""
    if output is None:
        return False
    return re.search(rf"(?<!\S){re.escape(normalize(reference))}(?!\S)", normalize(output)) is not None


SCORERS = {"exact_match": exact_match, "contains": contains}


@dataclass
class Totals:
    rows: int = 0
    errors: int = 0
    error_codes: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    output_tokens: int = 0
    engine_busy_s: float | None = None
    """First request queued -> last token, on the engine's clock (None when no row reached the engine)."""


def totals(table: pa.Table) -> Totals:
    """Row, error and token counts of a result table, and how long the engine was busy."""
    errors = [e for e in table.column("error").to_pylist() if e]
    starts = [s for s in table.column("engine_start_s").to_pylist() if s is not None]
    ends = [s for s in table.column("engine_end_s").to_pylist() if s is not None]
    return Totals(
        rows=table.num_rows,
        errors=len(errors),
        error_codes=dict(Counter(e.split(":", 1)[0] for e in errors)),
        prompt_tokens=sum(table.column("prompt_tokens").to_pylist()),
        output_tokens=sum(table.column("output_tokens").to_pylist()),
        engine_busy_s=(max(ends) - min(starts)) if starts and ends else None,
    )


def score(table: pa.Table, metrics: list[str]) -> dict[str, float]:
    """`metric` over rows with a reference, plus `metric.<task>` per task when rows carry one; and `scored_rows`."""
    outputs = table.column("output").to_pylist()
    references = table.column("reference").to_pylist()
    tasks = table.column("task").to_pylist()
    scored = [(o, r, t) for o, r, t in zip(outputs, references, tasks) if r is not None]
    result: dict[str, float] = {"scored_rows": float(len(scored))}
    for name in metrics:
        hits = [SCORERS[name](o, r) for o, r, _ in scored]
        result[name] = sum(hits) / len(hits) if hits else 0.0
        by_task: dict[str, list[bool]] = {}
        for (_, _, task), hit in zip(scored, hits):
            if task is not None:
                by_task.setdefault(task, []).append(hit)
        for task, task_hits in sorted(by_task.items()):
            result[f"{name}.{task}"] = sum(task_hits) / len(task_hits)
    return result
