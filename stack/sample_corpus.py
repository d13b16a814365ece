"""A generated instruction corpus with checkable answers, deterministic from a seed.

`python -m stack.sample_corpus --out DIR [--seed 0] [--n-train 4000] [--n-eval 200]` writes
  DIR/train.jsonl      chat records {"id", "task", "messages": [system?, user, assistant]}
  DIR/eval.jsonl       the same shape, disjoint ids and questions, for eval loss and exact match
  DIR/malformed.jsonl  deliberately broken records (bad JSON, wrong types, empty text, invalid UTF-8, ...)
Every task has one exact answer (parity, successor, comparison, small sums, copying), so exact-match
accuracy measures whether fine-tuning did real work: a random-init model scores 0.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM_PROMPT = "Answer with the answer only."
WORDS = (
    "apple kiwi lemon mango pear plum grape melon berry cherry river stone cloud light storm "
    "green blue red amber ivory north south east west quick slow bright quiet brave"
).split()


def _parity(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(0, 999)
    return f"Is {n} even or odd?", "even" if n % 2 == 0 else "odd"


def _successor(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(0, 998)
    return f"What number comes after {n}?", str(n + 1)


def _larger(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(range(100), 2)
    return f"Which is larger, {a} or {b}?", str(max(a, b))


def _sum(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"What is {a} + {b}?", str(a + b)


def _copy(rng: random.Random) -> tuple[str, str]:
    phrase = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
    return f"Repeat exactly: {phrase}", phrase


TASKS = {"parity": _parity, "successor": _successor, "larger": _larger, "sum": _sum, "copy": _copy}


def make_records(n: int, seed: int, prefix: str, exclude: set[str] | None = None) -> list[dict]:
    """`n` chat records drawn round-robin over the tasks; questions in `exclude` are skipped (no eval leak)."""
    rng = random.Random(seed)
    names = sorted(TASKS)
    out: list[dict] = []
    seen = set(exclude or ())
    attempts = 0
    while len(out) < n and attempts < n * 50:
        attempts += 1
        task = names[len(out) % len(names)]
        question, answer = TASKS[task](rng)
        if exclude is not None and question in seen:
            continue
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if rng.random() < 0.5:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        out.append({"id": f"{prefix}-{len(out):06d}", "task": task, "messages": messages})
    return out


def malformed_lines() -> list[bytes]:
    """Broken records, one per line, each a different way real corpora go wrong."""
    good = {"role": "user", "content": "What is 1 + 1?"}
    return [
        b'{"id": "bad-json", "messages": [',  # truncated JSON
        json.dumps({"id": "no-messages", "text": "hello"}).encode(),
        json.dumps({"id": "messages-not-list", "messages": "What is 2 + 2?"}).encode(),
        json.dumps({"id": "empty-assistant-text", "messages": [good, {"role": "assistant", "content": "  "}]}).encode(),
        json.dumps({"id": "content-not-string", "messages": [good, {"role": "assistant", "content": 4}]}).encode(),
        json.dumps({"id": "unknown-role", "messages": [{"role": "robot", "content": "hi"}]}).encode(),
        b'{"id": "invalid-utf8", "messages": [{"role": "user", "content": "caf\xe9"}]}',
        json.dumps({"id": "no-assistant", "messages": [good]}).encode(),
        json.dumps({"id": "over-length", "messages": [good, {"role": "assistant", "content": "x " * 20000}]}).encode(),
        b"[1, 2, 3]",  # valid JSON, not an object
    ]


def write_corpus(out: str | Path, seed: int = 0, n_train: int = 4000, n_eval: int = 200) -> dict[str, Path]:
    """Write train/eval/malformed JSONL files under `out`; returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    eval_records = make_records(n_eval, seed + 1, "eval")
    eval_questions = {r["messages"][-2]["content"] for r in eval_records}
    train_records = make_records(n_train, seed, "train", exclude=eval_questions)
    paths = {"train": out / "train.jsonl", "eval": out / "eval.jsonl", "malformed": out / "malformed.jsonl"}
    for split, records in (("train", train_records), ("eval", eval_records)):
        paths[split].write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    paths["malformed"].write_bytes(b"\n".join(malformed_lines()) + b"\n")
    return paths


def plain_text(n: int, seed: int, exclude: set[str] | None = None) -> list[str]:
    """Each record's question and answer as one plain sentence, no chat template (pretraining text for the demo's
    base: it knows the facts but not the chat format); questions in `exclude` are left out (no eval leak)."""
    return [f"{r['messages'][-2]['content']} {r['messages'][-1]['content']}"
            for r in make_records(n, seed, "plain", exclude=exclude or set())]


def corpus_text(seed: int = 0, n: int = 2000) -> list[str]:
    """Plain text of the corpus (for training the tiny tokenizer)."""
    return [m["content"] for r in make_records(n, seed, "tok") for m in r["messages"]]


def main(argv: list[str] | None = None) -> dict[str, Path]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-train", type=int, default=4000)
    p.add_argument("--n-eval", type=int, default=200)
    args = p.parse_args(argv)
    paths = write_corpus(args.out, args.seed, args.n_train, args.n_eval)
    for split, path in paths.items():
        print(f"{split}: {path}")
    return paths


if __name__ == "__main__":
    main()
