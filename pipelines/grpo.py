"""Entry point of the GRPO stage: `python -m pipelines.grpo --config configs/post_train/grpo_tiny.yaml [key=value ...]`.

Loads the YAML into `posttrain.grpo.config.GrpoConfig`, joins the Ray cluster, runs GRPO (posttrain/grpo/stage.py)
and prints the reward and exact match before -> after, where the export is and the registered version, ending with
`result: {...}` (the GrpoResult as JSON). Exit status 2 on a config error, 1 if the run fails.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from core.config import ConfigError, parse_stage_args
from posttrain.grpo.config import GrpoConfig


def main(argv: list[str] | None = None) -> int:
    cfg = parse_stage_args(GrpoConfig, __doc__.splitlines()[0], argv)
    from posttrain.grpo.stage import main as grpo  # heavy (torch, ray, vllm): only after the config parsed

    try:
        result = grpo(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(f"run        {result.run_name} (MLflow run {result.mlflow_run_id}); {result.steps} updates, "
          f"{result.prompts_consumed} prompts, {result.restarts} restarts")
    print(f"reward     {result.reward_first:.3f} -> {result.reward_last:.3f}")
    print(f"exact      {result.exact_match_before} -> {result.exact_match_after}")
    print(f"export     {result.export_dir}")
    if result.model_version:
        print(f"model      models:/{result.model_name}/{result.model_version}")
    print("result: " + json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
