"""Entry point of the train stage: `python -m pipelines.train --config configs/train/<name>.yaml [key=value ...]`.

Loads the YAML into `train.config.TrainConfig`, joins the Ray cluster, checks the config against the
dataset, model and cluster (failing before any worker starts, naming the field), then runs or resumes
the FSDP2 job with `train.trainer.main` and prints where the checkpoints, export and model version are,
ending with `result: {...}` (the TrainResult as JSON). Exit status 2 on a config error, 1 if training fails.
"""

from __future__ import annotations

import sys

from core.collector import heavy_imports
from core.config import parse_stage_args
from pipelines.stage_run import losses, model_line, run_stage
from train.config import TrainConfig


def main(argv: list[str] | None = None) -> int:
    cfg = parse_stage_args(TrainConfig, __doc__.splitlines()[0], argv)
    with heavy_imports():  # torch, ray: only after the config parsed (core/collector.py)
        from train.trainer import main as train

    return run_stage("train", lambda: train(cfg), lambda r: [
        f"run        {r.run_name} (MLflow run {r.mlflow_run_id})",
        f"steps      {r.final_step}/{r.total_steps}; eval loss {losses(r.first_eval_loss, r.eval_loss)}",
        f"goodput    {r.goodput:.2f} (productive step time over the job's wall time)" if r.goodput is not None
        else "goodput    n/a",
        f"checkpoint {r.checkpoint_uri}",
        f"export     {r.export_uri}",
        *model_line(r)])


if __name__ == "__main__":
    sys.exit(main())
