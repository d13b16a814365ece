"""Faults under a bounded loopback load (issue 21): each scenario `--rounds` times, one line per run.

    python -m pipelines.stack up node_cpus=1 --nodes 2    # the local stack with two 1-CPU worker nodes
    python bench/bench_faults.py [--rounds 1] [--streams 6] [--state-dir .rayline]

Scenarios:
  serve-node-loss  the `tiny` engine app (python -m pipelines.serve), one replica pinned to each worker node
                   (`node_labels`), `--streams` loopback streams of chat completions; worker-1 is SIGKILLed whole
                   (raylet, workers, engine: a lost machine) and a fresh worker-1 started, as KubeRay replaces a
                   lost pod (tests/serve/serving.py `serve_node_loss`).
Each line: the load held, the fault, requests failed (how many of them were in flight on the lost replica when
it went; the others were sent to it before Serve marked it down), rows lost or duplicated, seconds until the node rejoined and until full capacity. Serving has no
rows to lose: each request is answered or counted failed. Not yet scenarios here: a training node loss (tested in
tests/train/test_train_stage.py: a worker node lost at step 8, resumed from step 6 in S3), a batch engine's node
loss (the killed driver and resume is tests/serve/test_batch_resume.py), a GCS restart with Redis.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipelines import stack  # noqa: E402
from pipelines.tiny_model import build_tiny_model  # noqa: E402
from tests.serve.serving import serve_node_loss  # noqa: E402


def serve_line(summary: dict, rounds: int, i: int) -> str:
    capacity = summary["full_capacity_s"]
    return (f"serve-node-loss (round {i + 1}/{rounds}): load {summary['streams']} streams held, fault: worker node "
            f"of one of 2 engine replicas SIGKILLed; requests {summary['requests']}, failed {summary['failed']} "
            f"({summary['failed_in_flight_at_kill']} in flight on the lost replica, the rest sent to it before Serve "
            f"marked it down at {summary['replica_marked_down_s']} s); rows lost/duplicated: n/a; "
            f"node back {summary['node_rejoined_s']} s, full capacity "
            + (f"{capacity} s" if capacity is not None else "not reached"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--streams", type=int, default=6)
    p.add_argument("--state-dir", default=None, help="the stack's state dir (default .rayline)")
    args = p.parse_args(argv)

    cfg = stack.load_stack_config(args.state_dir, [])
    if cfg.nodes < 2 or cfg.node_cpus != 1 or not stack.part_healthy(cfg, "nodes"):
        print(f"needs the stack up with two 1-CPU worker nodes (now nodes={cfg.nodes}, node_cpus={cfg.node_cpus}): "
              f"python -m pipelines.stack up node_cpus=1 --nodes 2", file=sys.stderr)
        return 2
    os.environ.update(stack.env_vars(cfg))
    print(f"set-up: stack {cfg.state}, head + {cfg.nodes} worker nodes of {cfg.node_cpus} CPU, all on 127.0.0.1; "
          f"{args.streams} streams; {args.rounds} round(s)", flush=True)
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", "tiny", seed=0)
        for i in range(args.rounds):
            loss = serve_node_loss(cfg, model_dir, streams=args.streams)
            print(f"  replica events (s, replica, state): {loss.events}", flush=True)
            lines.append(serve_line(loss.summary(), args.rounds, i))
            print(lines[-1], flush=True)
    print("\n".join(["", "== faults =="] + lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
