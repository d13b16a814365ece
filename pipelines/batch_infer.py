"""Batch inference and evaluation on Ray Data + vLLM: `python -m pipelines.batch_infer --config configs/batch/<name>.yaml [key=value ...]`.

The stage lives in serve/batch/ (pipeline.py has the flow, rows.py the per-row rules, metrics.py the scores,
tracking.py the MLflow side); this entry point parses the config, connects to Ray, and gives the stage the promotion gate's judge
(serve/promotion/gate.py) when the config names a gate.
"""

from __future__ import annotations

from core.config import parse_stage_args
from core.ray_cluster import init_ray
from core.resource_wait import ResourceWaitTimeout
from serve.batch.config import Config
from serve.batch.pipeline import Result, main
from serve.promotion.gate import judge_for


def cli(argv: list[str] | None = None) -> Result:
    cfg = parse_stage_args(Config, __doc__.splitlines()[0], argv)
    init_ray()
    try:
        return main(cfg, judge_for(cfg.gate_config))
    except ResourceWaitTimeout as e:
        raise SystemExit(f"batch_infer failed: {e}") from None


if __name__ == "__main__":
    cli()
