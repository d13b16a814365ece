"""`rayline <command>` (pipelines/cli.py): the commands it lists, the config fields `--help` shows, and that a
command runs what `python -m <module>` runs, through `python -m pipelines.cli` and the installed console script."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pipelines import cli
from rayjobs.stages import STAGES

ROOT = Path(__file__).resolve().parents[2]
RAYLINE = Path(sys.executable).parent / "rayline"  # the console script `pip install -e .` puts beside python


def rayline(*args: str, script: bool = False) -> subprocess.CompletedProcess:
    if script:
        assert RAYLINE.exists(), f"{RAYLINE}: no console script; `make install` (pip install -e .) creates it"
    cmd = [str(RAYLINE)] if script else [sys.executable, "-m", "pipelines.cli"]
    return subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("script", [False, True], ids=["python-m", "console-script"])
def test_help_lists_every_command_once_with_one_line(script):
    out = rayline("--help", script=script)
    assert out.returncode == 0, out.stderr
    width = max(map(len, cli.COMMANDS))
    listed = [[line[2:2 + width].strip(), line[4 + width:]] for line in out.stdout.splitlines() if line.startswith("  ")]
    assert listed == [[name, c.summary] for name, c in cli.COMMANDS.items()]
    assert {"demo", "stack", "data", "train", "tune", "batch", "serve", "rollout", "render", "validate",
            "submit"} <= set(cli.COMMANDS)
    # Every stage rayline packages (and renders, and submits) is a command.
    assert {s.module for s in STAGES.values()} <= {c.module for c in cli.COMMANDS.values()}


@pytest.mark.parametrize("script", [False, True], ids=["python-m", "console-script"])
def test_train_help_shows_the_stages_options_then_its_nested_fields_with_defaults_and_docstrings(script):
    out = rayline("train", "--help", script=script)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: rayline train [-h] [--config CONFIG] [overrides ...]")
    assert "config fields (train.config:TrainConfig)" in out.stdout
    assert "  run_name: str (required)\n" in out.stdout
    assert "  train.epochs: int = 1\n" in out.stdout
    assert "  optim.grad_clip: float = 1.0\n      Max global gradient norm; 0 turns clipping off.\n" in out.stdout
    assert '  lora.target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]\n' in out.stdout


@pytest.mark.parametrize("name", [n for n, c in cli.COMMANDS.items() if c.config])
def test_every_config_command_lists_every_field_of_its_config(name, capsys):
    assert cli.main([name, "--help"]) == 0
    text = capsys.readouterr().out
    config = cli.COMMANDS[name].config
    module, cls = config.split(":")
    fields = dataclasses.fields(getattr(__import__(module, fromlist=[cls]), cls))
    listed = [line.split(":")[0].strip() for line in text.split(f"config fields ({config})")[1].splitlines()
              if line.startswith("  ") and not line.startswith("      ")]
    assert {key.split(".")[0] for key in listed} == {f.name for f in fields if f.init}
    assert sys.argv[0] != f"rayline {name}"  # the test process's argv is given back


@pytest.mark.parametrize("args", [["bogus"], ["trian", "--help"]])
def test_an_unknown_command_exits_2_naming_it_and_the_known_ones(args):
    out = rayline(*args)
    assert out.returncode == 2
    assert f"rayline: unknown command {args[0]!r} (commands: demo, stack, data, train" in out.stderr
    assert out.stdout == ""


def test_no_command_exits_2_with_the_usage():
    out = rayline()
    assert out.returncode == 2 and out.stderr.startswith("usage: rayline <command>")


def test_a_command_runs_what_python_m_runs_with_the_same_arguments():
    args = ["--config", "configs/train/tiny.yaml", "train.epochs=0"]
    direct = subprocess.run([sys.executable, "-m", "pipelines.train", *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    via = rayline("train", *args, script=True)
    assert (via.returncode, via.stdout, via.stderr) == (direct.returncode, direct.stdout, direct.stderr)
    assert direct.returncode == 1
    assert direct.stderr == "config error: configs/train/tiny.yaml: train.epochs: must be >= 1, got 0\n"
    bad = rayline("train", "--bogus")
    assert bad.returncode == 2 and "rayline train: error: unrecognized arguments: --bogus" in bad.stderr


@dataclass
class _Section:
    size: int = 4
    """Rows per batch.

    A second paragraph."""
    names: list[str] = field(default_factory=lambda: ["a"])


@dataclass
class _Config:
    name: str
    """Required, with its docstring."""
    section: _Section = field(default_factory=lambda: _Section(size=8))
    flag: bool = False
    nothing: int | None = None


def test_fields_are_flattened_with_the_defaults_the_config_really_gets():
    got = {f.key: (f.type, f.default, f.doc) for f in cli.config_fields(_Config)}
    assert got == {
        "name": ("str", None, "Required, with its docstring."),
        "section.size": ("int", "8", "Rows per batch.\n\nA second paragraph."),  # the factory's 8, not the class's 4
        "section.names": ("list[str]", '["a"]', ""),
        "flag": ("bool", "false", ""),
        "nothing": ("int | None", "null", ""),
    }


def test_post_train_names_its_method(capsys):
    """`rayline post-train dpo --help` runs the DPO stage's help, as `python -m pipelines.dpo --help` does."""
    assert cli.main(["post-train", "dpo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: rayline post-train dpo" in out and "dpo.beta" in out
    assert cli.main(["post-train", "nope"]) == 2 and "unknown command 'post-train nope'" in capsys.readouterr().err
