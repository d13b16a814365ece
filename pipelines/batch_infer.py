"""Batch inference and evaluation on Ray Data + vLLM: `python -m pipelines.batch_infer --config configs/batch/<name>.yaml [key=value ...]`.

The stage lives in serve/batch/ (pipeline.py has the flow, rows.py the per-row rules, metrics.py the scores,
tracking.py the MLflow side); this entry point only parses the config and connects to Ray.
"""

from __future__ import annotations

from pipelines.config import parse_stage_args
from pipelines.ray_cluster import init_ray
from pipelines.resource_wait import ResourceWaitTimeout
from serve.batch.config import Config
from serve.batch.pipeline import Result, main


def cli(argv: list[str] | None = None) -> Result:
    cfg = parse_stage_args(Config, __doc__.splitlines()[0], argv)
    init_ray()
    try:
        return main(cfg)
    except ResourceWaitTimeout as e:
        raise SystemExit(f"batch_infer failed: {e}") from None


if __name__ == "__main__":
    cli()
