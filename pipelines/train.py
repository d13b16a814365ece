"""Entry point of the train stage: `python -m pipelines.train --config configs/train/<name>.yaml [key=value ...]`.

Loads the YAML into `train.config.TrainConfig`, joins the Ray cluster, checks the config against the
dataset, model and cluster (failing before any worker starts, naming the field), then runs or resumes
the FSDP2 job with `train.trainer.main` and prints where the checkpoints, export and model version are,
ending with `result: {...}` (the TrainResult as JSON). Exit status 2 on a config error, 1 if training fails.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from core.config import ConfigError, parse_stage_args
from core.resource_wait import ResourceWaitTimeout
from train.config import TrainConfig


def main(argv: list[str] | None = None) -> int:
    cfg = parse_stage_args(TrainConfig, __doc__.splitlines()[0], argv)
    from train.trainer import main as train  # heavy (torch, ray): only after the config parsed

    try:
        result = train(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except ResourceWaitTimeout as e:
        print(f"train failed: {e}", file=sys.stderr)
        return 1
    first = f"{result.first_eval_loss:.4f}" if result.first_eval_loss is not None else "n/a"
    last = f"{result.eval_loss:.4f}" if result.eval_loss is not None else "n/a"
    print(f"run        {result.run_name} (MLflow run {result.mlflow_run_id})")
    print(f"steps      {result.final_step}/{result.total_steps}; eval loss {first} -> {last}")
    print(f"checkpoint {result.checkpoint_uri}")
    print(f"export     {result.export_uri}")
    if result.model_version:
        print(f"model      models:/{result.model_name}/{result.model_version}")
    print("result: " + json.dumps(asdict(result)))  # one line for scripts (the demo, tests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
