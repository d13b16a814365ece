"""Pretraining for the demo's tiny base model: a plain causal-LM loop (one process, transformers and torch) over
plain text, so the base the demo fine-tunes is a pretrained model, as a real base is.

A random-init base is the wrong start for LoRA: with its small random (tied) embeddings frozen, the largest logit an
adapter can produce is ~2.5 above the rest, so its loss cannot go below ~3.7 on a 512-token vocabulary; on
2026-12-03 a rank-16 adapter on every linear layer stayed at loss ~5 for 900 steps. Pretrained (the demo: 1,200 steps) on
sentences like "What is 3 + 4? 7" (no chat template, the eval questions left out), the base knows the facts but not
the chat format; a full fine-tune or an adapter then teaches it to answer in chat.

`python -m stack.tiny_pretrain --model DIR --out DIR [--steps 600] [--leave-out EVAL.jsonl]` pretrains a model from
stack.tiny_model (the demo runs it so, beside its data stage).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path


def pretrain(model_dir: str | Path, out: str | Path, texts: list[str], steps: int = 600, lr: float = 1e-3,
             seq_len: int = 128, batch_size: int = 8, seed: int = 0, threads: int = 2) -> dict:
    """Train every weight of the model at `model_dir` on `texts` (each ends with EOS, packed into `seq_len` rows),
    AdamW with warm-up and cosine decay; write the model and its tokenizer to `out`. Returns loss and time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if steps < 1 or not texts:
        raise ValueError(f"pretrain needs steps >= 1 and some text, got steps={steps} and {len(texts)} texts")
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = [i for enc in tok(texts)["input_ids"] for i in (*enc, tok.eos_token_id)]
    rows = [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if len(rows) < batch_size:
        raise ValueError(f"pretrain: {len(ids)} tokens make {len(rows)} rows of {seq_len}, fewer than a batch ({batch_size})")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 50)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    rng, start, losses = random.Random(seed), time.time(), []
    model.train()
    for _ in range(steps):
        batch = torch.tensor(rng.sample(rows, batch_size))
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    facts = {"steps": steps, "tokens": steps * batch_size * seq_len, "texts": len(texts), "lr": lr,
             "loss_first": round(losses[0], 4), "loss_last": round(sum(losses[-20:]) / len(losses[-20:]), 4),
             "seconds": round(time.time() - start, 1)}
    kit = Path(model_dir) / "rayline_model.json"  # what stack.tiny_model built, kept beside the new facts
    info = json.loads(kit.read_text()) if kit.exists() else {}
    (out / "rayline_model.json").write_text(json.dumps({**info, "pretrained": facts}))
    return facts


def questions_of(chat_jsonl: str | Path) -> set[str]:
    """The user questions of a chat JSONL file (the sample corpus's eval split): the text pretraining leaves out."""
    return {json.loads(line)["messages"][-2]["content"] for line in Path(chat_jsonl).read_text().splitlines() if line}


def main(argv: list[str] | None = None) -> dict:
    from stack.sample_corpus import plain_text

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model from python -m stack.tiny_model")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--records", type=int, default=20000)
    p.add_argument("--seed", type=int, default=2, help="of the plain text")
    p.add_argument("--train-seed", type=int, default=0, help="of the weights' updates (batches drawn)")
    p.add_argument("--leave-out", default=None, help="a chat JSONL file whose questions the text must not hold")
    args = p.parse_args(argv)
    texts = plain_text(args.records, args.seed, exclude=questions_of(args.leave_out) if args.leave_out else None)
    facts = pretrain(args.model, args.out, texts, steps=args.steps, seed=args.train_seed)
    print(f"pretrained {args.out}: {json.dumps(facts)}")
    return facts


if __name__ == "__main__":
    main()
