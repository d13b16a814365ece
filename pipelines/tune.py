"""Entry point of the tune stage: `python -m pipelines.tune --config configs/tune/<name>.yaml [key=value ...]`.

Loads `posttrain.tune_config.PostTrainTuneConfig` (which loads and checks the config it starts from: a train
config, or a DPO or GRPO config with `post_train_config`), sizes max_concurrent_trials from the cluster (refusing a
search that cannot fit, with the arithmetic), runs the ASHA search with `train.tune.main` (for a DPO base
`posttrain.dpo_tune.main`, which scores the preference version once first; for a GRPO base
`posttrain.grpo_tune.main`, each trial a GRPO run) and prints each trial and the registered best, ending with `result: {...}` (the TuneResult as JSON). Exit status 2 on a config error or a search
that cannot fit.
"""

from __future__ import annotations

import sys

from core.collector import heavy_imports
from core.config import parse_stage_args
from pipelines.stage_run import run_stage
from posttrain.tune_config import PostTrainTuneConfig


def main(argv: list[str] | None = None) -> int:
    cfg = parse_stage_args(PostTrainTuneConfig, __doc__.splitlines()[0], argv)
    with heavy_imports():  # torch, ray: only after the config parsed (core/collector.py)
        if cfg.post_train_stage() == "grpo":
            from posttrain.grpo_tune import main as tune
        elif cfg.post_train_config:
            from posttrain.dpo_tune import main as tune
        else:
            from train.tune import main as tune

    def summary(r) -> list[str]:
        lines = [f"search   {r.search_name} (MLflow parent run {r.parent_run_id})",
                 f"capacity {r.max_concurrent_trials} trial(s) at a time: {r.capacity}",
                 *(f"lineage  {k} = {v}" for k, v in r.lineage.items())]
        for t in r.trials:
            state = "finished" if t.finished else f"stopped at step {t.step}"
            metric = f"{t.metric:.4f}" if t.metric is not None else "n/a"
            lines.append(f"  trial {t.trial_id}: {cfg.metric} {metric} ({state}) {t.sampled}")
        if r.best:
            lines.append(f"best     {r.best.trial_id} {cfg.metric} {r.best.metric:.4f}")
        if r.model_version:
            lines.append(f"model    models:/{r.model_name}/{r.model_version}")
        return lines

    return run_stage("tune", lambda: tune(cfg), summary)


if __name__ == "__main__":
    sys.exit(main())
