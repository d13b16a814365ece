"""Data stage throughput against the Rust tokenizer's own batched encode, same records, same threads.

    python bench/bench_data.py [--records 200000] [--files 8] [--layout plain|zst|small-files] [--size small]
                               [--num-shards 0] [--num-cpus 2] [--rounds 2] [--quick]

Generates chat records (user 10-80 words, assistant 20-200 words, half with a system prompt), then
  baseline  the records rendered with the chat template (not timed), then one process running
            `backend_tokenizer.encode_batch_fast(batch, add_special_tokens=False)` over batches of the stage's
            `tokenize_batch_size`, taking each encoding's ids: the call the stage makes, on the same texts,
            with as many Rust tokenizer threads in all as the stage runs (data.tokens.set_thread_count),
            at the niceness of Ray's workers. This is the practical limit for tokenizing on this machine.
  rayline   `data.prepare.main` on a fresh local Ray cluster of --num-cpus CPUs: read, validate, clean,
            dedup, render, tokenize, pack and write Parquet + manifest, timed from call to return. A
            2,000-record run first starts Ray's worker processes, as a long-lived cluster would have.
--layout says how the same records are stored: `plain` (--files JSONL files), `zst` (those files as .jsonl.zst,
zstd level 3: the stage decompresses them as streams; the baseline's timed run then also reads the same compressed
files, decompressing and splitting them into lines, before it encodes), `small-files` (one JSONL file per
--records-per-file records, 4,000 files at the default 200,000: the stage's reads coalesced; the baseline as plain).
The stage's worker processes live across its runs, as a long-lived cluster's do: from their second task on they
reuse the memory they freed (data/heap.py), as every worker of a job with more shards than CPUs does; each round's
time is printed, the first rayline round's included.
Both count the same tokens (every record is unique and valid). They run --rounds times in A-B-B-A order
(the machine's speed drifts) and are pooled: tokens over seconds. Each side's effective set-up is printed;
the last line is the ratio of rates, given only when the set-ups agree (bench/equal_terms.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.equal_terms import pooled_setup, print_setups, ratio_line, round_order  # noqa: E402
from stack.sample_corpus import SYSTEM_PROMPT, WORDS  # noqa: E402
from stack.tiny_model import SIZES, train_tokenizer  # noqa: E402

RESULT_PREFIX = "BENCH_RESULT "
ENCODE_CALL = "encode_batch_fast(add_special_tokens=False), ids read"  # data.tokens.encode_with_labels' fast path
# "encode call" is shown, not matched: a fixed label on both sides would match by construction.
MUST_MATCH = ["tokenizer threads in all", "niceness", "CPU affinity", "batch size", "tokens"]


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(WORDS) if rng.random() > 0.1 else str(rng.randint(0, 9999)) for _ in range(rng.randint(lo, hi))]
    return " ".join(words).capitalize() + "."


def chat_records(n: int, seed: int = 0):
    """`n` unique, valid chat records' message lists, made one at a time."""
    rng = random.Random(seed)
    for i in range(n):
        messages = [{"role": "user", "content": f"Question {i}: " + sentence(rng, 10, 80)},
                    {"role": "assistant", "content": sentence(rng, 20, 200)}]
        if rng.random() < 0.5:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        yield messages


def write_records(folder: Path, n: int, files: int, seed: int = 0, codec: str | None = None) -> list[list[dict]]:
    """`n` unique chat records spread over `files` JSONL files (compressed with `codec`, e.g. zstd); returns their
    message lists."""
    import pyarrow as pa

    out = []
    suffix = {None: ".jsonl", "zstd": ".jsonl.zst", "gzip": ".jsonl.gz"}[codec]
    handles = [pa.output_stream(str(folder / f"part-{i:05d}{suffix}"), compression=codec) for i in range(files)]
    for i, messages in enumerate(chat_records(n, seed)):
        handles[i % files].write((json.dumps({"id": f"r{i}", "messages": messages}) + "\n").encode())
        out.append(messages)
    for h in handles:
        h.close()
    return out


def read_compressed(folder: Path) -> int:
    """What a reader of the compressed files does before tokenizing: stream-decompress each and split it into lines
    (pyarrow's codec, as the stage uses); returns the lines read."""
    import pyarrow as pa

    lines = 0
    for path in sorted(folder.iterdir()):
        with pa.input_stream(str(path), compression="detect") as f:
            rest = b""
            while chunk := f.read(8 << 20):
                parts = (rest + chunk).split(b"\n")
                rest = parts.pop()
                lines += len(parts)
    return lines


