"""serve/online/routing_config.py: the request router is a serving option, checked, and rendered onto the engine deployment
(the running app's router: tests/serve/test_ingress_deployment.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from core.config import ConfigError, load_config
from serve.online.app import render_serve_config
from serve.online.routing_config import PREFIX_ROUTER, RoutingConfig
from serve.online.serve_config import Config

PREFIX = ["routing.policy=prefix_cache_affinity", "ingress=deployment"]


def test_the_default_is_serves_own_router():
    cfg = load_config(Config, "configs/serve/tiny_cpu.yaml")
    assert cfg.routing == RoutingConfig() and cfg.routing.to_serve() == {}


def test_prefix_affinity_renders_rays_public_router_with_its_thresholds():
    cfg = load_config(Config, "configs/serve/tiny_cpu.yaml", PREFIX + ["routing.imbalanced_threshold=4"])
    assert cfg.routing.to_serve() == {"request_router_config": {
        "request_router_class": "ray.serve.llm.request_router.PrefixCacheAffinityRouter",
        "request_router_kwargs": {"imbalanced_threshold": 4.0, "match_rate_threshold": 0.1}}}
    # Serve takes it as given (its own config model).
    from ray.serve.config import RequestRouterConfig

    RequestRouterConfig(**cfg.routing.to_serve()["request_router_config"])


def test_prefix_affinity_needs_the_ingress_deployment():
    with pytest.raises(ConfigError, match="routing.policy.*ingress: deployment"):
        load_config(Config, "configs/serve/tiny_cpu.yaml", ["routing.policy=prefix_cache_affinity"])


@pytest.mark.parametrize(("key", "value"), [("policy", "round_robin"), ("imbalanced_threshold", "0"),
                                            ("match_rate_threshold", "1.5")])
def test_bad_routing_values_are_named(key, value):
    with pytest.raises(ConfigError, match=f"routing.{key}"):
        load_config(Config, "configs/serve/tiny_cpu.yaml", PREFIX + [f"routing.{key}={value}"])


def test_the_option_travels_in_the_rendered_app_and_so_in_a_rayservice():
    # serveConfigV2 carries the whole serving config in the app's args; the cluster's build_app renders it.
    import yaml

    from rayjobs import render

    cfg = load_config(Config, "configs/serve/gpu_example.yaml", PREFIX)
    assert render_serve_config(cfg)["applications"][0]["args"]["config"]["routing"]["policy"] == "prefix_cache_affinity"
    doc = render.render("serve", "configs/serve/gpu_example.yaml", render.load_profile(None), PREFIX)
    assert doc["kind"] == "RayService"
    app = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]
    assert app["args"]["config"]["routing"] == {"policy": "prefix_cache_affinity", "imbalanced_threshold": 8.0,
                                                "match_rate_threshold": 0.1}


@pytest.mark.slow  # imports vLLM through ray.serve.llm
def test_the_engine_deployment_gets_the_router():
    from serve.online.app import ServedModel
    from serve.online.engine_start import build_llm_config as llm_config

    pinned = ServedModel(source="/ckpt/v3", ref="models:/rayline-tiny/3", name="rayline-tiny", version="3")
    cfg = load_config(Config, "configs/serve/tiny_cpu.yaml", PREFIX)
    assert llm_config(cfg, pinned, {}).deployment_config["request_router_config"]["request_router_class"] == PREFIX_ROUTER
    default = replace(cfg, routing=RoutingConfig(), ingress="engine")
    assert "request_router_config" not in llm_config(default, pinned, {}).deployment_config
