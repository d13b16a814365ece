"""Serving config -> `serve deploy` config: the schema Ray checks, the pinned model, CPU and GPU placement (no cluster)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from ray.serve.schema import ServeDeploySchema

from core.config import ConfigError, from_dict, load_config
from serve.online.app import BUILDER, ServedModel, application_args, render_serve_config, served_model_of
from serve.online.serve_config import Config

PINNED = ServedModel(source="/ckpt/v3", ref="models:/rayline-tiny/3", name="rayline-tiny", version="3", alias="champion")


@pytest.fixture()
def cfg(monkeypatch) -> Config:
    monkeypatch.setenv("RAYLINE_SERVE_URL", "http://127.0.0.1:8123")
    return load_config(Config, "configs/serve/tiny_cpu.yaml")


def test_rendered_config_is_a_valid_serve_deploy_schema(cfg):
    rendered = render_serve_config(cfg, PINNED)
    schema = ServeDeploySchema.model_validate(rendered)
    (app,) = schema.applications
    assert (app.name, app.route_prefix, app.import_path) == ("rayline", "/", BUILDER)
    # The stack's Serve port (RAYLINE_SERVE_URL), on loopback.
    assert rendered["http_options"] == {"host": "127.0.0.1", "port": 8123}
    assert app.logging_config.enable_access_log is False


def test_args_carry_the_whole_config_and_the_pinned_version(cfg):
    app = render_serve_config(cfg, PINNED)["applications"][0]
    assert from_dict(Config, app["args"]["config"]) == cfg
    assert served_model_of(app) == PINNED and PINNED.label == "rayline-tiny/3"


def test_offline_render_leaves_the_alias_for_the_cluster_to_resolve(cfg):
    app = render_serve_config(cfg)["applications"][0]
    assert app["args"]["model"] is None and app["args"]["config"]["engine"]["model"] == "models:/rayline-tiny@champion"
    assert served_model_of(app) is None


def test_cpu_placement_is_fractional_and_fits_a_rolling_update_on_two_cores(cfg):
    # During a rolling update with max_surge_percent=100 the old and new engine + ingress run side by side.
    assert cfg.engine.accelerator == "cpu" and cfg.max_surge_percent == 100
    peak = 2 * (cfg.engine.cpus_per_engine * cfg.autoscaling.max_replicas + cfg.ingress_cpus * cfg.ingress_replicas)
    assert peak <= 1.5


@pytest.mark.slow  # imports vLLM through ray.serve.llm
def test_llm_config_on_cpu_and_gpu(cfg):
    pytest.importorskip("vllm")
    from serve.online.engine_start import build_llm_config as llm_config

    llm = llm_config(cfg, PINNED, {"FROM_APP": "1"})
    assert llm.accelerator_config.kind == "cpu" and llm.accelerator_type is None
    assert llm.placement_group_config == {"bundles": [{"CPU": 0.5}], "strategy": "PACK"}
    assert llm.engine_kwargs["fingerprint_value"] == "rayline-tiny/3"
    assert llm.engine_kwargs["kv_cache_memory_bytes"] == 128 * 2**20
    assert llm.runtime_env["env_vars"]["FROM_APP"] == "1"  # the app's env survives LLMConfig's runtime_env
    assert llm.runtime_env["env_vars"]["RAYLINE_ENGINE_CORE_START"] == "fork"  # CPU: EngineCore forked
    assert llm.callback_config.callback_class.__name__ == "EngineStartCallback"
    assert llm.callback_config.callback_kwargs == {"local_checkpoint": True}  # a path: no per-node download
    assert llm.deployment_config["ray_actor_options"] == {"num_cpus": 0}
    assert llm.deployment_config["max_surge_percent"] == 100
    assert "placement_group_bundle_label_selector" not in llm.deployment_config  # any node

    # node_labels: Serve's bundle label selector on the engine replica's placement group, checked by Serve itself.
    from ray import serve

    pinned = llm_config(replace(cfg, node_labels={"rayline.io/node": "in(worker-1,worker-2)"}), PINNED, {})
    options = pinned.deployment_config
    assert options["placement_group_bundle_label_selector"] == [{"rayline.io/node": "in(worker-1,worker-2)"}]
    serve.deployment(lambda: None).options(placement_group_bundles=[{"CPU": 0.5}], **options)

    gpu = load_config(Config, "configs/serve/gpu_example.yaml")
    remote = ServedModel(source="s3://bucket/ckpt", ref="models:/rayline-small/2", name="rayline-small", version="2")
    llm = llm_config(gpu, remote, {})
    assert llm.accelerator_config.kind == "gpu" and llm.accelerator_type == "L4"
    assert llm.placement_group_config == {"bundles": [{"CPU": 2.0, "GPU": 1.0}] * 2, "strategy": "STRICT_PACK"}
    assert llm.engine_kwargs["tensor_parallel_size"] == 2
    assert llm.callback_config.callback_kwargs == {"local_checkpoint": False}  # s3: Ray downloads on each node
    assert "RAYLINE_ENGINE_CORE_START" not in llm.runtime_env["env_vars"]  # GPU: vLLM's spawn


def test_gpu_example_renders_for_a_pod(monkeypatch):
    monkeypatch.delenv("RAYLINE_SERVE_URL", raising=False)
    cfg = load_config(Config, "configs/serve/gpu_example.yaml")
    rendered = render_serve_config(cfg)
    assert rendered["http_options"] == {"host": "0.0.0.0", "port": 8000}
    ServeDeploySchema.model_validate(rendered)
    assert application_args(cfg, None)["config"]["autoscaling"]["max_replicas"] == 4


@pytest.mark.parametrize("override, field", [
    (["max_surge_percent=150"], "max_surge_percent"),
    (["autoscaling.max_replicas=0"], "autoscaling.max_replicas"),
    (["autoscaling.initial_replicas=5"], "autoscaling.initial_replicas"),
    (["route_prefix=v1"], "route_prefix"),
    (["engine.kv_cache_memory_bytes=0"], "engine.kv_cache_memory_bytes"),
    (["colour=blue"], "colour"),
    (["node_labels={rayline.io/node: 'in(worker-1,'}"], "node_labels.rayline.io/node"),
    (["node_labels={'bad key!': worker-1}"], "node_labels.bad key!"),
])
def test_config_errors_name_the_file_and_field(override, field):
    with pytest.raises(ConfigError, match=r"configs/serve/tiny_cpu\.yaml: " + re.escape(field)):
        load_config(Config, "configs/serve/tiny_cpu.yaml", override)


def test_adapters_go_in_the_engine_deployment_s_user_config(cfg):
    """Not in `args`: a changed user_config reaches the running replicas (reconfigure) without a restart."""
    from serve.online.app import adapters_of

    lora = replace(cfg, lora=from_dict(type(cfg.lora), {"adapters": {"arith": "models:/rayline-tiny-arith@champion"},
                                                         "max_adapters": 3}))
    offline = render_serve_config(lora)
    schema = ServeDeploySchema.model_validate(offline)
    (deployment,) = schema.applications[0].deployments
    assert deployment.name == "LLMServer:rayline"
    assert adapters_of(offline["applications"][0]) == {"arith": {"ref": "models:/rayline-tiny-arith@champion"}}
    pinned = {"arith": {"ref": "models:/rayline-tiny-arith/2", "source": "/a/2", "name": "rayline-tiny-arith",
                        "version": "2", "label": "rayline-tiny-arith/2"}}
    app = render_serve_config(lora, PINNED, pinned)["applications"][0]
    assert adapters_of(app) == pinned and "adapters" not in str(app["args"]["model"])
    # One batch slot beyond the adapters, twice them in CPU memory: a new version loads beside the old one.
    assert lora.lora.engine_kwargs() == {"enable_lora": True, "max_lora_rank": 16, "max_loras": 4, "max_cpu_loras": 7}
    assert cfg.lora.engine_kwargs() == {} and "deployments" not in render_serve_config(cfg)["applications"][0]
    (engine,) = render_serve_config(cfg, PINNED)["applications"][0]["deployments"]  # the version only
    assert set(engine) == {"name", "ray_actor_options"}


V4 = ServedModel(source="/ckpt/v4", ref="models:/rayline-tiny/4", name="rayline-tiny", version="4", alias="champion")


def test_a_new_version_of_the_same_config_keeps_the_running_build(cfg):
    """A rollout's render with the running app: same `args` (Serve reuses the build, no build task), the new version in
    the replicas' actor options only; the same version again renders the running config itself (nothing restarts)."""
    running = render_serve_config(cfg, PINNED)["applications"][0]
    new = render_serve_config(cfg, V4, running=running)["applications"][0]
    assert new["args"] == running["args"] and served_model_of(running) == PINNED
    assert served_model_of(new) == V4  # what verify and the next rollout read
    ServeDeploySchema.model_validate({"applications": [new]})
    (before,), (after,) = running["deployments"], new["deployments"]
    env_before, env_after = before["ray_actor_options"]["runtime_env"]["env_vars"], after["ray_actor_options"]["runtime_env"]["env_vars"]
    changed = {k for k in env_before.keys() | env_after.keys() if env_before.get(k) != env_after.get(k)}
    assert changed == {"RAYLINE_SERVED_MODEL", "RAYLINE_MODEL_VERSION"}
    assert render_serve_config(cfg, PINNED, running=running)["applications"][0] == running
    # A changed serving config is a new build, with the new version.
    longer = replace(cfg, engine=replace(cfg.engine, max_model_len=256))
    rebuilt = render_serve_config(longer, V4, running=running)["applications"][0]
    assert rebuilt["args"] == application_args(longer, V4) and served_model_of(rebuilt) == V4


