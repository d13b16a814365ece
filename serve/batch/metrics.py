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


TOTALS_COLUMNS = ["error", "engine_start_s", "engine_end_s", "prompt_tokens", "output_tokens"]
SCORE_COLUMNS = ["output", "reference", "task"]


class Tally:
    """Totals and scores of a result set, added up one batch of rows at a time, so a job's results never
    have to be in memory at once (`add` any number of tables or record batches, then `totals()`/`scores()`)."""

    def __init__(self, metrics: list[str] | None = None):
        self.metrics = list(metrics or [])
        self.t = Totals()
        self.start: float | None = None
        self.end: float | None = None
        self.scored = 0
        self.hits = Counter()
        """(metric, task or None) -> hits; task None is the metric over every scored row."""
        self.per_task = Counter()
        """task -> scored rows."""

    @property
    def columns(self) -> list[str]:
        """The result columns `add` reads."""
        return TOTALS_COLUMNS + (SCORE_COLUMNS if self.metrics else [])

    def add(self, rows: pa.Table | pa.RecordBatch) -> None:
        self.add_totals(rows)
        if self.metrics:
            self.add_scores(rows)

    def add_totals(self, rows: pa.Table | pa.RecordBatch) -> None:
        errors = [e for e in rows.column("error").to_pylist() if e]
        starts = [v for v in rows.column("engine_start_s").to_pylist() if v is not None]
        ends = [v for v in rows.column("engine_end_s").to_pylist() if v is not None]
        t = self.t
        t.rows += rows.num_rows
        t.errors += len(errors)
        t.error_codes = dict(Counter(t.error_codes) + Counter(e.split(":", 1)[0] for e in errors))
        t.prompt_tokens += sum(rows.column("prompt_tokens").to_pylist())
        t.output_tokens += sum(rows.column("output_tokens").to_pylist())
        if starts:
            self.start = min(starts + ([self.start] if self.start is not None else []))
        if ends:
            self.end = max(ends + ([self.end] if self.end is not None else []))

    def add_scores(self, rows: pa.Table | pa.RecordBatch) -> None:
        columns = zip(rows.column("output").to_pylist(), rows.column("reference").to_pylist(),
                      rows.column("task").to_pylist())
        for output, reference, task in columns:
            if reference is None:
                continue
            self.scored += 1
            if task is not None:
                self.per_task[task] += 1
            for name in self.metrics:
                if SCORERS[name](output, reference):
                    self.hits[(name, None)] += 1
                    if task is not None:
                        self.hits[(name, task)] += 1

    def totals(self) -> Totals:
        """Row, error and token counts, and how long the engine was busy."""
        busy = (self.end - self.start) if self.start is not None and self.end is not None else None
        return Totals(rows=self.t.rows, errors=self.t.errors, error_codes=dict(self.t.error_codes),
                      prompt_tokens=self.t.prompt_tokens, output_tokens=self.t.output_tokens, engine_busy_s=busy)

    def scores(self) -> dict[str, float]:
        """`metric` over rows with a reference, plus `metric.<task>` per task when rows carry one; and `scored_rows`."""
        result: dict[str, float] = {"scored_rows": float(self.scored)}
        for name in self.metrics:
            result[name] = self.hits[(name, None)] / self.scored if self.scored else 0.0
            for task, n in sorted(self.per_task.items()):
                result[f"{name}.{task}"] = self.hits[(name, task)] / n
        return result


def totals(table: pa.Table) -> Totals:
    """Row, error and token counts of a result table, and how long the engine was busy."""
    tally = Tally()
    tally.add_totals(table)
    return tally.totals()


def score(table: pa.Table, metrics: list[str]) -> dict[str, float]:
    """`metric` over rows with a reference, plus `metric.<task>` per task when rows carry one; and `scored_rows`."""
    tally = Tally(metrics)
    tally.add_scores(table)
    return tally.scores()
