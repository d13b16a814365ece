"""Entry point of the GRPO stage: `python -m pipelines.grpo --config configs/post_train/grpo_tiny.yaml [key=value ...]`.

Loads the YAML into `posttrain.grpo.config.GrpoConfig`, joins the Ray cluster, runs GRPO (posttrain/grpo/stage.py)
and prints the reward and exact match before -> after, where the export is and the registered version, ending with
`result: {...}` (the GrpoResult as JSON). Exit status 2 on a config error, 1 if the run fails.
"""

from __future__ import annotations

import sys

from core.collector import heavy_imports
from core.config import parse_stage_args
from pipelines.stage_run import model_line, run_stage
from posttrain.grpo.config import GrpoConfig


def main(argv: list[str] | None = None) -> int:
    cfg = parse_stage_args(GrpoConfig, __doc__.splitlines()[0], argv)
    with heavy_imports():  # torch, ray, vllm: only after the config parsed (core/collector.py)
        from posttrain.grpo.stage import main as grpo

    return run_stage("grpo", lambda: grpo(cfg), lambda r: [
        f"run        {r.run_name} (MLflow run {r.mlflow_run_id}); {r.steps} updates, {r.prompts_consumed} prompts, "
        f"{r.restarts} restarts",
        f"reward     {r.reward_first:.3f} -> {r.reward_last:.3f}",
        f"exact      {r.exact_match_before} -> {r.exact_match_after}",
        f"export     {r.export_dir}",
        *model_line(r)])


if __name__ == "__main__":
    sys.exit(main())
