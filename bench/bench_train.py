"""Training throughput: rayline's TorchTrainer vs torchrun, same FSDP2 loop, same `small` model, same data.

    python bench/bench_train.py [--steps 30] [--warmup 5] [--micro-batch 4] [--rounds 2] [--work-dir out/bench] [--quick]

Both sides run `train.loop.train_loop` with the model sharded by `train.fsdp` on 2 CPU workers (gloo)
over the prepared sample corpus. rayline runs the train stage's own worker function through
`train.trainer.build_trainer` (Ray Data shards of both splits materialized before the run, as
configs/train/tiny.yaml has it, so each side holds the data in memory; Ray Train checkpoints); the baseline is
`torchrun --nproc_per_node 2` of this file reading the same Parquet files directly, with the torch threads,
OMP_NUM_THREADS and niceness of Ray's train workers. Both write the same DCP checkpoints every `--warmup`
steps (rayline's then go to Ray Train's storage). The timed window is the optimizer steps after `--warmup`, each
timed on every rank from the previous step's end to its own (`TrainerState.wall_time_s`: what the loop's hooks,
the metrics, eval and the checkpoints between steps cost is inside), and the window's time is the slowest rank's:
the wall clock the run experiences, not one rank's in-step timer. The sides run --rounds times in A-B-B-A
order (the machine's speed drifts) and are pooled: steps over seconds. Each side's effective set-up is
printed, its workers' processes read back while they train (bench/equal_terms.py); the last line is the
ratio, given only when the set-ups agree: `rayline vs torchrun: 0.95x`.

It joins the Ray cluster the environment names (the local stack), or starts a local one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.equal_terms import (  # noqa: E402
    busy_threads, one_value_or_all, pooled_setup, print_setups, ratio_line, round_order, thread_times,
)

WORLD = 2
RESULT_PREFIX = "BENCH_RESULT "
# Both workers call torch.set_num_threads (which sets OpenMP's count too), so "torch threads" decides their
# compute threads; the threads that really computed ("busy threads per worker", from their CPU time) are shown
# beside it, not matched: a Ray worker also runs Ray Data's prefetch, which is part of what is measured.
# Read back on both sides: the workers' processes (WorkerWatch), their torch threads and backend (in the workers), the
# steps timed. Precision, FSDP unit, micro-batch and grad accumulation come from the one config both sides are given:
# shown, not matched (they would match by construction).
MUST_MATCH = ["worker processes", "niceness", "CPU affinity", "torch threads", "backend", "timed steps"]


def prepare_inputs(work: Path) -> str:
    """The `small` model and the sample corpus prepared with its tokenizer; returns the manifest URI."""
    from core.config import load_config
    from stack.sample_corpus import write_corpus
    from stack.tiny_model import build_tiny_model

    model = work / "small-model"
    if not (model / "model.safetensors").exists():
        build_tiny_model(model, "small", seed=0)
    corpus = work / "corpus"
    if not (corpus / "eval.jsonl").exists():
        write_corpus(corpus, seed=0, n_train=4000, n_eval=200)
    from data.config import Config as DataConfig
    from data.prepare import main as prepare

    cfg = load_config(DataConfig, ROOT / "configs/data/sample.yaml", [
        f"inputs=[{corpus / 'train.jsonl'}]", f"eval_inputs=[{corpus / 'eval.jsonl'}]",
        f"output_uri={work / 'prepared'}", f"tokenizer={model}",
    ])
    return prepare(cfg).manifest_uri


def train_config(work: Path, manifest_uri: str, args, run_name: str):
    from core.config import load_config
    from train.config import TrainConfig

    return load_config(TrainConfig, ROOT / "configs/train/tiny.yaml", [
        f"run_name={run_name}", f"model.path={work / 'small-model'}", f"data.manifest_uri={manifest_uri}",
        f"checkpoint.storage_path={work / 'runs'}", "mlflow.register_as=", f"train.max_steps={args.steps}",
        f"train.micro_batch_size={args.micro_batch}", f"train.checkpoint_every_steps={args.warmup}",
        f"train.eval_every_steps={args.steps}", "train.eval_batch_size=8", "data.materialize=[train, eval]",
        # Every checkpoint's metrics carry the cumulative step time; keep them all so the warmup one survives.
        f"scaling.num_workers={WORLD}", f"checkpoint.num_to_keep={args.steps // args.warmup + 1}",
    ])


def join_ray() -> None:
    import ray

    from core.ray_cluster import ray_address
    from train.trainer import connect_ray

    if ray_address() or os.environ.get("RAY_ADDRESS"):
        connect_ray()
    else:
        ray.init(address="local", num_cpus=os.cpu_count(), runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})


def torch_threads(plan) -> int:
    """The torch threads a worker runs: what train/worker.py sets from the plan, and the baseline too."""
    return max(1, int(plan.resources_per_worker.get("CPU", 1)))


def loop_setup(cfg, plan, steps: int) -> dict:
    """What both sides' loops are given (the same config and plan), in set-up terms."""
    return {"torch threads": torch_threads(plan), "precision": "bf16" if cfg.bf16 else "fp32",
            "FSDP unit": cfg.model.fsdp_unit,
            "micro-batch x seq_len": f"{cfg.train.micro_batch_size} x {plan.seq_len}",
            "grad accumulation": cfg.train.grad_accum_steps, "timed steps": steps}


