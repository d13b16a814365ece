"""The version a Serve app's replicas serve, as the rendered config pins it and the replicas read it back, and the
environment every engine replica gets. Imported by the renderer (serve/online/app.py, no vLLM) and by the replicas
(serve/online/llm_hooks.py)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from core import metrics
from serve.online import engine
from serve.online.serve_config import Config

SERVED_MODEL_ENV = "RAYLINE_SERVED_MODEL"
"""The version the replicas serve (ServedModel as JSON), set in their `ray_actor_options` by `render_serve_config`."""


@dataclass(frozen=True)
class ServedModel:
    """The checkpoint a deployment loads and the registry version it is."""

    source: str
    """What the replicas load: a local checkpoint directory, or an s3:// URI each node downloads."""
    ref: str
    """The pinned reference (`models:/name/N`), or the path/URI itself."""
    name: str | None = None
    version: str | None = None
    alias: str | None = None
    """The alias that selected this version, when one did."""
    digest: str | None = None
    """sha256 digest of the files the gate approved (core/weights_manifest.py): each replica loads nothing else."""

    @property
    def label(self) -> str:
        """What responses report as the serving version: `name/N`, else the reference."""
        return f"{self.name}/{self.version}" if self.name and self.version else self.ref

    def to_args(self) -> dict[str, Any]:
        return asdict(self)

    def to_env(self) -> str:
        """The value of SERVED_MODEL_ENV: one JSON text, the same for the same version (so an unchanged version
        leaves the replicas' actor options, and the replicas, as they are)."""
        return json.dumps(self.to_args(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_args(cls, data: dict[str, Any]) -> "ServedModel":
        return cls(**{k: data.get(k) for k in ("source", "ref", "name", "version", "alias", "digest")})


def served_from_env() -> ServedModel | None:
    """In a replica: the version its actor options pin (SERVED_MODEL_ENV), or None."""
    pinned = os.environ.get(SERVED_MODEL_ENV)
    return ServedModel.from_args(json.loads(pinned)) if pinned else None


# vLLM configures logging with `logging.config.dictConfig` when imported, which closes every handler of the process,
# Serve's replica log handler included (its target becomes None). A replica then cannot be recovered by a Serve
# controller that restarted (after a GCS or head restart): the controller's `is_allocated()` call reads that
# handler's file and raises, and Serve replaces the replica (measured: both replicas of an app stopped and
# restarted, ~35 s without capacity). vLLM's own log lines go through a plain handler instead (serve.online.llm_hooks).
REPLICA_LOGGING_ENV = {"VLLM_CONFIGURE_LOGGING": "0"}
# A canary step is judged on the replicas' metrics as Prometheus stores them (serve/promotion/canary_metrics.py): reported every
# 2 s instead of Ray's 10, a step's figures are in Prometheus a few seconds after it, not ~15.
REPLICA_METRICS_ENV = {"RAY_metrics_report_interval_ms": str(metrics.REPORT_INTERVAL_MS)}


def replica_env_vars(cfg: Config, model: ServedModel, base_env: dict[str, str]) -> dict[str, str]:
    """The engine replicas' env_vars: the app's (`base_env`), the engine's, the version, and rayline's settings."""
    return {**base_env, **engine.runtime_env(cfg.engine).get("env_vars", {}), "RAYLINE_MODEL_VERSION": model.label,
            **REPLICA_LOGGING_ENV, **REPLICA_METRICS_ENV}
