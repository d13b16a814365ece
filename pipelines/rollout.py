"""Promotion -> rollout: serve the version an MLflow alias points at (gate, deploy, verify, record, roll back).

    python -m pipelines.rollout --model rayline-tiny [--alias champion] [--watch] [--config configs/rollout/tiny.yaml] [key=value ...]

Without --watch it makes one attempt and exits (what a RayJob runs): 0 when the alias's version is
serving afterwards (deployed or unchanged) or the alias is unset, 1 when it was refused or rolled back.
With --watch it follows the alias until stopped: polling, plus MLflow webhook calls when
`webhook_port` is set. See serve/promotion/rollout.py for the steps and serve/promotion/rollout_record.py for what is recorded.
"""

from __future__ import annotations

import argparse
import logging
import sys

from core.config import ConfigError, load_config
from serve.promotion.deploy_target import DeployError
from serve.promotion.outcome import DEPLOYED, SKIPPED, UNCHANGED, RolloutResult
from serve.promotion.rollout import main
from serve.promotion.rollout_config import Config


def parse_args(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", "-c", help="rollout YAML (serve/promotion/rollout_config.py), e.g. configs/rollout/tiny.yaml")
    p.add_argument("--model", help="registered model name (default: from the serving config's engine.model)")
    p.add_argument("--alias", help="alias to follow (default: champion)")
    p.add_argument("--watch", action="store_true", help="keep following the alias (poll + webhook)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. gate.check_artifacts=false poll_interval_s=5")
    args = p.parse_args(argv)
    overrides = list(args.overrides)
    overrides += [f"model={args.model}"] if args.model else []
    overrides += [f"alias={args.alias}"] if args.alias else []
    overrides += ["watch=true"] if args.watch else []
    try:
        return load_config(Config, args.config, overrides)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None


def cli(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = parse_args(argv)
    try:
        result = main(cfg)
    except (DeployError, LookupError, ConfigError, ValueError) as e:
        print(f"rollout failed: {e}", file=sys.stderr)
        return 1
    results = result if isinstance(result, list) else [result]
    for r in results:
        print(r.line())
    ok = all(r.status in (DEPLOYED, UNCHANGED, SKIPPED) for r in results if isinstance(r, RolloutResult))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(cli())
