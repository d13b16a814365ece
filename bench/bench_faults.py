"""Faults under a bounded loopback load (issue 21): each scenario `--rounds` times, one line per run.

    python -m pipelines.stack up node_cpus=1 gcs_redis=true --nodes 3    # three 1-CPU worker nodes, the GCS on Redis
    python bench/bench_faults.py [--rounds 1] [--streams 6] [--stream] [--only serve,batch,gcs] [--state-dir .rayline]

Scenarios (each written once in tests/serve/, where the tests run them too):
  serve-node-loss  the `tiny` engine app (python -m pipelines.serve), one replica pinned to each worker node
                   (`node_labels`), `--streams` loopback streams of chat completions; worker-1 is SIGKILLed whole
                   (raylet, workers, engine: a lost machine) and a fresh worker-1 started, as KubeRay replaces a
                   lost pod (tests/serve/serve_faults.py `serve_node_loss`). A request that had received no byte of an answer
                   when the node went is sent again, on the other replica (core/ray_env.py); with `--stream` the
                   answers are streamed, and a stream under way on the lost replica may fail.
  batch-node-loss  `python -m pipelines.batch_infer` of 800 prompts, one engine pinned to each worker node;
                   worker-1 lost 4 s into their work and replaced (batch_faults.py `batch_node_loss`).
  gcs-restart      the serving app on two of three worker nodes (the third: room for the rollout's new replicas),
                   the load through those nodes' own Serve proxies; the head's GCS
                   SIGKILLed (the head goes down with it, as the head pod on KubeRay), the head started again after
                   5 s with its state in Redis, then a rollout to version 2 (gcs_faults.py `serve_gcs_restart`).
Each line: the load held, the fault, requests failed, rows lost or duplicated, seconds to recover. A training node
loss is not run here (no load to hold, its measure is the curve): tests/train/test_train_stage.py loses a worker
node at step 8 and checks the resume from the step-6 checkpoint in S3 reproduces the uninterrupted loss curve.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stack import lifecycle as stack  # noqa: E402
from stack.tiny_model import build_tiny_model  # noqa: E402

SCENARIOS = ("serve", "batch", "gcs")


def serve_line(s: dict, tag: str) -> str:
    capacity = s["full_capacity_s"]
    return (f"serve-node-loss ({tag}): load {s['streams']} {'streamed' if s['streamed'] else 'non-streamed'} "
            f"streams held, fault: worker node of one of 2 engine replicas SIGKILLed; requests {s['requests']}, "
            f"failed {s['failed']} ({s['failed_with_no_byte']} with no byte of an answer, "
            f"{s['failed'] - s['failed_with_no_byte']} streams under way on the lost replica); Serve marked the "
            f"replica down {s['replica_marked_down_s']} s after the kill; rows lost/duplicated: n/a; node back "
            f"{s['node_rejoined_s']} s, full capacity " + (f"{capacity} s" if capacity is not None else "not reached"))


def batch_line(s: dict, tag: str) -> str:
    return (f"batch-node-loss ({tag}): load {s['rows']} prompts on 2 engines, fault: worker node of one engine "
            f"SIGKILLed ({s['rows_written_at_kill']} rows written then); exit {s['returncode']}; rows lost "
            f"{s['rows_lost']}, duplicated {s['rows_duplicated']}, with an error {s['rows_with_error']}; job done "
            f"{s['finished_after_kill_s']} s after the kill")


def gcs_line(s: dict, tag: str) -> str:
    return (f"gcs-restart ({tag}): load {s['streams']} streams (pause {s['pause_s']} s after each answer) through the worker proxies held, fault: GCS SIGKILLed "
            f"(head down with it, started again after 5 s); requests {s['requests']}, failed {s['failed']} "
            f"({s['answered_while_head_down']}/{s['sent_while_head_down']} answered while the head was down); rows "
            f"lost/duplicated: n/a; head back {s['head_back_s']} s ({s['head_starts']} start(s)), Serve controller back {s['serve_controller_back_s']} "
            f"s, rollout to v2 done {s['rollout_done_s']} s; GCS keys in Redis {s['redis_keys']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--streams", type=int, default=6)
    p.add_argument("--stream", action="store_true", help="serve-node-loss: stream each answer")
    p.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated: " + ", ".join(SCENARIOS))
    p.add_argument("--state-dir", default=None, help="the stack's state dir (default .rayline)")
    args = p.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    if any(s not in SCENARIOS for s in only):
        print(f"--only: pick from {', '.join(SCENARIOS)}, got {args.only!r}", file=sys.stderr)
        return 2

    cfg = stack.load_stack_config(args.state_dir, [])
    need = 3 if "gcs" in only else 2
    if cfg.nodes < need or cfg.node_cpus != 1 or not stack.part_healthy(cfg, "nodes") or ("gcs" in only and not cfg.gcs_redis):
        print(f"needs the stack up with {need} 1-CPU worker nodes{' and gcs_redis' if 'gcs' in only else ''} (now "
              f"nodes={cfg.nodes}, node_cpus={cfg.node_cpus}, gcs_redis={cfg.gcs_redis}): "
              f"python -m pipelines.stack up node_cpus=1 gcs_redis=true --nodes 3", file=sys.stderr)
        return 2
    os.environ.update(stack.env_vars(cfg))
    from tests.serve.batch_faults import batch_node_loss
    from tests.serve.gcs_faults import serve_gcs_restart
    from tests.serve.serve_faults import serve_node_loss

    print(f"set-up: stack {cfg.state}, head + {cfg.nodes} worker nodes of {cfg.node_cpus} CPU, all on 127.0.0.1, GCS "
          f"{'on Redis' if cfg.gcs_redis else 'in memory'}; {args.streams} streams{' (streamed)' if args.stream else ''}; scenarios {only}; "
          f"{args.rounds} round(s)", flush=True)
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", "tiny", seed=0)
        for i in range(args.rounds):
            tag = f"round {i + 1}/{args.rounds}"
            if "serve" in only:
                loss = serve_node_loss(cfg, model_dir, streams=args.streams, stream=args.stream)
                print(f"  replica events (s, replica, state): {loss.events}", flush=True)
                lines.append(serve_line(loss.summary(), tag))
                print(lines[-1], flush=True)
            if "batch" in only:
                work = Path(tmp) / f"batch-{i}"
                work.mkdir()
                batch = batch_node_loss(cfg, model_dir, str(work / "out"), work, engines_work_s=4.0)
                lines.append(batch_line(batch.summary(), tag))
                print(lines[-1], flush=True)
            if "gcs" in only:  # last: the head restarts
                run = serve_gcs_restart(cfg, model_dir)  # its own paced load: the head restarts on the same 2 cores
                print(f"  replica events (s, replica, state): {run.events}", flush=True)
                lines.append(gcs_line(run.summary(), tag))
                print(lines[-1], flush=True)
    print("\n".join(["", "== faults =="] + lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
