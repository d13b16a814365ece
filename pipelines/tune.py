"""Entry point of the tune stage: `python -m pipelines.tune --config configs/tune/<name>.yaml [key=value ...]`.

Loads `train.tune_config.TuneConfig` (which loads and checks the train config it starts from), sizes
max_concurrent_trials from the cluster (refusing a search that cannot fit, with the arithmetic), runs
the ASHA search with `train.tune.main` and prints each trial and the registered best, ending with
`result: {...}` (the TuneResult as JSON). Exit status 2 on a config error or a search that cannot fit.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from core.config import ConfigError, parse_stage_args
from core.resource_wait import ResourceWaitTimeout
from train.tune_config import TuneConfig


def main(argv: list[str] | None = None) -> int:
    cfg = parse_stage_args(TuneConfig, __doc__.splitlines()[0], argv)
    from train.tune import main as tune  # heavy (torch, ray): only after the config parsed

    try:
        result = tune(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except ResourceWaitTimeout as e:
        print(f"tune failed: {e}", file=sys.stderr)
        return 1
    print(f"search   {result.search_name} (MLflow parent run {result.parent_run_id})")
    print(f"capacity {result.max_concurrent_trials} trial(s) at a time: {result.capacity}")
    for t in result.trials:
        state = "finished" if t.finished else f"stopped at step {t.step}"
        metric = f"{t.metric:.4f}" if t.metric is not None else "n/a"
        print(f"  trial {t.trial_id}: {cfg.metric} {metric} ({state}) {t.sampled}")
    if result.best:
        print(f"best     {result.best.trial_id} {cfg.metric} {result.best.metric:.4f}")
    if result.model_version:
        print(f"model    models:/{result.model_name}/{result.model_version}")
    print("result: " + json.dumps(asdict(result)))  # one line for scripts (the demo, tests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
