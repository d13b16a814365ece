"""Batch progress lines: rows written (from the result files' footers) over rows planned, rate and ETA."""

import pyarrow as pa
import pyarrow.parquet as pq

from serve.batch.progress import ProgressReporter, WrittenRows, format_line


def test_line_says_done_planned_rate_and_eta():
    assert format_line(512, 1024, 40.0) == "batch progress: 512/1,024 rows (50%), 12.8 rows/s, ETA 40s"
    assert format_line(100, 10_000, 10.0) == "batch progress: 100/10,000 rows (1%), 10.0 rows/s, ETA 16m30s"
    assert format_line(1024, 1024, 80.0) == "batch progress: 1,024/1,024 rows (100%), 12.8 rows/s"
    assert format_line(0, 64, 5.0) == "batch progress: 0/64 rows (0%), 0.0 rows/s"


def _write(path, n):
    pq.write_table(pa.table({"id": [str(i) for i in range(n)]}), path)


def test_written_rows_reads_each_footer_once_and_skips_partial_files(tmp_path):
    rows = WrittenRows(str(tmp_path / "out"))
    assert rows.count() == 0  # nothing written yet: the directory does not exist
    (tmp_path / "out").mkdir()
    _write(tmp_path / "out" / "a.parquet", 30)
    _write(tmp_path / "out" / "b.parquet", 12)
    (tmp_path / "out" / "c.parquet").write_bytes(b"PAR1 half a file")  # still being written
    assert rows.count() == 42
    _write(tmp_path / "out" / "c.parquet", 8)
    assert rows.count() == 50


def test_reporter_prints_only_when_rows_moved(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    now = [100.0]
    lines = []
    reporter = ProgressReporter(str(out_dir), planned=40, every_s=3600, clock=lambda: now[0], out=lines.append)
    with reporter:
        now[0] = 110.0
        _write(out_dir / "a.parquet", 10)
        reporter.report()
        reporter.report()  # nothing new: no second line
        now[0] = 120.0
        _write(out_dir / "b.parquet", 10)
        reporter.report()
    assert lines == ["batch progress: 10/40 rows (25%), 1.0 rows/s, ETA 30s",
                     "batch progress: 20/40 rows (50%), 1.0 rows/s, ETA 20s"]