def baseline_worker(texts_path: str, backend_path: str, threads: int, batch: int, compressed: str = "") -> None:
    """One baseline run in this process (started by `run_baseline`); prints its result and set-up as JSON. With
    `compressed` (a folder), the timed run first reads those compressed files."""
    import psutil

    from data.tokens import load_backend, set_thread_count

    set_thread_count(threads)  # before the first batch call, as the stage's tasks do
    backend = load_backend(Path(backend_path).read_text())
    texts = json.loads(Path(texts_path).read_text())
    t0 = time.perf_counter()
    if compressed:
        read_compressed(Path(compressed))
    tokens = 0
    for i in range(0, len(texts), batch):
        tokens += sum(len(e.ids) for e in backend.encode_batch_fast(texts[i:i + batch], add_special_tokens=False))
    wall = time.perf_counter() - t0
    setup = {"processes tokenizing": 1, "tokenizer threads per process": int(os.environ["RAYON_NUM_THREADS"]),
             "tokenizer threads in all": int(os.environ["RAYON_NUM_THREADS"]),
             "TOKENIZERS_PARALLELISM": os.environ["TOKENIZERS_PARALLELISM"],
             "OS threads after encoding": psutil.Process().num_threads(),
             "niceness": os.getpriority(os.PRIO_PROCESS, 0), "CPU affinity": len(os.sched_getaffinity(0)),
             "encode call": ENCODE_CALL, "batch size": batch, "tokens": tokens,
             "reads the compressed files": bool(compressed)}
    print(RESULT_PREFIX + json.dumps({"tokens": tokens, "wall": wall, "setup": setup}), flush=True)


