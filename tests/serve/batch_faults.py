"""A batch inference job that loses the node of one engine mid-work (issue 21, faults), written once for the test
(tests/serve/test_node_loss.py) and the benchmark (bench/bench_faults.py).

The job is `python -m pipelines.batch_infer` on the `tiny` model with two engines pinned to worker-1 and worker-2
of the stack (`node_labels`, 1-CPU nodes: one engine each). A few seconds into their work worker-1 is SIGKILLed
whole (raylet, the engine actor and its EngineCore: a lost machine) and a fresh worker-1 joins, as KubeRay
replaces a lost pod. Ray Data retries the lost engine's batches; the output is then read back row by row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ENGINE_ACTOR = "MapWorker(MapBatches(EngineStageUDF))"  # Ray Data's actor class for the engine stage


@dataclass
class BatchNodeLoss:
    rows: int
    rows_at_kill: int
    finished_s: float | None  # kill -> job exit
    returncode: int | None
    placed: dict[str, str]  # engine actor id -> node id, when the node went
    nodes_before: dict[str, str]  # label -> node id
    lost_engine: str  # the actor id of the engine on the lost node
    lost_engine_death: str  # its death cause, as Ray recorded it
    sources: Counter  # output row source -> times written
    errors: int  # output rows with an error
    log: str

    @property
    def missing(self) -> int:
        return sum(1 for i in range(self.rows) if self.sources[f"prompts.jsonl:{i + 1}"] == 0)

    @property
    def duplicated(self) -> int:
        return sum(n - 1 for n in self.sources.values() if n > 1)

    def summary(self) -> dict:
        return {"rows": self.rows, "rows_written_at_kill": self.rows_at_kill, "returncode": self.returncode,
                "finished_after_kill_s": None if self.finished_s is None else round(self.finished_s, 1),
                "rows_lost": self.missing, "rows_duplicated": self.duplicated, "rows_with_error": self.errors}


def engine_nodes() -> dict[str, str]:
    """Alive engine actors of the cluster -> their node ids (needs a connected Ray driver)."""
    from ray.util.state import list_actors

    actors = list_actors(filters=[("state", "=", "ALIVE"), ("class_name", "=", ENGINE_ACTOR)], limit=10_000,
                         detail=True)
    return {a.actor_id: a.node_id for a in actors}


def batch_node_loss(cfg, model_dir: str | Path, output_uri: str, work_dir: Path, rows: int = 800,
                    engines_work_s: float = 2.0, limit_s: float = 900.0) -> BatchNodeLoss:
    """Run the job on the stack `cfg` (with two 1-CPU worker nodes) and lose worker-1 `engines_work_s` after both
    engines are up (alive once their vLLM engine is built; the stage releases them after its last batch).

    The job's Ray Data waits for both engines before it hands out the first batch (its `wait_for_min_actors_s`).
    Otherwise an engine that comes up seconds before the other takes most batches, and Ray Data releases an idle
    engine once every batch is handed out: on a loaded box that happened 4 s after the second engine came up,
    before the node went."""
    from ray.util.state import list_actors

    from core import registry
    from stack import faults as stack_faults, lifecycle as stack
    from core.node_labels import NODE_LABEL
    from serve.batch.pipeline import read_results
    from serve.batch.progress import WrittenRows
    from tests.serve.serving import node_ids_by_label

    input_path = work_dir / "prompts.jsonl"
    input_path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"What is {i} + {i % 7}?"}) + "\n"
                                  for i in range(rows)))
    cmd = [sys.executable, "-m", "pipelines.batch_infer", "--config", "configs/batch/infer_tiny.yaml",
           f"input_uri={input_path}", f"output_uri={output_uri}", f"engine.model={model_dir}",
           "sampling.max_tokens=48", "batch_size=8", "max_concurrent_batches=4", "progress_every_s=0",
           "engine.max_num_seqs=16", "engine.kv_cache_memory_bytes=67108864", "engine.cpus_per_engine=1",
           "num_engines=2", f"node_labels={{{NODE_LABEL}: 'in(worker-1,worker-2)'}}"]
    log_path = work_dir / "job.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=registry.PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "RAY_DATA_DEFAULT_WAIT_FOR_MIN_ACTORS_S": str(int(limit_s))})
    written = WrittenRows(output_uri)
    finished_s = None
    try:
        deadline, placed = time.monotonic() + limit_s, {}
        while len(placed) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            placed = engine_nodes()
        time.sleep(engines_work_s)
        if proc.poll() is not None or engine_nodes() != placed or len(placed) != 2:
            raise RuntimeError(f"the two engines were not at work: {placed}\n{log_path.read_text()[-3000:]}")
        nodes = node_ids_by_label(cfg)
        rows_at_kill, killed_at = written.count(), time.monotonic()
        stack_faults.kill_node(cfg, 1)
        stack.up(cfg, parts=["nodes"])  # a fresh worker-1, as KubeRay replaces a lost pod
        proc.wait(max(deadline - time.monotonic(), 1))
        finished_s = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lost = [a for a, node in placed.items() if node == nodes.get("worker-1")]
    death = list_actors(filters=[("actor_id", "=", lost[0])], detail=True) if lost else []
    table = read_results(output_uri) if proc.returncode == 0 else None
    return BatchNodeLoss(
        rows, rows_at_kill, finished_s, proc.returncode, placed, nodes, lost[0] if lost else "",
        f"{death[0].state}: {death[0].death_cause}" if death else "",
        Counter(table.column("source").to_pylist()) if table is not None else Counter(),
        sum(e is not None for e in table.column("error").to_pylist()) if table is not None else 0,
        log_path.read_text())
