"""Data stage throughput against the tokenizer's own batched encode loop, on the same records.

    python bench/bench_data.py [--records 200000] [--files 8] [--size small] [--num-cpus 2]

Generates chat records (user 10-80 words, assistant 20-200 words, half with a system prompt), then
  baseline  the records rendered with the chat template (not timed), then one process running
            `tokenizer(batch, add_special_tokens=False)` over batches of 1,000: the practical limit for
            tokenizing on this machine, with the Rust tokenizer's threads on every core
  rayline   `data.prepare.main` on a fresh local Ray cluster of --num-cpus CPUs: read, validate, clean,
            dedup, render, tokenize, pack and write Parquet + manifest, timed from call to return. A
            2,000-record run first starts Ray's worker processes, as a long-lived cluster would have.
Both count the same tokens (every record is unique and valid). The baseline runs before and after the
stage and the faster of the two counts, so load from other processes cannot flatter the ratio; the
machine's load average is printed with the figures. The last line is the ratio of rates.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipelines.sample_corpus import SYSTEM_PROMPT, WORDS  # noqa: E402
from pipelines.tiny_model import SIZES, train_tokenizer  # noqa: E402


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(WORDS) if rng.random() > 0.1 else str(rng.randint(0, 9999)) for _ in range(rng.randint(lo, hi))]
    return " ".join(words).capitalize() + "."


def write_records(folder: Path, n: int, files: int, seed: int = 0) -> list[list[dict]]:
    """`n` unique chat records spread over `files` JSONL files; returns their message lists."""
    rng = random.Random(seed)
    out = []
    handles = [open(folder / f"part-{i:03d}.jsonl", "w") for i in range(files)]
    for i in range(n):
        messages = [{"role": "user", "content": f"Question {i}: " + sentence(rng, 10, 80)},
                    {"role": "assistant", "content": sentence(rng, 20, 200)}]
        if rng.random() < 0.5:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        handles[i % files].write(json.dumps({"id": f"r{i}", "messages": messages}) + "\n")
        out.append(messages)
    for h in handles:
        h.close()
    return out


def baseline_tokens_per_s(tok, conversations: list[list[dict]], batch: int = 1000) -> tuple[float, int, float]:
    texts = [tok.apply_chat_template(m, tokenize=False) for m in conversations]
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(texts), batch):
        tokens += sum(map(len, tok(texts[i:i + batch], add_special_tokens=False)["input_ids"]))
    wall = time.perf_counter() - t0
    return tokens / wall, tokens, wall


def rayline_run(inputs: str, tokenizer: str, out: str, seq_len: int, num_shards: int):
    from data.config import Config
    from data.prepare import main
    from pipelines.config import from_dict

    cfg = from_dict(Config, {"inputs": [inputs], "output_uri": out, "tokenizer": tokenizer, "format": "chat",
                             "seq_len": seq_len, "packing": "pack", "num_shards": num_shards, "eval_fraction": 0.01})
    t0 = time.perf_counter()
    result = main(cfg)
    return result, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--size", default="small", choices=sorted(SIZES), help="tokenizer vocabulary of this model size")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--num-shards", type=int, default=8)
    p.add_argument("--num-cpus", type=int, default=2)
    args = p.parse_args()
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # measure the stage, not a tracking server

    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="rayline-bench-data-"))
    train_tokenizer(SIZES[args.size].vocab_size).save_pretrained(work / "tokenizer")
    tok = AutoTokenizer.from_pretrained(work / "tokenizer")
    (work / "records").mkdir()
    (work / "warmup").mkdir()
    conversations = write_records(work / "records", args.records, args.files)
    write_records(work / "warmup", 2000, 2, seed=1)
    size_mb = sum(f.stat().st_size for f in (work / "records").iterdir()) / 1e6
    print(f"records: {args.records:,} in {args.files} files ({size_mb:.0f} MB), tokenizer vocab {len(tok):,}")

    print(f"load average before: {os.getloadavg()[0]:.1f}")
    base_rate, base_tokens, base_wall = baseline_tokens_per_s(tok, conversations)
    print(f"tokenizer batch encode: {base_tokens:,} tokens in {base_wall:.1f}s = {base_rate:,.0f} tokens/s")

    import ray

    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})
    rayline_run(str(work / "warmup"), str(work / "tokenizer"), str(work / "out-warmup"), args.seq_len, args.num_shards)
    result, wall = rayline_run(str(work / "records"), str(work / "tokenizer"), str(work / "out"), args.seq_len,
                               args.num_shards)
    tokens = result.splits["train"]["tokens"] + result.splits["eval"]["tokens"]
    rate = tokens / wall
    print(f"rayline data stage: {tokens:,} tokens in {wall:.1f}s = {rate:,.0f} tokens/s "
          f"({result.counts['written_examples']:,} examples, packing efficiency {result.packing_efficiency:.1%})")
    if tokens != base_tokens:
        print(f"note: token counts differ ({tokens:,} vs {base_tokens:,})")
    ray.shutdown()
    again, _, _ = baseline_tokens_per_s(tok, conversations)
    print(f"tokenizer batch encode, again: {again:,.0f} tokens/s; load average after: {os.getloadavg()[0]:.1f}")
    base_rate = max(base_rate, again)
    print(f"baseline (the faster run): {base_rate:,.0f} tokens/s; rayline: {rate:,.0f} tokens/s")
    print(f"rayline vs tokenizer batch encode: {rate / base_rate:.2f}x")


if __name__ == "__main__":
    main()
