"""The tune stage's config over a train config: `configs/tune/*.yaml` mirrors `TuneConfig`.

A search starts from a train config (`train_config` + `train_overrides`) and samples the fields named
in `space` (dotted TrainConfig paths such as `optim.lr`). Validation loads that train config, so an
unknown field, a search over a field that does not exist or a bad range fails before Ray starts.

A search over a post-training config (a DPO YAML) is posttrain/tune_config.py's `PostTrainTuneConfig`, this class
with `post_train_config` beside `train_config` (train/ may not import the post-training stages); the validation here
is written against `base_config()` and the methods the subclass overrides, so it holds for both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from core.config import ConfigError, from_dict, load_config, require, to_dict
from core.registry import PROJECT_ROOT
from train.config import RUN_NAME, TrainConfig

T = TypeVar("T")


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


PER_TRIAL = "run names, storage and tracking are set per trial, not searched"
TRAIN_METRICS = {"eval_loss": "min", "loss": "min"}


@dataclass
class TuneConfig:
    search_name: str
    """Names the MLflow parent run and the directory of the trials' runs."""
    train_config: str = ""
    """The train YAML every trial starts from (relative paths: from the working directory, else the project)."""
    space: dict[str, ParamSpace] = field(default_factory=dict)
    """Dotted field of the base config (TrainConfig here) -> distribution."""
    train_overrides: list[str] = field(default_factory=list)
    """key=value overrides applied to `train_config` before sampling."""
    metric: str = "eval_loss"
    """What ranks trials, as the trials report it at each checkpoint: `eval_loss` or `loss` (the base's own
    objective); a DPO base adds `eval_preference_accuracy` and `eval_logratio_margin` (posttrain/tune_config.py)."""
    mode: Literal["min", "max"] = "min"
    """The metric's better direction; must be its own (`min` for a loss, `max` for an accuracy)."""
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
        self.check_base_fields()
        require(bool(self.space), "space", f"name at least one {self.base_what()} field to search over")
        metrics = self.metrics()
        require(self.metric in metrics, "metric",
                f"{self.metric!r} is not a metric the trials report (known: {', '.join(metrics)})")
        require(self.mode == metrics[self.metric], "mode",
                f"{self.metric} is better {'lower' if metrics[self.metric] == 'min' else 'higher'}: "
                f"set mode: {metrics[self.metric]}")
        base = self.base_config()
        self.check_base(base)
        plain = to_dict(base)
        for key, dist in self.space.items():
            for fixed, why in self.fixed_fields().items():
                require(key != fixed and not (fixed.endswith(".") and key.startswith(fixed)), f"space.{key}", why)
            node = plain
            for part in key.split("."):
                require(isinstance(node, dict) and part in node, f"space.{key}",
                        f"no such field in {type(base).__name__} ({self.base_config_path()})")
                node = node[part]
            for value in dist.sample_values():
                try:
                    with_values(base, {key: value}, "check")
                except ConfigError as e:
                    raise ConfigError(f"space.{key}: value {value!r} makes an invalid {self.base_what()}: {e}") from None

    def check_base_fields(self) -> None:
        """Which base the search starts from: here a train config, named."""
        require(bool(self.train_config), "train_config", "name the train YAML every trial starts from")

    def check_base(self, base) -> None:
        """What a search needs of its base beyond the base's own validation: here a train config's (or a DPO
        config's) scaling and the freshness of the metric ASHA compares."""
        t = base.train
        train_cfg = self.base_train_config()
        if train_cfg.scaling.elastic:
            require(False, self.overrides_field(),
                    f"scaling.num_workers {list(train_cfg.scaling.num_workers)} is an elastic size; a search's trials "
                    f"share the cluster at a fixed size each, so give one number")
        # ASHA compares trials at every report (each checkpoint); a stale eval metric would compare nothing.
        fresh = t.eval_every_steps > 0 and t.checkpoint_every_steps in (0, t.eval_every_steps)
        require(not self.metric.startswith("eval_") or fresh,
                self.overrides_field(), f"{self.metric} is compared at every checkpoint, so the trial's "
                f"train.eval_every_steps ({t.eval_every_steps}) must be set and train.checkpoint_every_steps "
                f"({t.checkpoint_every_steps}) must be 0 or equal to it")

    def metrics(self) -> dict[str, str]:
        """Metrics every trial reports at each checkpoint -> their better direction."""
        return dict(TRAIN_METRICS)

    def fixed_fields(self) -> dict[str, str]:
        """Field (or section prefix ending in '.') -> why a search may not sample it."""
        return {key: PER_TRIAL for key in ("run_name", "checkpoint.", "mlflow.")}

    def base_what(self) -> str:
        """The base as error messages name it."""
        return "train config"

    def overrides_field(self) -> str:
        """The field holding the base's overrides, for error messages."""
        return "train_overrides"

    def base_config_path(self) -> Path:
        return project_path(self.train_config)

    def base_config(self):
        """The config every trial starts from, overrides applied (a TrainConfig here; a DpoConfig for a DPO base)."""
        return self.base_train_config()

    def base_train_config(self) -> TrainConfig:
        """The train stage's config of the base: what sizes the trials (scaling) and what they train."""
        try:
            return load_config(TrainConfig, self.base_config_path(), self.train_overrides)
        except ConfigError as e:
            raise ConfigError(f"train_config: {e}") from None


def project_path(path: str) -> Path:
    """`path` as given, or from the project root when it is relative and not found from the working directory."""
    p = Path(path)
    if not p.is_absolute() and not p.exists():
        p = PROJECT_ROOT / p
    return p


def with_values(cfg: T, sampled: dict[str, Any], what: str) -> T:
    """A copy of the config dataclass `cfg` with the dotted fields of `sampled` set, validated as `cfg`'s class."""
    data = to_dict(cfg)
    for key, value in sampled.items():
        parts = key.split(".")
        node = data
        for p in parts[:-1]:
            node = node[p]
        node[parts[-1]] = value
    return from_dict(type(cfg), data, what)


TRIAL_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def trial_config(base: TrainConfig, sampled: dict[str, Any], run_name: str, storage_path: str | None = None,
                 experiment: str | None = None, resources_per_worker: dict[str, float] | None = None) -> TrainConfig:
    """The TrainConfig of one trial: `base` with the sampled values, its own run name, no registration."""
    fixed: dict[str, Any] = {"run_name": TRIAL_SAFE.sub("-", run_name), "mlflow.register_as": ""}
    if resources_per_worker:
        fixed["scaling.resources_per_worker"] = dict(resources_per_worker)
    if storage_path:
        fixed["checkpoint.storage_path"] = storage_path
    if experiment:
        fixed["mlflow.experiment"] = experiment
    return with_values(base, {**fixed, **sampled}, f"trial {run_name}")

