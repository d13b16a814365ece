from dataclasses import dataclass, field

import pytest

from core.config import ConfigError, config_hash, flatten, load_config, require


@dataclass
class Optim:
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])

    def __post_init__(self):
        require(self.lr > 0, "lr", "must be > 0")


@dataclass
class Stage:
    name: str
    steps: int = 10
    optim: Optim = field(default_factory=Optim)
    tags: dict[str, str] = field(default_factory=dict)
    note: str | None = None


def write(tmp_path, text):
    p = tmp_path / "stage.yaml"
    p.write_text(text)
    return p


def test_yaml_and_overrides(tmp_path):
    p = write(tmp_path, "name: a\nsteps: 5\noptim:\n  lr: 0.01\n")
    cfg = load_config(Stage, p, ["optim.lr=3e-4", "steps=7", "tags.team=ml"])
    assert (cfg.name, cfg.steps, cfg.optim.lr, cfg.tags) == ("a", 7, 3e-4, {"team": "ml"})
    assert isinstance(cfg.optim.lr, float)


def test_unknown_nested_field_names_path_and_file(tmp_path):
    p = write(tmp_path, "name: a\noptim:\n  lrr: 0.01\n")
    with pytest.raises(ConfigError) as e:
        load_config(Stage, p)
    assert str(p) in str(e.value) and "optim.lrr: unknown field" in str(e.value)


def test_wrong_type_and_missing_required(tmp_path):
    with pytest.raises(ConfigError, match=r"steps: expected an integer, got str 'ten'"):
        load_config(Stage, write(tmp_path, "name: a\nsteps: ten\n"))
    with pytest.raises(ConfigError, match=r"name: required field is missing"):
        load_config(Stage, write(tmp_path, "steps: 3\n"))
    with pytest.raises(ConfigError, match=r"optim.betas\[1\]: expected a number"):
        load_config(Stage, write(tmp_path, "name: a\noptim:\n  betas: [0.9, x]\n"))


def test_post_init_validation_gets_path(tmp_path):
    with pytest.raises(ConfigError, match=r"optim.lr: must be > 0"):
        load_config(Stage, write(tmp_path, "name: a\n"), ["optim.lr=-1"])


def test_missing_file_and_bad_override(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Stage, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(Stage, write(tmp_path, "name: a\n"), ["steps"])


def test_flatten_and_hash_are_stable(tmp_path):
    a = load_config(Stage, write(tmp_path, "name: a\n"))
    b = load_config(Stage, write(tmp_path, "name: a\n"))
    assert config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash(load_config(Stage, None, ["name=b"]))
    assert flatten(a)["optim.lr"] == 1e-3 and flatten(a)["optim.betas"] == "[0.9, 0.95]"
