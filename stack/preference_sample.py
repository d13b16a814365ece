"""Sample preference pairs from the sample corpus (stack/sample_corpus.py), for the tiny config and the tests.

`python -m stack.preference_sample --out DIR [--seed 0] [--n-train 400] [--n-eval 50]` writes DIR/train.jsonl and
DIR/eval.jsonl: each record is a corpus question with chosen = its exact answer and rejected = the answer of another
question of the same task (a plausible wrong answer: another number, another word). On a real chain the pairs come
from the flywheel instead (posttrain/dpo_flywheel.py: a version's own wrong answers in a batch eval).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from stack.sample_corpus import make_records


def preference_records(n: int, seed: int, prefix: str, exclude: set[str] | None = None) -> list[dict]:
    """`n` pairs over `n` corpus records (questions in `exclude` skipped)."""
    records = make_records(n, seed, prefix, exclude)
    answers: dict[str, list[str]] = {}
    for r in records:
        answers.setdefault(r["task"], []).append(r["messages"][-1]["content"])
    rng = random.Random(seed + 1)
    out = []
    for r in records:
        answer = r["messages"][-1]["content"]
        wrong = sorted({a for a in answers[r["task"]] if a != answer})
        if wrong:
            out.append({"id": r["id"], "task": r["task"], "messages": r["messages"][:-1], "chosen": answer,
                        "rejected": rng.choice(wrong)})
    return out


def write_preferences(out: str | Path, seed: int = 0, n_train: int = 400, n_eval: int = 50) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    evals = preference_records(n_eval, seed + 1000, "pref-eval")
    train = preference_records(n_train, seed, "pref-train", exclude={r["messages"][-1]["content"] for r in evals})
    for name, records in (("train", train), ("eval", evals)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-train", type=int, default=400)
    p.add_argument("--n-eval", type=int, default=50)
    a = p.parse_args()
    print(write_preferences(a.out, a.seed, a.n_train, a.n_eval))