def run_baseline(texts_path: Path, backend_path: Path, threads: int, batch: int, nice: int, compressed: str = "") -> dict:
    """The baseline in a fresh process at niceness `nice`, so its Rust thread pool starts with `threads`."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--baseline-worker", str(texts_path), str(backend_path),
           str(threads), str(batch), compressed]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAYON_NUM_THREADS", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800,
                          preexec_fn=lambda: os.nice(nice - os.getpriority(os.PRIO_PROCESS, 0)))
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"baseline failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def stage_config(inputs: str, tokenizer: str, out: str, seq_len: int, num_shards: int):
    from data.config import Config
    from core.config import from_dict

    return from_dict(Config, {"inputs": [inputs], "output_uri": out, "tokenizer": tokenizer, "format": "chat",
                              "seq_len": seq_len, "packing": "pack", "num_shards": num_shards, "eval_fraction": 0.01})


def rayline_run(cfg):
    from data.prepare import main

    t0 = time.perf_counter()
    result = main(cfg)
    return result, time.perf_counter() - t0


def stage_setup(cfg, tokens: int, manifest: dict | None = None) -> dict:
    """The stage's tokenizing layout: CPUs, niceness and affinity read back from the running cluster and
    one of its workers; shards and threads per task as the run's manifest records them (`built_with`), or
    before a run as the stage plans them for `cfg`'s input on the idle cluster (data.prepare); tasks at once
    as Ray fits them on the CPUs."""
    import ray

    from data.config import shard_count
    from data.examples import TRAIN
    from data.prepare import _task_threads
    from data.sources import discover
    from core.ray_cluster import node_free_cpus

    cpus = float(ray.cluster_resources()["CPU"])
    if manifest:
        shards, threads = manifest["num_shards"], manifest["built_with"]["tokenizer_threads_per_shard"]
    else:
        deadline = time.monotonic() + 10  # Ray's view of free CPUs lags the last run's tasks by a moment
        while node_free_cpus() < cpus and time.monotonic() < deadline:
            time.sleep(0.2)
        shards = shard_count(cfg, sum(f.size for f in discover(cfg.inputs, cfg.file_format, TRAIN, "inputs")))
        threads = _task_threads(cpus, shards, node_free_cpus())
    at_once = min(shards, int(cpus // threads))

    @ray.remote(num_cpus=threads)
    def probe():
        return os.getpriority(os.PRIO_PROCESS, 0), len(os.sched_getaffinity(0))

    niceness, affinity = ray.get(probe.remote())
    return {"Ray CPUs": cpus, "shards": shards, "processes tokenizing": at_once, "tokenizer threads per process": threads,
            "tokenizer threads in all": threads * at_once, "niceness": niceness, "CPU affinity": affinity,
            "encode call": ENCODE_CALL, "batch size": cfg.tokenize_batch_size, "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--layout", default="plain", choices=["plain", "zst", "small-files"])
    p.add_argument("--records-per-file", type=int, default=50, help="small-files: records per file")
    p.add_argument("--size", default="small", choices=sorted(SIZES), help="tokenizer vocabulary of this model size")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--num-shards", type=int, default=0, help="the stage's num_shards (0, its default: by input size)")
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="runs per side, in A-B-B-A order, pooled")
    p.add_argument("--quick", action="store_true", help="a smoke run: 20,000 records, 2 rounds")
    p.add_argument("--baseline-worker", nargs=5, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.baseline_worker:
        texts, backend, threads, batch, compressed = args.baseline_worker
        baseline_worker(texts, backend, int(threads), int(batch), compressed)
        return
    if args.quick:
        args.records, args.files, args.rounds = 20_000, 4, 2
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # measure the stage, not a tracking server

    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="rayline-bench-data-"))
    try:
        train_tokenizer(SIZES[args.size].vocab_size).save_pretrained(work / "tokenizer")
        tok = AutoTokenizer.from_pretrained(work / "tokenizer")
        (work / "records").mkdir()
        (work / "warmup").mkdir()
        files = -(-args.records // args.records_per_file) if args.layout == "small-files" else args.files
        codec = "zstd" if args.layout == "zst" else None
        conversations = write_records(work / "records", args.records, files, codec=codec)
        write_records(work / "warmup", 2000, 2, seed=1, codec=codec)
        size_mb = sum(f.stat().st_size for f in (work / "records").iterdir()) / 1e6
        print(f"records: {args.records:,} in {files:,} files ({size_mb:.0f} MB as stored, layout {args.layout}), "
              f"tokenizer vocab {len(tok):,}")
        texts_path, backend_path = work / "texts.json", work / "backend.json"
        texts_path.write_text(json.dumps([tok.apply_chat_template(m, tokenize=False) for m in conversations]))
        backend_path.write_text(tok.backend_tokenizer.to_str())
        del conversations
        measure(args, work, texts_path, backend_path)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(args, work: Path, texts_path: Path, backend_path: Path) -> None:
    import ray

    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        rayline_run(stage_config(str(work / "warmup"), str(work / "tokenizer"), str(work / "out-warmup"),
                                 args.seq_len, args.num_shards))
        plan = stage_setup(stage_config(str(work / "records"), str(work / "tokenizer"), str(work / "out"), args.seq_len,
                                        args.num_shards), 0)
        runs: dict[str, list[dict]] = {"rayline": [], "baseline": []}
        for i, order in enumerate(round_order(["baseline", "rayline"], args.rounds)):
            for side in order:
                load = os.getloadavg()[0]
                if side == "baseline":
                    r = run_baseline(texts_path, backend_path, plan["tokenizer threads in all"], plan["batch size"],
                                     plan["niceness"], str(work / "records") if args.layout == "zst" else "")
                else:
                    out = work / f"out-{i}"
                    cfg = stage_config(str(work / "records"), str(work / "tokenizer"), str(out), args.seq_len,
                                       args.num_shards)
                    result, wall = rayline_run(cfg)
                    tokens = result.splits["train"]["tokens"] + result.splits["eval"]["tokens"]
                    r = {"tokens": tokens, "wall": wall, "packing": result.packing_efficiency,
                         "setup": stage_setup(cfg, tokens, result.manifest)}
                    shutil.rmtree(out, ignore_errors=True)
                runs[side].append(r)
                print(f"round {i + 1} {side:8}: {r['tokens']:,} tokens in {r['wall']:.1f}s = "
                      f"{r['tokens'] / r['wall']:,.0f} tokens/s (load average before {load:.1f})", flush=True)
    finally:
        ray.shutdown()

    rates = {side: sum(r["tokens"] for r in rs) / sum(r["wall"] for r in rs) for side, rs in runs.items()}
    setups = {"rayline data stage": pooled_setup(runs["rayline"]),
              "tokenizer encode_batch_fast": pooled_setup(runs["baseline"])}
    print(f"\nlayout {args.layout}; {args.rounds} rounds per side, A-B-B-A, pooled; packing efficiency "
          f"{runs['rayline'][-1]['packing']:.1%}; {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print_setups(setups)
    print(f"baseline: {rates['baseline']:,.0f} tokens/s; rayline: {rates['rayline']:,.0f} tokens/s")
    print(ratio_line("tokenizer encode_batch_fast", rates["rayline"] / rates["baseline"],
                     *setups.values(), MUST_MATCH))


if __name__ == "__main__":
    main()