def test_the_separate_ingress_is_pinned_too(cfg):
    """`ingress: deployment`: its replicas name the version (model cards, metric labels), so they restart with it."""
    from serve.online.app import INGRESS_DEPLOYMENT, pin_model

    split = replace(cfg, ingress="deployment")
    app = render_serve_config(split, PINNED)["applications"][0]
    ingress = next(d for d in app["deployments"] if d["name"] == INGRESS_DEPLOYMENT)
    assert ingress["ray_actor_options"] == {"num_cpus": split.ingress_cpus, "runtime_env": {
        "env_vars": {"RAYLINE_SERVED_MODEL": PINNED.to_env()}}}
    # A rollback's restore of an unpinned config pins the version where the render would, args untouched.
    unpinned = render_serve_config(split)["applications"][0]
    restored = pin_model(unpinned, V4)
    assert restored["args"] == unpinned["args"] and served_model_of(restored) == V4
    assert restored["deployments"] == render_serve_config(split, V4)["applications"][0]["deployments"]


@pytest.mark.parametrize("lora, extra, field", [
    ({"adapters": {"a b": "models:/x/1"}}, {}, "lora.adapters.a b"),
    ({"adapters": {"a": "models:/x/1", "b": "models:/x/2"}, "max_adapters": 1}, {}, "lora.max_adapters"),
    ({"max_lora_rank": 4, "max_adapters": 1}, {}, "lora.max_lora_rank"),
])
def test_lora_config_errors_name_the_field(lora, extra, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        from_dict(Config, {"engine": {"model": "m"}, "lora": lora, **extra})
