"""Faults under a bounded loopback load (issue 21): each scenario `--rounds` times, one line per run.

    python -m pipelines.stack up node_cpus=1 gcs_redis=true --nodes 3    # three 1-CPU worker nodes, the GCS on Redis
    python bench/bench_faults.py [--rounds 1] [--streams 6] [--stream] [--only serve,batch,gcs,elastic,notice]
                               [--state-dir .rayline]

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
  elastic-node-loss  an elastic training run (`scaling.num_workers: [1, 2]`, the tiny model on the sample corpus,
                   40 steps, checkpoints every 3) on worker-1 and worker-2; right after step 8 the last rank's node is
                   SIGKILLed whole; once the group of 1 has committed a checkpoint, a fresh node joins
                   (tests/train/train_faults.py `elastic_node_loss`; steps of 1 worker are held 2 s longer so that the
                   grow can come before the end).
  spot-notice      a fixed-size 2-worker run on worker-1 and worker-2, whose nodes drain 20 s on SIGTERM (as worker
                   pods do for `checkpoint.notice_grace_s`); right after step 4 the last rank's node gets SIGTERM to its
                   `ray start` (a spot reclaim); after its drain a fresh node joins (`spot_notice`).
Each line: the load held, the fault, requests failed, rows or steps lost, seconds to recover. Training's other
measure, the curve, is the tests': a resumed run's losses equal an uninterrupted run's (tests/train/).
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

SCENARIOS = ("serve", "batch", "gcs", "elastic", "notice")
DRAIN_S = 20


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


def elastic_line(s: dict, tag: str) -> str:
    return (f"elastic-node-loss ({tag}): elastic [1, 2] training run, fault: worker node of rank 1 SIGKILLed after "
            f"step 8; exit {s['exit']}, {s['final_step']} steps done; shrank to 1 worker from step {s['shrunk_at']} "
            f"({s['shrink_steps_lost']} steps lost), first step on 1 worker {s['shrink_s']} s after the kill; grew "
            f"back to 2 from step {s['grown_at']} ({s['grow_steps_lost']} steps redone), first step on 2 workers "
            f"{s['grow_s']} s after the node was back")


def notice_line(s: dict, tag: str) -> str:
    return (f"spot-notice ({tag}): 2-worker training run, fault: SIGTERM to rank 1's worker node after step 4 "
            f"({DRAIN_S} s drain); exit {s['exit']}, {s['final_step']} steps done; checkpoint taken at step "
            f"{s['saved_at']}, steps lost {s['steps_lost']}; the node left {s['node_left_s']} s after the notice, "
            f"training went on {s['recovered_s']} s after it")


def training_faults(cfg, only: list[str], rounds: int, model_dir: Path, tmp: Path) -> list[str]:
    """The training scenarios' lines: the sample corpus prepared once, each scenario `rounds` times."""
    import dataclasses

    from rayjobs.manifests import DRAIN_TIMEOUT_ENV
    from stack.sample_corpus import write_corpus
    from tests.train.stages import History, prepare_sample_data, train_config
    from tests.train.train_faults import ON_WORKER_NODES, elastic_node_loss, elastic_on_worker_nodes, spot_notice

    write_corpus(tmp / "corpus", seed=0, n_train=600, n_eval=100)
    manifest = prepare_sample_data(tmp / "corpus", model_dir, tmp / "prepared")
    history, lines = History(), []
    bench = ("mlflow.experiment=rayline-bench-faults",)
    for i in range(rounds):
        tag = f"round {i + 1}/{rounds}"
        if "elastic" in only:
            loss = elastic_node_loss(cfg, train_config(model_dir, manifest, str(tmp / "runs"), *bench,
                                                       *elastic_on_worker_nodes(40)), tmp)
            if loss.run.returncode != 0:
                print(str(loss.run), flush=True)
            lines.append(elastic_line(loss.summary(history), tag))
            print(lines[-1], flush=True)
        if "notice" in only:
            draining = dataclasses.replace(cfg, ray_env={**cfg.ray_env, DRAIN_TIMEOUT_ENV: str(DRAIN_S)})
            stack.down(cfg, parts=["nodes"])
            stack.up(draining, parts=["nodes"])
            try:
                notice = spot_notice(draining, train_config(model_dir, manifest, str(tmp / "runs"), *bench,
                                                            *ON_WORKER_NODES), tmp, 4, 4.0, DRAIN_S)
            finally:
                stack.down(draining, parts=["nodes"])
                stack.up(cfg, parts=["nodes"])
            if notice.run.returncode != 0:
                print(str(notice.run), flush=True)
            lines.append(notice_line(notice.summary(history), tag))
            print(lines[-1], flush=True)
    return lines


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
    if "elastic" in only and cfg.nodes != 2:
        print(f"elastic-node-loss needs exactly 2 worker nodes (a third would take the lost one's place; now "
              f"{cfg.nodes}): python -m pipelines.stack up node_cpus=1 --nodes 2, and --only without gcs",
              file=sys.stderr)
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
        if "elastic" in only or "notice" in only:
            lines += training_faults(cfg, only, args.rounds, model_dir, Path(tmp))
    print("\n".join(["", "== faults =="] + lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
