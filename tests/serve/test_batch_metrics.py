"""Batch totals and scores added up a batch of rows at a time (serve/batch/metrics.py Tally, pipeline.tally_results)
equal those of the whole result table. No engine, no Ray."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from serve.batch import metrics
from serve.batch.pipeline import tally_results

RESULTS = pa.table({
    "error": [None, "engine_error: boom", None, "prompt_too_long: 300 > 256", None, None, "engine_error: x"],
    "engine_start_s": [5.0, None, 3.0, None, 9.0, 4.0, 7.5],
    "engine_end_s": [6.0, None, 8.0, None, 12.5, 5.0, None],
    "prompt_tokens": [10, 0, 12, 300, 7, 9, 11],
    "output_tokens": [4, 0, 6, 0, 8, 2, 0],
    "output": ["odd", None, "12", None, "the answer is 7", "x", None],
    "reference": ["odd", "4", "13", None, "7", None, "3"],
    "task": ["p", "s", "s", "p", None, "p", "s"],
    "id": [str(i) for i in range(7)],
})
METRICS = ["exact_match", "contains"]


def expected():
    """Totals and scores of the whole table, counted here by hand from RESULTS."""
    totals = metrics.Totals(rows=7, errors=3, error_codes={"engine_error": 2, "prompt_too_long": 1},
                            prompt_tokens=349, output_tokens=20, engine_busy_s=12.5 - 3.0)
    # Scored rows (a reference): 0 p hit, 1 s miss (no output), 2 s miss, 4 - hit only by contains, 6 s miss.
    scores = {"scored_rows": 5.0, "exact_match": 1 / 5, "exact_match.p": 1.0, "exact_match.s": 0.0,
              "contains": 2 / 5, "contains.p": 1.0, "contains.s": 0.0}
    return totals, scores


def test_a_tally_over_batches_equals_the_whole_tables():
    totals, scores = expected()
    assert metrics.totals(RESULTS) == totals and metrics.score(RESULTS, METRICS) == scores
    tally = metrics.Tally(METRICS)
    for batch in RESULTS.to_batches(max_chunksize=2):
        tally.add(batch)
    assert tally.totals() == totals and tally.scores() == scores


def test_tally_results_reads_files_in_batches_and_only_the_columns_it_needs(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    for i, start in enumerate(range(0, 7, 3)):
        pq.write_table(RESULTS.slice(start, 3), out / f"part-{i}.parquet")
    totals, scores = expected()
    tally = tally_results(str(out), METRICS, batch_rows=2)
    assert tally.totals() == totals and tally.scores() == scores
    generate = tally_results(str(out), [], batch_rows=2)
    assert generate.totals() == totals and generate.scores() == {"scored_rows": 0.0}
    assert "output" not in generate.columns and "id" not in tally.columns
