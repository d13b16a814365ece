"""Entry point of the DPO stage: `python -m pipelines.dpo --config configs/post_train/<name>.yaml [key=value ...]`.

Loads the YAML into `posttrain.dpo_config.DpoConfig`, then prepares the preference version, scores the reference's
log-probs once, trains with the DPO loss on the shared FSDP2 loop and registers the export
(`posttrain.dpo_stage.main`), ending with `result: {...}` (the DpoResult as JSON). Exit status 2 on a config error.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from core.config import ConfigError, parse_stage_args
from posttrain.dpo_config import DpoConfig


def main(argv: list[str] | None = None) -> int:
    cfg = parse_stage_args(DpoConfig, __doc__.splitlines()[0], argv)
    from posttrain.dpo_stage import main as dpo  # heavy (torch, ray): only after the config parsed

    try:
        result = dpo(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    first = f"{result.first_eval_loss:.4f}" if result.first_eval_loss is not None else "n/a"
    last = f"{result.eval_loss:.4f}" if result.eval_loss is not None else "n/a"
    print(f"run        {result.run_name} (MLflow run {result.mlflow_run_id})")
    print(f"steps      {result.final_step}/{result.total_steps}; eval DPO loss {first} -> {last}")
    print(f"reference  {result.reference_model}; preferences {result.preference_version}")
    print(f"export     {result.export_uri}")
    if result.model_version:
        print(f"model      models:/{result.model_name}/{result.model_version}")
    print("result: " + json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
