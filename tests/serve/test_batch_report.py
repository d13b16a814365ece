"""The eval report's own logic on a result file written here: which rows two models answered differently, and how
the report shows them (the report on real versions, with its tags: tests/serve/test_batch_adapters.py, the demo)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from serve.batch.metrics import exact_match
from serve.batch.report import Against, Report, differing_answers


def write_results(tmp_path, rows):
    out = tmp_path / "out"
    out.mkdir()
    cols = ["id", "prompt", "reference", "output", "model_version"]
    half = len(rows) // 2  # two files: the report reads every file of the output
    for i, part in enumerate((rows[:half], rows[half:])):
        pq.write_table(pa.table({c: [r[j] for r in part] for j, c in enumerate(cols)}), out / f"part-{i}.parquet")
    return str(out)


def test_rows_answered_differently_are_counted_and_the_first_kept_with_who_was_right(tmp_path):
    rows = []
    for i in range(30):
        ref = str(i)
        rows.append((f"r{i}", f"What is {i}?", ref, ref if i % 3 else "x", "m/2"))
        rows.append((f"r{i}", f"What is {i}?", ref, ref if i % 2 else " X ", "m/1"))
    rows.append(("only-new", "q", "a", "a", "m/2"))  # the other model never answered it
    rows.append(("r0", "What is 0?", "0", "0", "other/1"))  # a third model in the job
    uri = write_results(tmp_path, rows)
    both, differ, examples = differing_answers(uri, "m/2", "m/1", exact_match, limit=5)
    # Same answer (normalized: " X " == "x") when i % 3 == 0 and i % 2 == 0, or both right.
    expected = [i for i in range(30) if (i % 3 == 0) != (i % 2 == 0)]
    assert both == 30 and differ == len(expected) and len(examples) == 5
    for e in examples:
        i = int(e["id"][1:])
        assert i in expected and e["right"] == bool(i % 3) and e["other_right"] == bool(i % 2)


def test_the_report_shows_scores_side_by_side_lineage_and_examples():
    report = Report("m/2", {"exact_match": 0.75}, Against("m/1", "champion", {"exact_match": 0.5}, True),
                    {"rayline.dataset_version": "v3"}, both=4, differ=1,
                    examples=[{"id": "r1", "prompt": "What | is\n1?", "reference": "1", "answer": "1",
                               "other_answer": None, "right": True, "other_right": False}])
    text = report.markdown()
    assert "Compared with **m/1** (champion, answering the same rows in this job)." in text
    assert "| exact_match | 0.7500 | 0.5000 | +0.2500 |" in text
    assert "- `rayline.dataset_version`: v3" in text
    assert "## Answers that differ (1 of 4 rows; first 1)" in text
    assert "| What \\| is 1? | 1 | 1 ✓ | (no answer) ✗ |" in text
    assert report.deltas() == {"exact_match": 0.25}
    alone = Report("m/1", {"exact_match": 0.5}, None, {}).markdown()
    assert "No version to compare with" in alone and "Answers that differ" not in alone
