"""Training throughput: rayline's TorchTrainer vs torchrun, same FSDP2 loop, same `small` model, same data.

    python bench/bench_train.py [--steps 30] [--warmup 5] [--micro-batch 4] [--work-dir out/bench]

Both sides run `train.loop.train_loop` with the model sharded by `train.fsdp` on 2 CPU workers (gloo)
over the prepared sample corpus. rayline runs the train stage's own worker function through
`train.trainer.build_trainer` (Ray Data shards, Ray Train checkpoints); the baseline is
`torchrun --nproc_per_node 2` of this file reading the same Parquet files directly. The timed window
is the optimizer steps after `--warmup` (eval and checkpoint time excluded on both sides). The last
line is the ratio: `rayline vs torchrun: 0.95x`.

It joins the Ray cluster the environment names (the local stack), or starts a local one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORLD = 2
RESULT_PREFIX = "BENCH_RESULT "


def prepare_inputs(work: Path) -> str:
    """The `small` model and the sample corpus prepared with its tokenizer; returns the manifest URI."""
    from pipelines.config import load_config
    from pipelines.sample_corpus import write_corpus
    from pipelines.tiny_model import build_tiny_model

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
    from pipelines.config import load_config
    from train.config import TrainConfig

    return load_config(TrainConfig, ROOT / "configs/train/tiny.yaml", [
        f"run_name={run_name}", f"model.path={work / 'small-model'}", f"data.manifest_uri={manifest_uri}",
        f"checkpoint.storage_path={work / 'runs'}", "mlflow.register_as=", f"train.max_steps={args.steps}",
        f"train.micro_batch_size={args.micro_batch}", f"train.checkpoint_every_steps={args.warmup}",
        f"train.eval_every_steps={args.steps}", "train.eval_batch_size=8", "data.materialize=[eval]",
        # Every checkpoint's metrics carry the cumulative step time; keep them all so the warmup one survives.
        f"scaling.num_workers={WORLD}", f"checkpoint.num_to_keep={args.steps // args.warmup + 1}",
    ])


def join_ray() -> None:
    import ray

    from pipelines.ray_cluster import ray_address
    from train.trainer import connect_ray

    if ray_address() or os.environ.get("RAY_ADDRESS"):
        connect_ray()
    else:
        ray.init(address="local", num_cpus=os.cpu_count(), runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})


def run_rayline(cfg) -> dict:
    """The train stage's TorchTrainer; timing from the checkpoints at the end of warmup and at the last step."""
    import ray

    from train.preflight import plan_run
    from train.trainer import build_trainer

    plan = plan_run(cfg, ray.cluster_resources())
    result = build_trainer(cfg, plan, mlflow_run_id=None).fit()
    by_step = {int(m["step"]): m for _, m in result.best_checkpoints}
    warm, last = by_step[cfg.train.checkpoint_every_steps], by_step[plan.total_steps]
    steps = last["step"] - warm["step"]
    seconds = last["train_time_s"] - warm["train_time_s"]
    return {"steps": steps, "seconds": seconds, "tokens": (last["tokens_seen"] - warm["tokens_seen"]),
            "resources_per_worker": plan.resources_per_worker}


def run_torchrun(cfg_path: Path) -> dict:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_port", str(port),
           str(Path(__file__).resolve()), "--worker", str(cfg_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


class ParquetBatches:
    """The baseline's BatchSource: this rank's rows of the same Parquet files, same batch sizes and order rules."""

    def __init__(self, manifest_uri: str, cfg, rank: int, world: int):
        import pyarrow.parquet as pq

        from data.prepared import load_manifest
        from pipelines import storage

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
    def __init__(self):
        self.times, self.tokens = {}, {}

    def on_step(self, state, metrics):
        self.times[state.step] = metrics["step_time_s"]
        self.tokens[state.step] = state.tokens_seen

    def on_eval(self, state, metrics):
        pass

    def on_checkpoint(self, state, metrics):
        pass


def torchrun_worker(cfg_path: Path) -> None:
    """One torchrun rank: the same model build, optimizer and loop as a rayline worker, without Ray."""
    import torch
    import torch.distributed as dist

    from pipelines.config import from_dict
    from train.config import TrainConfig
    from train.fsdp import build_sharded_model
    from train.loop import train_loop
    from train.optimizer import build_optimizer
    from train.preflight import RunPlan

    spec = json.loads(cfg_path.read_text())
    cfg, plan = from_dict(TrainConfig, spec["cfg"]), RunPlan.from_dict(spec["plan"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, int(plan.resources_per_worker.get("CPU", 1))))
    torch.manual_seed(cfg.train.seed)
    device = torch.device("cpu")
    model = build_sharded_model(plan.model_uri, device, cfg.model.attn_implementation,
                                cfg.model.activation_checkpointing, bf16=False)
    optimizer, scheduler = build_optimizer(model, cfg.optim, plan.total_steps)
    from train.checkpoint import TrainerState

    hooks = StepTimes()
    train_loop(model, optimizer, scheduler, ParquetBatches(plan.manifest_uri, cfg, rank, world), plan.loop,
               TrainerState(world_size=world), hooks, device)
    warm = spec["warmup"]
    if rank == 0:
        timed = [t for s, t in hooks.times.items() if s > warm]
        print(RESULT_PREFIX + json.dumps({"steps": len(timed), "seconds": sum(timed),
                                          "tokens": hooks.tokens[plan.total_steps] - hooks.tokens[warm]}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--work-dir", default=str(ROOT / "out/bench"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        torchrun_worker(Path(args.worker))
        return

    import ray

    from train.preflight import plan_run

    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    join_ray()
    manifest = prepare_inputs(work)
    cfg = train_config(work, manifest, args, f"bench-{int(time.time())}")
    plan = plan_run(cfg, ray.cluster_resources())
    spec = work / "torchrun_spec.json"
    from pipelines.config import to_dict

    spec.write_text(json.dumps({"cfg": to_dict(cfg), "plan": plan.to_dict(), "warmup": args.warmup}))

    print(f"model small ({work / 'small-model'}), {plan.train_rows} train rows x {plan.seq_len} tokens, "
          f"{WORLD} workers x micro-batch {args.micro_batch}, {args.steps} steps ({args.warmup} warmup)", flush=True)
    ours = run_rayline(cfg)
    base = run_torchrun(spec)
    for name, r in (("rayline  (TorchTrainer, 2 workers)", ours), ("torchrun (--nproc_per_node 2)    ", base)):
        print(f"{name}: {r['steps'] / r['seconds']:.3f} steps/s, {r['tokens'] / r['seconds']:,.0f} tokens/s "
              f"({r['steps']} timed steps in {r['seconds']:.1f}s)")
    ratio = (ours["steps"] / ours["seconds"]) / (base["steps"] / base["seconds"])
    print(f"rayline vs torchrun: {ratio:.2f}x")


if __name__ == "__main__":
    main()
