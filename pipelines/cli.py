"""`rayline <command> [args ...]`: one front door to rayline's entry points.

    rayline stack up --s3
    rayline train --config configs/train/tiny.yaml train.epochs=2
    rayline train --help      # the stage's options, then every field of its Config with default and docstring

Each command calls the same function, with the same arguments, that `python -m <module>` runs, so the two
cannot drift; the stages' modules and Config classes come from rayjobs/stages.py, as for render and submit.
A new entry point is one row of COMMANDS; `rayline post-train <method>` names a post-training stage (dpo, grpo).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import sys
import textwrap
from dataclasses import dataclass
from typing import Any, get_type_hints

from rayjobs.stages import STAGES


@dataclass(frozen=True)
class Command:
    module: str
    """`python -m <module>` runs the same thing."""
    entry: str
    """The module's function that takes argv (a list of strings) and returns the exit status."""
    summary: str
    """One line for `rayline --help`."""
    config: str = ""
    """`package.module:Class` whose fields `rayline <command> --help` lists ("" = none)."""


def _stage(name: str, entry: str, summary: str) -> Command:
    stage = STAGES[name]
    return Command(stage.module, entry, summary, stage.config_class)


COMMANDS = {
    "demo": Command("pipelines.demo", "cli", "the main job end to end on the local stack (what `make demo` runs)"),
    "stack": Command("pipelines.stack", "main", "start, stop or inspect the local stack (up, down, status, env)",
                     "stack.config:StackConfig"),
    "data": _stage("data", "main", "data stage: corpus -> cleaned, tokenized, packed shards and a manifest"),
    "train": _stage("train", "main", "train stage: FSDP2 training on Ray Train, checkpoints, export, registration"),
    "tune": _stage("tune", "main", "tune stage: ASHA search over train, DPO or GRPO config fields, the best registered"),
    "post-train dpo": _stage("dpo", "main", "DPO: preference pairs -> reference log-probs once -> DPO on FSDP2"),
    "post-train grpo": _stage("grpo", "main", "GRPO: vLLM rollouts, verifier rewards, FSDP2 policy, weights synced in place"),
    "batch": _stage("batch_infer", "cli", "batch inference and evaluation on Ray Data + vLLM"),
    "serve": _stage("serve", "cli", "deploy, render or delete the OpenAI-compatible Ray Serve app"),
    "rollout": _stage("rollout", "cli", "serve the version an MLflow alias names (gate, deploy, verify, roll back)"),
    "render": Command("pipelines.render", "main", "render a stage as a KubeRay RayJob/RayService, validated offline"),
    "validate": Command("pipelines.validate", "main", "check KubeRay manifests offline (schemas, operator rules)"),
    "submit": Command("pipelines.submit", "main", "submit a stage to a Ray cluster through the Jobs API"),
    "keys": Command("pipelines.api_keys", "main", "add or rotate an API key of the OpenAI endpoint"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:{width}}  {c.summary}" for name, c in COMMANDS.items()]
    return "\n".join([
        "usage: rayline <command> [args ...]", "",
        "rayline's entry points; `rayline <command> ...` runs what `python -m <module> ...` runs.", "",
        "commands:", *lines, "",
        "`rayline <command> --help` shows its options and, for a stage, every field of its Config.",
    ])


def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal that follows the field in the class's source (its attribute docstring),
    for `cls` and the dataclasses it inherits from."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        (node,) = ast.parse(textwrap.dedent(inspect.getsource(klass))).body
        for field, after in zip(node.body, node.body[1:]):
            if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[field.target.id] = inspect.cleandoc(after.value.value)
    return docs


@dataclass
class FieldHelp:
    key: str
    """Dotted, as an override names it: `train.epochs`."""
    type: str
    default: str | None
    """As YAML reads it back; None = required."""
    doc: str


def config_fields(cls: type, prefix: str = "", defaults: Any = None) -> list[FieldHelp]:
    """Every init field of the dataclass `cls`, nested dataclasses flattened into dotted keys; `defaults`: an
    instance whose values are the defaults (a section whose default_factory sets some of its fields)."""
    hints, docs = get_type_hints(cls), attribute_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key, tp = prefix + f.name, hints[f.name]
        if defaults is not None:
            default: Any = getattr(defaults, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        if dataclasses.is_dataclass(tp):
            out.extend(config_fields(tp, key + ".", None if default is dataclasses.MISSING else default))
            continue
        shown = None if default is dataclasses.MISSING else json.dumps(default, default=str)
        out.append(FieldHelp(key, f.type if isinstance(f.type, str) else getattr(tp, "__name__", str(tp)), shown,
                             docs.get(f.name, "")))
    return out


def config_help(config: str) -> str:
    """The fields of `package.module:Class` as `rayline <command> --help` prints them."""
    module, name = config.split(":")
    cls = getattr(importlib.import_module(module), name)
    lines = [f"config fields ({config}): key=value overrides, or keys of the --config YAML where the command "
             "takes one", ""]
    for f in config_fields(cls):
        lines.append(f"  {f.key}: {f.type}" + (" (required)" if f.default is None else f" = {f.default}"))
        lines.extend(textwrap.indent(textwrap.fill(para, 100), " " * 6) for para in f.doc.split("\n\n") if para)
    return "\n".join(lines)


def run(name: str, argv: list[str]) -> int:
    """Run command `name` with `argv`; with -h/--help, its options and then its config's fields."""
    command = COMMANDS[name]
    entry = getattr(importlib.import_module(command.module), command.entry)
    wants_help = any(a in ("-h", "--help") for a in argv)
    saved, sys.argv = sys.argv, [f"rayline {name}", *argv]  # argparse's prog in the command's own usage lines
    try:
        status = entry(argv)
    except SystemExit as e:
        if not (wants_help and e.code in (0, None)):
            raise
        status = 0
    finally:
        sys.argv = saved
    if wants_help and command.config:
        print("\n" + config_help(command.config))
    return status if isinstance(status, int) else 0  # batch_infer's cli returns its Result, as under `python -m`


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "post-train" and len(argv) > 1 and not argv[1].startswith("-"):
        argv = [f"post-train {argv[1]}", *argv[2:]]  # `rayline post-train dpo ...`: the method names the stage
    if argv[0] not in COMMANDS:
        print(f"rayline: unknown command {argv[0]!r} (commands: {', '.join(COMMANDS)}); `rayline --help` lists them",
              file=sys.stderr)
        return 2
    return run(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
