"""The tiny policy GRPO's tests and bench start from: stack/tiny_model.py's model, trained briefly
(stack/tiny_pretrain.py's loop) on the sample corpus's chat records of one task, rendered with the chat template,
so it answers in the chat format and is right on part of the questions: a fine-tuned start that GRPO has room to
improve, made in seconds instead of the demo's minutes of pretraining and fine-tuning."""

from __future__ import annotations

import json
from pathlib import Path


def chat_records(n: int, seed: int, tasks: tuple[str, ...]) -> list[dict]:
    """`n` sample-corpus chat records of `tasks`."""
    from stack.sample_corpus import make_records

    return [r for r in make_records(n * 5, seed, "warm") if r["task"] in tasks][:n]


def warm_policy(out: str | Path, steps: int = 400, tasks: tuple[str, ...] = ("sum",), seed: int = 0,
                threads: int = 2) -> Path:
    """Build the tiny model at `out`/base and train it `steps` steps on chat-rendered records of `tasks` into
    `out`/policy (written once; reused when present). Returns the policy's directory."""
    from transformers import AutoTokenizer

    from stack.tiny_model import build_tiny_model
    from stack.tiny_pretrain import pretrain

    out = Path(out)
    policy = out / "policy"
    if (policy / "model.safetensors").exists():
        return policy
    base = build_tiny_model(out / "base", "tiny", seed=seed)
    tok = AutoTokenizer.from_pretrained(base)
    texts = [tok.apply_chat_template(r["messages"], tokenize=False) for r in chat_records(2000, seed, tasks)]
    facts = pretrain(base, policy, texts, steps=steps, lr=2e-3, seq_len=128, batch_size=8, seed=seed, threads=threads)
    (policy / "warm_start.json").write_text(json.dumps({"tasks": list(tasks), **facts}))
    return policy


def write_prompts(path: str | Path, n: int, seed: int, tasks: tuple[str, ...] = ("sum",)) -> Path:
    """`n` chat records of `tasks` as JSONL (GRPO's prompt file: the reference answer is the assistant's)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in chat_records(n, seed, tasks)))
    return path
