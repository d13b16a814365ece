"""Reading Parquet the way the stages do (`core.ray_cluster.read_parquet`) on the test stack's Ray."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from core.ray_cluster import read_parquet


def test_read_parquet_lists_files_without_an_actor_pool(ray_session, tmp_path):
    from ray.util.state import list_actors

    for i in range(3):
        pq.write_table(pa.table({"x": list(range(i * 10, i * 10 + 10))}), tmp_path / f"part-{i}.parquet")
    (tmp_path / "notes.txt").write_text("not a Parquet file")
    context = ray_session.data.DataContext.get_current()
    before = context.use_datasource_v2

    ds = read_parquet(str(tmp_path), file_extensions=["parquet"])
    assert sorted(row["x"] for row in ds.iter_rows()) == list(range(30))
    assert context.use_datasource_v2 == before  # the driver's own setting is left as it was
    # Ray's default Parquet reader would have started (and killed) a pool of FooterReader actors for
    # this one read: a fresh worker process each, seconds on a small cluster.
    job = ray_session.get_runtime_context().get_job_id()
    started = [a for a in list_actors(filters=[("job_id", "=", job)], limit=10_000) if "FooterReader" in a.class_name]
    assert started == []