class WorkerWatch:
    """Reads the training workers' processes back while they run (every second, in a thread): how many
    there are at most at once, their niceness and CPU affinity, and how many threads in each computed over
    the run (equal_terms.busy_threads). `match` picks them by their command line. Their environment is not
    read: a Ray worker sets its title, which overwrites what /proc shows of it."""

    def __init__(self, match):
        self.match, self.best, self._stop = match, {}, threading.Event()
        self.first: dict[int, dict] = {}
        self.last: dict[int, dict] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(1.0):
            found = []
            for proc in psutil.process_iter():
                try:
                    if self.match(proc.cmdline()):
                        found.append((proc.nice(), len(proc.cpu_affinity())))
                        self.last[proc.pid] = thread_times(proc.pid)
                        self.first.setdefault(proc.pid, self.last[proc.pid])
                except (psutil.Error, OSError):
                    continue
            if found and len(found) >= self.best.get("worker processes", 0):
                self.best = {"worker processes": len(found), **{k: one_value_or_all(v) for k, v in zip(
                    ("niceness", "CPU affinity"), zip(*found))}}

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        busy = [busy_threads(self.first[pid], self.last[pid]) for pid in self.last]
        return {**self.best, "busy threads per worker": ",".join(map(str, busy))}


def run_rayline(cfg) -> dict:
    """The train stage's TorchTrainer; timing from the checkpoints at the end of warmup and at the last step."""
    import ray

    from train.preflight import plan_run
    from train.trainer import build_trainer

    plan = plan_run(cfg, ray.cluster_resources())
    trainer = build_trainer(cfg, plan, mlflow_run_id=None)
    watch = WorkerWatch(lambda cmdline: any("RayTrainWorker" in part for part in cmdline))
    try:
        result = trainer.fit()
    finally:
        workers = watch.stop()
    by_step = {int(m["step"]): m for _, m in result.best_checkpoints}
    warm, last = by_step[cfg.train.checkpoint_every_steps], by_step[plan.total_steps]
    steps = last["step"] - warm["step"]
    seconds = slowest_rank_seconds(warm["wall_time_s_ranks"], last["wall_time_s_ranks"])
    # Threads and backend as the worker read them back in itself (its checkpoint report), not as configured.
    setup = {**workers, **loop_setup(cfg, plan, steps), "backend": last.get("backend", "not read back"),
             "torch threads": last.get("torch_threads", "not read back")}
    return {"steps": steps, "seconds": seconds, "tokens": (last["tokens_seen"] - warm["tokens_seen"]), "setup": setup}


def slowest_rank_seconds(at_warm: list[float], at_last: list[float]) -> float:
    """The timed window's wall clock: each rank's `wall_time_s` at the last step less at the warm-up's end, the
    slowest rank's (every rank's clock is read back; one rank's would hide a straggler)."""
    if len(at_warm) != len(at_last) or not at_last:
        raise ValueError(f"wall clocks of {len(at_warm)} and {len(at_last)} ranks: the ranks did not all report")
    return max(b - a for a, b in zip(at_warm, at_last))


