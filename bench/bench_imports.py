"""A process's start-up imports with the cycle collector paused and then frozen (core/collector.py) vs plain imports.

    python bench/bench_imports.py [--rounds 3]

Two import sets, each what a kind of rayline process starts with: `replica` (serve/online/llm_hooks.py's: Ray Serve
LLM, vLLM's engine and its OpenAI app; a batch or GRPO engine's are a subset) and `train worker` (train/worker.py's:
torch and transformers' model code). Each side imports the set in a fresh interpreter, the sides in A-B-B-A order over
--rounds: `rayline` inside `core.collector.heavy_imports`, `plain` as Python does by default. Read in the child: the
imports' CPU-seconds (time.process_time), a full collection's CPU-seconds after them (what every later full
collection costs), the collector's state during the imports and the modules loaded; from outside, the whole
process's CPU-seconds (its start and exit included). Each side's set-up is printed; the ratio needs the same Python
and the same modules loaded. The last line is `rayline vs plain import: <ratio>x` for the replica set (the plain
side's import CPU-seconds over rayline's: > 1 is faster).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.equal_terms import print_setups, ratio_line, round_order  # noqa: E402

SETS = {
    "replica": ["ray.serve.llm", "ray.serve.llm.ingress", "ray.llm._internal.serve.core.configs.openai_api_models",
                "vllm.v1.engine.async_llm", "vllm.entrypoints.openai.api_server"],
    "train worker": ["torch", "torch.distributed", "transformers.modeling_utils",
                     "transformers.models.auto.modeling_auto"],
}
OURS, PLAIN = "rayline", "plain"
MUST_MATCH = ("python", "modules loaded")
CHILD = """
import gc, importlib, json, sys, time
mode, modules = sys.argv[1], sys.argv[2].split(",")
start = time.process_time()
if mode == "rayline":
    from core.collector import heavy_imports
    with heavy_imports():
        collector_on = gc.isenabled()
        for name in modules:
            importlib.import_module(name)
else:
    collector_on = gc.isenabled()
    for name in modules:
        importlib.import_module(name)
imports = time.process_time() - start
start = time.process_time()
gc.collect()
collect = time.process_time() - start
own = {"core", "core.collector"}  # what the rayline side imports beyond the set
print("RESULT " + json.dumps({"imports_cpu_s": imports, "collect_cpu_s": collect, "collector on during imports":
      collector_on, "modules loaded": len(set(sys.modules) - own), "frozen objects": gc.get_freeze_count(),
      "python": sys.version.split()[0], "GC thresholds": list(gc.get_threshold())}))
"""


def run_side(mode: str, modules: list[str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-c", CHILD, mode, ",".join(modules)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"{mode} import of {modules} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    result = json.loads(line.removeprefix("RESULT "))
    result["process_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    ratios = {}
    for set_name, modules in SETS.items():
        runs: dict[str, list[dict]] = {OURS: [], PLAIN: []}
        for i, order in enumerate(round_order([OURS, PLAIN], args.rounds)):
            for side in order:
                r = run_side(side, modules)
                runs[side].append(r)
                print(f"{set_name}, round {i + 1}, {side}: imports {r['imports_cpu_s']:.2f} CPU-s, a full collection "
                      f"after {r['collect_cpu_s']:.2f}, the process {r['process_cpu_s']:.2f}", flush=True)
        setups = {side: {k: v for k, v in rs[-1].items() if not k.endswith("_cpu_s")} for side, rs in runs.items()}
        print_setups(setups, title=f"{set_name}: set-up read from the child processes")
        med = {side: {k: statistics.median(r[k] for r in rs) for k in ("imports_cpu_s", "collect_cpu_s",
                                                                         "process_cpu_s")} for side, rs in runs.items()}
        for side, m in med.items():
            print(f"{set_name}, {side} (median of {args.rounds}): imports {m['imports_cpu_s']:.2f} CPU-s, a full "
                  f"collection after {m['collect_cpu_s']:.2f}, the whole process {m['process_cpu_s']:.2f}")
        ratios[set_name] = (med[PLAIN]["imports_cpu_s"] / med[OURS]["imports_cpu_s"], setups)
        print(f"{set_name}: {ratio_line('plain import', ratios[set_name][0], setups[OURS], setups[PLAIN], MUST_MATCH)}")
    ratio, setups = ratios["replica"]
    print(ratio_line("plain import", ratio, setups[OURS], setups[PLAIN], MUST_MATCH))
    return 0


if __name__ == "__main__":
    sys.exit(main())
