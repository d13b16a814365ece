"""How cost grows with work (issue 21): the data stage and batch inference at growing input sizes.

    python bench/bench_scale.py [--data 20000,200000,2000000] [--batch 5000,50000] [--near 200000,2000000]
                                [--max-tokens 64] [--num-cpus 2] [--rounds 2] [--work DIR]

Each size runs in a driver process of its own, on a fresh `--num-cpus` Ray that the driver starts
(`ray.init(address="local")`), so the cluster's processes (GCS, raylet, workers, engines) belong to the driver's
process session and to nothing else. This script samples every 0.5 s the proportional set size (PSS, from
/proc/<pid>/smaps_rollup: pages shared by several processes, as the object store is, are split among them and so
counted once) of the driver and, summed, of the rest of its session; it prints the peak of each. Per size:
  data   `data.prepare.main` on generated chat records (user 10-80 words, assistant 20-200, every record unique and
         valid; JSONL written streaming, 8 files) with the `tiny` model's tokenizer, seq_len 512, packing, shards sized
         by input (`num_shards: 0`, 64 MiB of input each); a 2,000-record run first starts Ray's worker processes;
         tokens/s = tokens written to the packed Parquet over the timed run's wall time.
  near   the same as data, with `near_dedup: true` (MinHash LSH near-duplicate removal, data/near_dedup.py, at its
         defaults: threshold 0.8, 5-word shingles, 128 permutations): the signatures, the band shuffle and the band
         tasks on top of the stage's own work; compare with the data line of the same size for their cost.
  batch  `serve.batch.pipeline.main` (infer mode, configs/batch/infer_tiny.yaml) on generated prompts with the
         `tiny` model, at most `--max-tokens` output tokens per prompt; tokens/s = output tokens over the wall time
         (start-up included) and over the engine's busy time (steady).
  spill  the bytes Ray spilled from the object store to disk in the run (Ray's memory summary).
The sizes of a stage run `--rounds` times in alternating order (small to large, then large to small: a machine
whose speed drifts, shared with others, hits every size alike), each size pooled over its rounds (tokens over
seconds; memory and spill: the highest round's), every round printed as it ends.
Targets: tokens/s at the largest size within 15% of the middle one, and peak memory that does not grow with the
input. The last lines are one per stage: `<stage>: largest vs middle <ratio>x tokens/s, peak memory <ratio>x`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_data import chat_records, sentence  # noqa: E402
from bench.equal_terms import round_order  # noqa: E402

RESULT_PREFIX = "SCALE_RESULT "


def write_records(folder: Path, n: int, files: int = 8, seed: int = 0) -> None:
    """`n` unique, valid chat records over `files` JSONL files, written as they are made (never all in memory)."""
    folder.mkdir(parents=True, exist_ok=True)
    handles = [open(folder / f"part-{i:03d}.jsonl", "w") for i in range(files)]
    try:
        for i, messages in enumerate(chat_records(n, seed)):
            handles[i % files].write(json.dumps({"id": f"r{i}", "messages": messages}) + "\n")
    finally:
        for h in handles:
            h.close()


def write_prompts(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"p{i}", "prompt": f"Question {i}: " + sentence(rng, 5, 30)}) + "\n")


# --- the driver (a process of its own per size) -------------------------------------------------------------

WARMUP_RECORDS = 2000


def spilled_bytes() -> int:
    import ray
    from ray._private.internal_api import memory_summary

    # This driver's own cluster (without an address Ray looks for the newest cluster on the machine).
    text = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    for line in text.splitlines():  # "Spilled 1234 MiB, 56 objects, avg write throughput ..."
        if line.strip().startswith("Spilled"):
            return int(float(line.split()[1]) * 2**20)
    return 0


def drive(kind: str, inputs: str, model: str, out: str, num_cpus: int, max_tokens: int) -> None:
    import ray

    from core.config import from_dict

    os.environ.pop("RAY_ADDRESS", None)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    if kind in ("data", "near"):
        from data.config import Config
        from data.prepare import main

        def config(inputs: str, out: str):
            return from_dict(Config, {"inputs": [inputs], "output_uri": out, "tokenizer": model, "format": "chat",
                                      "seq_len": 512, "packing": "pack", "num_shards": 0, "eval_fraction": 0.01,
                                      "near_dedup": kind == "near"}, "bench")

        # A 2,000-record run first starts Ray's worker processes, as a long-lived cluster would have (bench_data.py
        # does the same): a fresh Ray's cold start is the same few seconds at every size, and timed it would count
        # against the small sizes only.
        write_records(Path(out + "-warmup-in"), WARMUP_RECORDS)
        main(config(out + "-warmup-in", out + "-warmup"))
        cfg = config(inputs, out)
        t0 = time.perf_counter()
        result = main(cfg)
        wall = time.perf_counter() - t0
        tokens = sum(s["tokens"] for s in result.splits.values())
        figures = {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "records": result.counts["read"],
                   "shards": result.manifest["num_shards"], "near_deduplicated": result.counts["near_deduplicated"]}
    else:
        from core.config import load_config
        from serve.batch.config import Config
        from serve.batch.pipeline import main

        cfg = load_config(Config, ROOT / "configs/batch/infer_tiny.yaml", [
            f"input_uri={inputs}", f"output_uri={out}", f"engine.model={model}", "overwrite=true",
            "progress_every_s=0", f"sampling.max_tokens={max_tokens}"])
        t0 = time.perf_counter()
        result = main(cfg)
        wall = time.perf_counter() - t0
        figures = {"wall_s": wall, "tokens": result.output_tokens, "tokens_per_s": result.output_tokens / wall,
                   "steady_tokens_per_s": result.steady_output_tokens_per_s, "rows": result.rows,
                   "errors": result.errors}
    figures["spilled_bytes"] = spilled_bytes()
    print(RESULT_PREFIX + json.dumps(figures), flush=True)
    ray.shutdown()


# --- the parent: inputs, one driver per size, memory sampled from outside -----------------------------------


def pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class PeakMemory:
    """Peak PSS of one process and, summed, of the rest of its session, sampled every `every_s`."""

    def __init__(self, pid: int, every_s: float = 0.5):
        from stack.processes import session_members

        self.pid, self.every_s, self._members = pid, every_s, session_members
        self.driver_kib = self.cluster_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.driver_kib = max(self.driver_kib, pss_kib(self.pid))
            others = sum(pss_kib(p) for p in self._members(self.pid) if p != self.pid)
            self.cluster_kib = max(self.cluster_kib, others)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def run_size(kind: str, size: int, work: Path, model: str, num_cpus: int, max_tokens: int, round_no: int = 0) -> dict:
    inputs = work / f"{kind}-{size}"
    inputs = inputs if kind in ("data", "near") else inputs.with_suffix(".jsonl")
    t = time.perf_counter()
    if not inputs.exists():  # made once: every round of a size reads the same inputs
        write_records(inputs, size) if kind in ("data", "near") else write_prompts(inputs, size)
    made_s = time.perf_counter() - t
    out = work / f"{kind}-{size}-out-{round_no}"
    cmd = [sys.executable, __file__, "--drive", kind, str(inputs), model, str(out), str(num_cpus), str(max_tokens)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    memory = PeakMemory(proc.pid)
    lines = proc.stdout.read().splitlines()
    proc.wait()
    memory.stop()
    results = [json.loads(ln[len(RESULT_PREFIX):]) for ln in lines if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"{kind} at {size}: exit {proc.returncode}\n" + "\n".join(lines[-40:]))
    return {**results[0], "size": size, "inputs_made_s": made_s, "driver_peak_mib": memory.driver_kib / 1024,
            "cluster_peak_mib": memory.cluster_kib / 1024}


def pooled(runs: list[dict]) -> dict:
    """One size over its rounds: tokens and seconds summed (tokens/s = all tokens over all seconds, steady likewise),
    peaks and spill the highest round's."""
    wall, tokens = sum(r["wall_s"] for r in runs), sum(r["tokens"] for r in runs)
    out = {**runs[0], "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "rounds": len(runs)}
    for key in ("driver_peak_mib", "cluster_peak_mib", "spilled_bytes"):
        out[key] = max(r[key] for r in runs)
    if all(r.get("steady_tokens_per_s") for r in runs):
        busy = sum(r["tokens"] / r["steady_tokens_per_s"] for r in runs)
        out["steady_tokens_per_s"] = tokens / busy
    return out


def line(kind: str, r: dict) -> str:
    steady = f", steady {r['steady_tokens_per_s']:.0f}" if r.get("steady_tokens_per_s") else ""
    steady += f", {r['shards']} shards" if r.get("shards") else ""
    steady += f", {r['near_deduplicated']:,} near copies removed" if kind == "near" else ""
    return (f"{kind} {r['size']:>9,}: wall {r['wall_s']:7.1f} s, {r['tokens']:>12,} tokens, {r['tokens_per_s']:8.0f} "
            f"tok/s{steady}; peak PSS driver {r['driver_peak_mib']:6.0f} MiB, cluster {r['cluster_peak_mib']:6.0f} MiB; "
            f"spilled {r['spilled_bytes'] / 2**20:.0f} MiB")


def comparison(kind: str, runs: list[dict]) -> str | None:
    if len(runs) < 2:
        return None
    middle, largest = runs[-2], runs[-1]
    speed = largest["tokens_per_s"] / middle["tokens_per_s"]
    memory = (largest["driver_peak_mib"] + largest["cluster_peak_mib"]) / (middle["driver_peak_mib"] + middle["cluster_peak_mib"])
    return (f"{kind}: largest ({largest['size']:,}) vs middle ({middle['size']:,}) {speed:.2f}x tokens/s, "
            f"peak memory {memory:.2f}x")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--drive"]:
        kind, inputs, model, out, cpus, max_tokens = argv[1:7]
        drive(kind, inputs, model, out, int(cpus), int(max_tokens))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="20000,200000,2000000", help="record counts, comma-separated ('' = none)")
    p.add_argument("--batch", default="5000,50000", help="prompt counts, comma-separated ('' = none)")
    p.add_argument("--near", default="200000,2000000", help="data with near_dedup: record counts ('' = none)")
    p.add_argument("--max-tokens", type=int, default=64, help="batch: output tokens per prompt at most")
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="runs per size, the sizes in alternating order each round")
    p.add_argument("--work", default=None, help="where inputs and outputs go (default: a temporary dir)")
    args = p.parse_args(argv)
    sizes = {k: [int(s) for s in v.split(",") if s]
             for k, v in (("data", args.data), ("near", args.near), ("batch", args.batch))}

    from stack.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        model = str(build_tiny_model(work / "tiny", "tiny", seed=0))
        print(f"set-up: a fresh {args.num_cpus}-CPU Ray per size, started by its driver; the `tiny` model; "
              f"memory as PSS sampled every 0.5 s; sizes {sizes}; batch: at most {args.max_tokens} output tokens "
              "per prompt", flush=True)
        done: dict[str, list[dict]] = {}
        for kind in ("data", "near", "batch"):
            by_size: dict[int, list[dict]] = {size: [] for size in sizes[kind]}
            for i, order in enumerate(round_order(sizes[kind], args.rounds)):
                for size in order:
                    r = run_size(kind, size, work, model, args.num_cpus, args.max_tokens, i)
                    by_size[size].append(r)
                    print(f"round {i + 1}: " + line(kind, r), flush=True)
            done[kind] = [pooled(by_size[size]) for size in sizes[kind] if by_size[size]]
        print(f"\n== scale ({args.rounds} rounds per size, alternating order, pooled; "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')}) ==")
        for kind, runs in done.items():
            for r in runs:
                print(line(kind, r))
        for kind, runs in done.items():
            c = comparison(kind, runs)
            if c:
                print(c)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