def run_torchrun(cfg_path: Path, threads: int, nice: int) -> dict:
    """torchrun of this file's worker at `nice`, with `threads` torch threads and OMP_NUM_THREADS: what Ray
    gives a worker (ray._private.utils.set_omp_num_threads_if_unset: its CPUs rounded down, at least 1)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_port", str(port),
           str(Path(__file__).resolve()), "--worker", str(cfg_path), "--threads", str(threads)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    watch = WorkerWatch(lambda cmdline: "--worker" in cmdline and str(cfg_path) in cmdline
                        and "torch.distributed.run" not in cmdline)  # the ranks, not their launcher
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
                              preexec_fn=lambda: os.nice(nice - os.getpriority(os.PRIO_PROCESS, 0)))
    finally:
        workers = watch.stop()
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    result["setup"] = {**workers, **result["setup"]}
    return result


class ParquetBatches:
    """The baseline's BatchSource: this rank's rows of the same Parquet files, same batch sizes and order rules."""

    def __init__(self, manifest_uri: str, cfg, rank: int, world: int):
        import pyarrow.parquet as pq

        from data.prepared import load_manifest
        from core import storage

        manifest = load_manifest(manifest_uri)

        def rows(split: str) -> dict:
            fs, path = storage.resolve(manifest["splits"][split]["path"])
            table = pq.read_table(path, filesystem=fs)
            n = table.num_rows // world  # Ray's equal split: the same row count per rank
            table = table.slice(rank * n, n)
            return {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}

        self.train, self.eval, self.cfg = rows("train"), rows("eval"), cfg

    def _batches(self, cols: dict, size: int, drop_last: bool, seed: int | None):
        import numpy as np
        import torch

        n = len(next(iter(cols.values())))
        order = np.random.default_rng(seed).permutation(n) if seed is not None else np.arange(n)
        for i in range(0, n - (size - 1 if drop_last else 0), size):
            idx = order[i : i + size]
            yield {k: torch.from_numpy(np.stack(v[idx]).astype(np.int64)) for k, v in cols.items()}

    def train_batches(self, epoch: int):
        return self._batches(self.train, self.cfg.train.micro_batch_size, True, self.cfg.train.seed + epoch)

    def eval_batches(self):
        return self._batches(self.eval, self.cfg.train.eval_batch_size, False, None)


class StepTimes:
    """The baseline's loop hooks: this rank's wall clock at each checkpoint, and the same DCP checkpoints as rayline's workers write (at the
    same steps, each rank into a local directory of its own, deleted once written, as Ray's upload does)."""

    def __init__(self, model, optimizer, rank: int, root: Path):
        self.walls, self.tokens = {}, {}
        self.model, self.optimizer, self.rank, self.root = model, optimizer, rank, root

    def on_step(self, state, metrics):
        self.tokens[state.step] = state.tokens_seen

    def on_eval(self, state, metrics):
        pass

    def on_checkpoint(self, state, metrics):
        from train.checkpoint import checkpoint_name, save_checkpoint

        self.walls[state.step] = state.wall_time_s  # at the same steps as rayline's workers report theirs
        local = self.root / f"rank{self.rank}" / checkpoint_name(state.step)
        save_checkpoint(local, self.model, self.optimizer, state, self.rank)
        shutil.rmtree(local)


