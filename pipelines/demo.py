"""The main job on the embedded local stack: `make demo` runs `python -m pipelines.demo`.

Brings the stack up, writes the sample corpus and the tiny base model, registers the base model in
MLflow, and runs every stage that exists as a Ray job through the Jobs API (as `ray job submit`
would), then prints a summary with the URLs to look at.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipelines import registry, stack
from pipelines.config import from_dict

BASE_MODEL_NAME = "rayline-tiny-base"


@dataclass
class DemoConfig:
    state_dir: str = ".rayline"
    work_dir: str = ".rayline/demo"
    """Where the corpus, the base model and stage outputs go (local disk: the embedded default)."""
    model_name: str = "rayline-tiny"
    """Registered model name of the fine-tuned versions."""
    seed: int = 0
    n_train: int = 4000
    n_eval: int = 200
    stack_overrides: dict[str, int] = field(default_factory=dict)


def step(title: str):
    print(f"\n==> {title}", flush=True)
    return time.time()


def prepare_inputs(cfg: DemoConfig) -> dict[str, Path]:
    """The sample corpus and the tiny base model (built once; both deterministic from the seed)."""
    from pipelines.sample_corpus import write_corpus
    from pipelines.tiny_model import build_tiny_model

    work = Path(cfg.work_dir).resolve()
    corpus = work / "corpus"
    if not (corpus / "eval.jsonl").exists():
        write_corpus(corpus, seed=cfg.seed, n_train=cfg.n_train, n_eval=cfg.n_eval)
    base = work / "base-model"
    if not (base / "model.safetensors").exists():
        build_tiny_model(base, "tiny", seed=cfg.seed)
    return {"corpus": corpus, "base_model": base}


def register_base_model(base: Path) -> str:
    """Register the base model once (a version per distinct checkpoint), alias `base`."""
    existing = registry.get_alias(BASE_MODEL_NAME, "base")
    if existing and existing.tags.get(registry.TAG_CHECKPOINT_URI) == str(base):
        return existing.version
    with registry.start_run("rayline-models", "register-base", tags=registry.lineage_tags("base-model")) as run:
        mv = registry.register_checkpoint(BASE_MODEL_NAME, str(base), run_id=run.info.run_id,
                                          tags={registry.TAG_BASE_MODEL: "random-init tiny llama"})
    registry.set_alias(BASE_MODEL_NAME, "base", mv.version)
    return mv.version


def main(cfg: DemoConfig) -> dict:
    t0 = step("stack up (Ray head, MLflow)")
    scfg = from_dict(stack.StackConfig, {"state_dir": cfg.state_dir, **cfg.stack_overrides}, "demo")
    stack.up(scfg)
    os.environ.update(stack.env_vars(scfg))

    step("sample corpus + tiny base model")
    inputs = prepare_inputs(cfg)
    version = register_base_model(inputs["base_model"])
    print(f"base model registered: models:/{BASE_MODEL_NAME}/{version} (alias @base)")

    summary = {"base_model": f"models:/{BASE_MODEL_NAME}/{version}", "elapsed_s": round(time.time() - t0, 1)}
    print("\n== rayline demo summary ==")
    for k, v in summary.items():
        print(f"  {k:18} {v}")
    for name, url in stack.urls(scfg).items():
        print(f"  {name:18} {url}")
    return summary


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state-dir", default=".rayline")
    args = p.parse_args(argv)
    main(DemoConfig(state_dir=args.state_dir, work_dir=f"{args.state_dir}/demo"))
    return 0


if __name__ == "__main__":
    sys.exit(cli())
