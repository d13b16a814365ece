"""Entry point of the DPO stage: `python -m pipelines.dpo --config configs/post_train/<name>.yaml [key=value ...]`.

Loads the YAML into `posttrain.dpo_config.DpoConfig`, then prepares the preference version, scores the reference's
log-probs once, trains with the DPO loss on the shared FSDP2 loop and registers the export
(`posttrain.dpo_stage.main`), ending with `result: {...}` (the DpoResult as JSON). Exit status 2 on a config error.
"""

from __future__ import annotations

import sys

from core.collector import heavy_imports
from core.config import parse_stage_args
from pipelines.stage_run import losses, model_line, run_stage
from posttrain.dpo_config import DpoConfig


def main(argv: list[str] | None = None) -> int:
    cfg = parse_stage_args(DpoConfig, __doc__.splitlines()[0], argv)
    with heavy_imports():  # torch, ray: only after the config parsed (core/collector.py)
        from posttrain.dpo_stage import main as dpo

    return run_stage("dpo", lambda: dpo(cfg), lambda r: [
        f"run        {r.run_name} (MLflow run {r.mlflow_run_id})",
        f"steps      {r.final_step}/{r.total_steps}; eval DPO loss {losses(r.first_eval_loss, r.eval_loss)}; "
        f"eval preference accuracy {'n/a' if r.eval_preference_accuracy is None else f'{r.eval_preference_accuracy:.3f}'}",
        f"reference  {r.reference_model}; preferences {r.preference_version}",
        f"export     {r.export_uri}",
        *model_line(r)])


if __name__ == "__main__":
    sys.exit(main())