def torchrun_worker(cfg_path: Path, threads: int) -> None:
    """One torchrun rank: the same model build, optimizer and loop as a rayline worker, without Ray."""
    import torch
    import torch.distributed as dist

    from core.config import from_dict
    from train.config import TrainConfig
    from train.fsdp import build_sharded_model
    from train.loop import rank_values, train_loop
    from train.optimizer import build_optimizer
    from train.preflight import RunPlan

    spec = json.loads(cfg_path.read_text())
    cfg, plan = from_dict(TrainConfig, spec["cfg"]), RunPlan.from_dict(spec["plan"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.train.seed)
    device = torch.device("cpu")
    model = build_sharded_model(plan.model_uri, device, cfg.model.attn_implementation,
                                cfg.model.activation_checkpointing, cfg.bf16, fsdp_unit=cfg.model.fsdp_unit)
    optimizer, scheduler = build_optimizer(model, cfg.optim, plan.total_steps)
    from train.checkpoint import TrainerState

    hooks = StepTimes(model, optimizer, rank, cfg_path.parent / "torchrun-checkpoints")
    train_loop(model, optimizer, scheduler, ParquetBatches(plan.manifest_uri, cfg, rank, world), plan.loop,
               TrainerState(world_size=world), hooks, device, torch.bfloat16 if cfg.bf16 else torch.float32)
    warm, last = spec["warmup"], plan.total_steps
    at_warm, at_last = rank_values(hooks.walls[warm]), rank_values(hooks.walls[last])
    if rank == 0:
        # Read back in the running worker, under the same keys as rayline's set-up.
        setup = {"backend": dist.get_backend(), **loop_setup(cfg, plan, last - warm),
                 "torch threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
        print(RESULT_PREFIX + json.dumps({"steps": last - warm, "seconds": slowest_rank_seconds(at_warm, at_last),
                                          "setup": setup, "tokens": hooks.tokens[last] - hooks.tokens[warm]}),
              flush=True)
    dist.destroy_process_group()


def run_args(description: str) -> argparse.ArgumentParser:
    """The options every train-stage bench takes: timed steps, warm-up, micro-batch, rounds and the work dir."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="runs per side, in A-B-B-A order, pooled")
    p.add_argument("--work-dir", default=str(ROOT / "out/bench"))
    return p


def main() -> None:
    p = run_args(__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 4 steps (2 warmup), one round (rayline then torchrun; ~2.5 min)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        torchrun_worker(Path(args.worker), args.threads)
        return
    if args.quick:
        # One round: a rayline run costs ~80 s from start to finish on 2 cores (Ray Train's controller,
        # workers, dataset, checkpoints), so a second would take the smoke run past 3 minutes.
        args.steps, args.warmup, args.rounds = 4, 2, 1

    import ray

    from core.config import to_dict
    from train.preflight import plan_run

    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    join_ray()
    manifest = prepare_inputs(work)
    runs: dict[str, list[dict]] = {"rayline": [], "torchrun": []}
    for i, order in enumerate(round_order(["rayline", "torchrun"], args.rounds)):
        # A fresh run name each time: the same one would resume from the last run's checkpoints.
        cfg = train_config(work, manifest, args, f"bench-{int(time.time())}-{i}")
        plan = plan_run(cfg, ray.cluster_resources())
        if i == 0:
            print(f"model small ({work / 'small-model'}), {plan.train_rows} train rows x {plan.seq_len} tokens, "
                  f"{WORLD} workers x micro-batch {args.micro_batch}, {args.steps} steps ({args.warmup} warmup)",
                  flush=True)
        for side in order:
            start = time.perf_counter()
            if side == "rayline":
                r = run_rayline(cfg)
            else:
                # The niceness of Ray's workers as read back in rayline's last run (round 1 runs it first).
                nice = int(runs["rayline"][-1]["setup"]["niceness"])
                spec = work / "torchrun_spec.json"
                spec.write_text(json.dumps({"cfg": to_dict(cfg), "plan": plan.to_dict(), "warmup": args.warmup}))
                r = run_torchrun(spec, torch_threads(plan), nice)
            runs[side].append(r)
            print(f"round {i + 1} {side:8}: {r['steps'] / r['seconds']:.3f} steps/s ({r['steps']} timed steps in "
                  f"{r['seconds']:.1f}s; {time.perf_counter() - start:.0f}s from start to finish)", flush=True)
        shutil.rmtree(work / "runs" / cfg.run_name, ignore_errors=True)

    pooled = {side: {k: sum(r[k] for r in rs) for k in ("steps", "seconds", "tokens")} for side, rs in runs.items()}
    setups = {"rayline (TorchTrainer)": pooled_setup(runs["rayline"]),
              "torchrun": pooled_setup(runs["torchrun"])}
    print(f"\n{args.rounds} rounds per side, A-B-B-A, pooled; {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print_setups(setups)
    for name, r in (("rayline  (TorchTrainer, 2 workers)", pooled["rayline"]),
                    ("torchrun (--nproc_per_node 2)    ", pooled["torchrun"])):
        print(f"{name}: {r['steps'] / r['seconds']:.3f} steps/s, {r['tokens'] / r['seconds']:,.0f} tokens/s "
              f"({r['steps']} timed steps in {r['seconds']:.1f}s)")
    ours, base = pooled["rayline"], pooled["torchrun"]
    ratio = (ours["steps"] / ours["seconds"]) / (base["steps"] / base["seconds"])
    print(ratio_line("torchrun", ratio, *setups.values(), MUST_MATCH))


if __name__ == "__main__":
    main()
