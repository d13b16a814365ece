"""Deploy the OpenAI-compatible Ray Serve LLM app from a serving config.

    python -m pipelines.serve --config configs/serve/tiny_cpu.yaml [key=value ...]       deploy, wait until it answers
    python -m pipelines.serve --config configs/serve/tiny_cpu.yaml --render [-o FILE]     print the `serve deploy` config
    python -m pipelines.serve --config configs/serve/tiny_cpu.yaml --delete               remove the app

Deploying resolves `engine.model` (e.g. models:/rayline-tiny@champion) to one version, pins it in the
rendered app and sends that to the Ray dashboard (RAY_ADDRESS) as `serve deploy` would. Later
promotions go through `python -m pipelines.rollout`, which gates, verifies and can roll back.
`--render` works offline: the app it prints resolves the alias when the cluster builds it.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

import yaml

from core.config import ConfigError, load_config
from core.resource_wait import SERVE_REPLICA_PREFIX, ResourceWaitTimeout, ResourceWatch
from serve.promotion import rollout_record as rec
from serve.online.app import render_serve_config, resolve_served_adapters, resolve_served_model, served_model_of
from serve.promotion.deploy_target import DeployError, LocalServe
from serve.online.serve_config import Config
from serve.promotion.verify import admin_key, wait_until_answering, wait_until_healthy


@dataclass
class ServeResult:
    url: str
    """OpenAI base URL clients use."""
    model: str
    """The served version (`name/N`), as responses report it in `system_fingerprint`."""
    seconds: float
    adapters: dict[str, str] = field(default_factory=dict)
    """Adapter name -> the version it answers with (`name/N`)."""


def main(cfg: Config, dashboard_url: str = "", timeout_s: float = 900.0) -> ServeResult:
    """Resolve, render, deploy through the dashboard, and wait until the pinned version answers."""
    start = time.time()
    key = admin_key(cfg)  # what the smoke requests below send; none set fails here, before anything is deployed
    served = resolve_served_model(cfg.engine.model, cfg.model_cache_dir or None)
    adapters = resolve_served_adapters(cfg, served) if cfg.lora.slots else None
    target = LocalServe(cfg.app_name, dashboard_url)
    running = target.current()
    before = served_model_of(running or {})
    target.apply(render_serve_config(cfg, served, adapters, running=running))
    with ResourceWatch("serve", max_wait_s=cfg.max_wait_s, name_prefix=f"{SERVE_REPLICA_PREFIX}{cfg.app_name}#",
                       address=dashboard_url or None):
        healthy = wait_until_healthy(target.state, served, timeout_s, fail_fast=False, applied_at=start)
    if not healthy.ok:
        raise DeployError(f"{target.describe()}: {healthy.reason}")
    answer = wait_until_answering(cfg.base_url(), cfg.served_model_id, served.label, "Hello", 120.0, api_key=key)
    for name, adapter in (adapters or {}).items():
        if answer.ok:
            client = f"{cfg.served_model_id}:{name}"
            answer = wait_until_answering(cfg.base_url(), client, f"{client}@{adapter['label']}", "Hello", 120.0,
                                          field="model", api_key=key)
    if not answer.ok:
        raise DeployError(f"{target.describe()}: {answer.reason}")
    if served.name and served.version:
        previous = before.version if before and before.name == served.name else None
        rec.record_deployed(served.name, served.version, previous, f"pipelines.serve ({rec.default_trigger()})", None)
    return ServeResult(url=cfg.base_url(), model=served.label, seconds=time.time() - start,
                       adapters={name: a["label"] for name, a in (adapters or {}).items()})


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", "-c", required=True, help="serving YAML (serve/online/serve_config.py), e.g. configs/serve/tiny_cpu.yaml")
    p.add_argument("--render", action="store_true", help="print the `serve deploy` config instead of deploying")
    p.add_argument("-o", "--out", help="with --render: write the config here")
    p.add_argument("--delete", action="store_true", help="remove this app from Serve (other apps stay)")
    p.add_argument("--dashboard", default="", help="Ray dashboard URL (default: RAY_ADDRESS)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. engine.max_num_seqs=32")
    args = p.parse_args(argv)
    try:
        cfg = load_config(Config, args.config, args.overrides)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    if args.render:
        text = yaml.safe_dump(render_serve_config(cfg), sort_keys=False)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        else:
            print(text, end="")
        return 0
    if args.delete:
        LocalServe(cfg.app_name, args.dashboard).delete()
        print(f"removed Serve app {cfg.app_name!r}")
        return 0
    try:
        result = main(cfg, args.dashboard)
    # ValueError: an adapter that does not fit; ResourceWaitTimeout: replicas not placed within max_wait_s
    except (DeployError, LookupError, FileNotFoundError, ValueError, ResourceWaitTimeout) as e:
        print(f"serve failed: {e}", file=sys.stderr)
        return 1
    print(f"serving {result.model} as {cfg.served_model_id!r} at {result.url} (ready in {result.seconds:.0f}s)")
    for name, label in result.adapters.items():
        print(f"  adapter {label} as {cfg.served_model_id + ':' + name!r}")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
