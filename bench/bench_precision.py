"""Quality in bfloat16 against float32 (issue 50): the same model, the same eval rows, rayline's engine arguments with
only the dtype changed; exact match of each and whether the difference is within noise.

    python bench/bench_precision.py [--model DIR] [--eval EVAL.jsonl] [--work DIR]

Without --model: the demo's base as the demo builds it (stack.tiny_model `tiny`, pretrained 1,200 steps on plain
text without the eval questions, stack/tiny_pretrain.py) asked each eval question as plain text ("What is 3 +
4?"), its greedy continuation scored against the answer. With --model (a Hugging Face checkpoint dir, e.g. the
demo's fine-tuned champion): each eval row's chat (its messages without the answer) through the model's chat
template. Each dtype runs in a process of its own with `serve.online.engine.runtime_env` and `vllm_engine_kwargs` (what
the batch stage gives vLLM), max 16 tokens, temperature 0, and reads back the dtype the engine ran. Scored with
serve/batch/metrics.exact_match. Noise: the rows the two dtypes score differently (b one way, c the other) decide;
the difference (b - c) / n is within noise when |b - c| <= 2 sqrt(b + c) (McNemar's test at ~95%).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DTYPES = ("float32", "bfloat16")
RESULT = "PRECISION_RESULT "


def answer(model: str, eval_path: str, dtype: str, chat: bool) -> None:
    """In the child: the engine with rayline's arguments at `dtype`, every eval row answered; prints RESULT + JSON."""
    from core.config import from_dict
    from serve.online import engine as eng

    cfg = from_dict(eng.EngineConfig, {"model": model, "accelerator": "cpu", "max_model_len": 256, "max_num_seqs": 32,
                                       "dtype": dtype, "enforce_eager": True, "kv_cache_memory_bytes": 64 * eng.MiB})
    os.environ.update(eng.runtime_env(cfg).get("env_vars", {}))  # before vLLM is imported
    from vllm import LLM, SamplingParams

    rows = [json.loads(line) for line in Path(eval_path).read_text().splitlines() if line.strip()]
    llm = LLM(model=model, **eng.vllm_engine_kwargs(cfg))
    params = SamplingParams(max_tokens=16, temperature=0.0)
    if chat:
        outs = llm.chat([r["messages"][:-1] for r in rows], params, use_tqdm=False)
    else:
        outs = llm.generate([r["messages"][-2]["content"] for r in rows], params, use_tqdm=False)
    ran = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")  # read back from the engine
    print(RESULT + json.dumps({"dtype": ran, "outputs": [o.outputs[0].text for o in outs],
                               "answers": [r["messages"][-1]["content"] for r in rows]}), flush=True)


def run_dtype(model: str, eval_path: str, dtype: str, chat: bool) -> dict:
    cmd = [sys.executable, __file__, "--answer", dtype, "--model", model, "--eval", eval_path] + (["--chat"] if chat else [])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{dtype}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT):])


def compare(runs: dict[str, dict]) -> dict:
    """Exact match per dtype, the rows scored differently each way, and whether the difference is within noise."""
    from serve.batch.metrics import exact_match, normalize

    a, b = (runs[d] for d in DTYPES)
    right = {d: [exact_match(o, ans) for o, ans in zip(runs[d]["outputs"], runs[d]["answers"])] for d in DTYPES}
    n = len(right[DTYPES[0]])
    only_32 = sum(x and not y for x, y in zip(*right.values()))
    only_16 = sum(y and not x for x, y in zip(*right.values()))
    same = sum(normalize(x) == normalize(y) for x, y in zip(a["outputs"], b["outputs"]))
    return {"rows": n, **{f"exact_match {d}": sum(right[d]) / n for d in DTYPES},
            "dtypes read back": f"{a['dtype']}, {b['dtype']}", "right in float32 only": only_32,
            "right in bfloat16 only": only_16, "same output": same / n,
            "within noise": abs(only_32 - only_16) <= 2 * math.sqrt(only_32 + only_16)}


def demo_base(work: Path, eval_path: Path) -> str:
    """The demo's pretrained base (built once under `work`)."""
    out = work / "pretrained"
    if not (out / "config.json").exists():
        from stack import tiny_pretrain
        from stack.tiny_model import build_tiny_model

        base = build_tiny_model(work / "tiny", "tiny", seed=0)
        tiny_pretrain.main(["--model", str(base), "--out", str(out), "--steps", "1200", "--leave-out", str(eval_path)])
    return str(out)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a Hugging Face checkpoint dir; default: the demo's pretrained base")
    p.add_argument("--eval", default=None, help="chat JSONL with answers; default: the sample corpus's eval split")
    p.add_argument("--work", default=str(Path.home() / ".cache" / "rayline" / "bench" / "precision"))
    p.add_argument("--chat", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--answer", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.answer:
        answer(args.model, args.eval, args.answer, args.chat)
        return {}
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.eval is None:
        from stack.sample_corpus import write_corpus

        args.eval = str(write_corpus(work / "corpus", seed=0)["eval"])
    chat = args.model is not None
    model = args.model or demo_base(work, Path(args.eval))
    runs = {d: run_dtype(model, args.eval, d, chat) for d in DTYPES}
    out = compare(runs)
    print(f"model {model} ({'chat template' if chat else 'plain questions'}), {out['rows']} eval rows; the machine is "
          "shared with other agents (quality does not depend on it)")
    for k, v in out.items():
        print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")
    verdict = "within noise" if out["within noise"] else "NOT within noise"
    print(f"bfloat16 vs float32 exact match: {out['exact_match bfloat16']:.3f} vs {out['exact_match float32']:.3f}, "
          f"{verdict}")
    return out


if __name__ == "__main__":
    main()
