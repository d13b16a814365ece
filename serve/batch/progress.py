"""Progress of a batch job in its log: rows written / planned, rows per second and an ETA.

The driver already knows how many rows the job will answer (`inputs.count_input_rows`). Ray Data writes
the result Parquet file of each block as soon as that block is done, so the files under `output_uri` are the
job's progress: a thread in the driver reads their footers (a few KB each, once per file) every
`every_s` seconds and prints one line when the count moved. No actor, no extra work in the engines.
"""

from __future__ import annotations

import threading
import time

from core import storage


def format_line(done: int, planned: int, elapsed_s: float) -> str:
    """`batch progress: 512/1,024 rows (50%), 12.3 rows/s, ETA 41s`."""
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    pct = f" ({100 * done // planned}%)" if planned else ""
    eta = ""
    if rate > 0 and planned > done:
        left = (planned - done) / rate
        eta = f", ETA {int(left // 60)}m{int(left % 60):02d}s" if left >= 60 else f", ETA {left:.0f}s"
    return f"batch progress: {done:,}/{planned:,} rows{pct}, {rate:,.1f} rows/s{eta}"


class WrittenRows:
    """Rows in the Parquet files under a directory, counting each file's footer once."""

    def __init__(self, output_uri: str):
        self.output_uri = output_uri
        self._rows: dict[str, int] = {}

    def count(self) -> int:
        if storage.exists(self.output_uri):
            for rel in storage.list_files(self.output_uri):
                if rel.endswith(".parquet") and rel not in self._rows:
                    try:
                        self._rows[rel] = storage.parquet_metadata(storage.join(self.output_uri, rel)).num_rows
                    except Exception:  # still being written: counted on a later pass
                        continue
        return sum(self._rows.values())


class ProgressReporter:
    """`with ProgressReporter(output_uri, planned):` prints a progress line every `every_s` while the body runs."""

    def __init__(self, output_uri: str, planned: int, every_s: float = 10.0, clock=time.monotonic, out=None):
        self.rows, self.planned, self.every_s, self.clock = WrittenRows(output_uri), planned, every_s, clock
        self.out = out or (lambda line: print(line, flush=True))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batch-progress", daemon=True)
        self._last = -1

    def report(self) -> None:
        done = self.rows.count()
        if done != self._last:
            self._last = done
            self.out(format_line(done, self.planned, self.clock() - self.started))

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.report()
            except Exception as e:  # progress must never fail the job
                self.out(f"batch progress: unavailable ({type(e).__name__}: {e})")
                return

    def __enter__(self) -> "ProgressReporter":
        self.started = self.clock()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=self.every_s + 5)
