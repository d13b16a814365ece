"""The tune stage's config: `configs/tune/*.yaml` mirrors `TuneConfig`.

A search starts from a train config (`train_config` + `train_overrides`) and samples the fields named
in `space` (dotted TrainConfig paths such as `optim.lr`). Validation loads that train config, so an
unknown field, a search over a field that does not exist or a bad range fails before Ray starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from core.config import ConfigError, from_dict, load_config, require, to_dict
from core.registry import PROJECT_ROOT
from train.config import RUN_NAME, TrainConfig


@dataclass
class ParamSpace:
    type: Literal["loguniform", "uniform", "randint", "choice"]
    low: float | None = None
    high: float | None = None
    """Bounds for loguniform / uniform / randint (randint: high exclusive)."""
    values: list[Any] = field(default_factory=list)
    """Candidates for choice."""

    def __post_init__(self):
        if self.type == "choice":
            require(bool(self.values), "values", "choice needs at least one value")
            return
        require(self.low is not None and self.high is not None, "low", f"{self.type} needs low and high")
        require(self.low < self.high, "low", f"low {self.low} must be below high {self.high}")
        require(self.type != "loguniform" or self.low > 0, "low", "loguniform needs low > 0")

    def sample_values(self) -> list[Any]:
        """Representative values (bounds or candidates), used to check each one gives a valid TrainConfig."""
        if self.type == "choice":
            return list(self.values)
        if self.type == "randint":
            return [int(self.low), int(self.high) - 1]
        return [self.low, self.high]

    def to_tune(self):
        from ray import tune

        if self.type == "loguniform":
            return tune.loguniform(self.low, self.high)
        if self.type == "uniform":
            return tune.uniform(self.low, self.high)
        if self.type == "randint":
            return tune.randint(int(self.low), int(self.high))
        return tune.choice(self.values)


@dataclass
class AshaConfig:
    grace_period: int = 4
    """Steps every trial runs before ASHA may stop it."""
    reduction_factor: float = 2.0
    max_t: int = 0
    """Last rung in steps; 0 = the trial's planned steps (rungs stay below a trial's last step)."""

    def __post_init__(self):
        require(self.grace_period >= 1, "asha.grace_period", "must be >= 1 step")
        require(self.reduction_factor > 1, "asha.reduction_factor", "must be > 1")
        require(self.max_t >= 0, "asha.max_t", "must be >= 0")


@dataclass
class TuneConfig:
    search_name: str
    """Names the MLflow parent run and the directory of the trials' runs."""
    train_config: str
    """The train YAML every trial starts from (relative paths: from the working directory, else the project)."""
    space: dict[str, ParamSpace]
    """Dotted TrainConfig field -> distribution."""
    train_overrides: list[str] = field(default_factory=list)
    """key=value overrides applied to `train_config` before sampling."""
    metric: str = "eval_loss"
    mode: Literal["min", "max"] = "min"
    num_samples: int = 3
    max_concurrent_trials: int = 0
    """0 = as many as the cluster fits (trials x workers x resources per worker, plus data_cpus)."""
    asha: AshaConfig = field(default_factory=AshaConfig)
    seed: int = 0
    """Seeds the search's sampling (each trial trains with the train config's own seed)."""
    experiment: str = "rayline-tune"
    """MLflow experiment of the parent run and its trial child runs."""
    register_as: str = ""
    """Registered model for the best trial's export; empty = the train config's mlflow.register_as."""
    max_wait_s: float = 0.0
    """Seconds the search may wait (no trial placed) for cluster resources before it fails with the wait's report (what it asked for,
    what is free, what holds the rest, whether an autoscaler can add nodes: core/resource_wait.py); 0 = wait as
    long as it takes (the report is printed all the same, 10 s into a wait and every minute after)."""

    def __post_init__(self):
        require(bool(RUN_NAME.match(self.search_name)), "search_name",
                f"{self.search_name!r} must be 1-100 letters, digits, '.', '_' or '-' (it names a directory)")
        require(self.num_samples >= 1, "num_samples", "must be >= 1")
        require(self.max_wait_s >= 0, "max_wait_s", f"must be >= 0 (0 = no limit), got {self.max_wait_s}")
        require(self.max_concurrent_trials >= 0, "max_concurrent_trials", "must be >= 0 (0 = derive)")
        require(bool(self.space), "space", "name at least one TrainConfig field to search over")
        base = self.base_train_config()
        t = base.train
        # ASHA compares trials at every report (each checkpoint); a stale eval_loss would compare nothing.
        fresh = t.eval_every_steps > 0 and t.checkpoint_every_steps in (0, t.eval_every_steps)
        require(self.metric != "eval_loss" or fresh,
                "train_overrides", f"eval_loss is compared at every checkpoint, so the trial's train.eval_every_steps "
                f"({t.eval_every_steps}) must be set and train.checkpoint_every_steps ({t.checkpoint_every_steps}) "
                "must be 0 or equal to it")
        plain = to_dict(base)
        for key, dist in self.space.items():
            require(not key.startswith(("run_name", "checkpoint.", "mlflow.")), f"space.{key}",
                    "run names, storage and tracking are set per trial, not searched")
            node = plain
            for part in key.split("."):
                require(isinstance(node, dict) and part in node, f"space.{key}",
                        f"no such field in TrainConfig ({self.train_config})")
                node = node[part]
            for value in dist.sample_values():
                try:
                    trial_config(base, {key: value}, "check")
                except ConfigError as e:
                    raise ConfigError(f"space.{key}: value {value!r} makes an invalid train config: {e}") from None

    def train_config_path(self) -> Path:
        p = Path(self.train_config)
        if not p.is_absolute() and not p.exists():
            p = PROJECT_ROOT / p
        return p

    def base_train_config(self) -> TrainConfig:
        try:
            return load_config(TrainConfig, self.train_config_path(), self.train_overrides)
        except ConfigError as e:
            raise ConfigError(f"train_config: {e}") from None


TRIAL_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def trial_config(base: TrainConfig, sampled: dict[str, Any], run_name: str, storage_path: str | None = None,
                 experiment: str | None = None, resources_per_worker: dict[str, float] | None = None) -> TrainConfig:
    """The TrainConfig of one trial: `base` with the sampled values, its own run name, no registration."""
    data = to_dict(base)
    if resources_per_worker:
        data["scaling"]["resources_per_worker"] = dict(resources_per_worker)
    data["run_name"] = TRIAL_SAFE.sub("-", run_name)
    data["mlflow"]["register_as"] = ""
    if storage_path:
        data["checkpoint"]["storage_path"] = storage_path
    if experiment:
        data["mlflow"]["experiment"] = experiment
    for key, value in sampled.items():
        parts = key.split(".")
        node = data
        for p in parts[:-1]:
            node = node[p]
        node[parts[-1]] = value
    return from_dict(TrainConfig, data, f"trial {run_name}")

