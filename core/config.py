"""Typed stage configs: YAML -> dataclass, with `key=value` overrides and errors that name the field.

Every stage has a `Config` dataclass; `load_config(Config, path, overrides)` builds it from a YAML file
that mirrors the dataclass, applies dotted overrides (`train.lr=3e-4`), checks types strictly and runs
the dataclasses' own `__post_init__` validation. Any problem raises `ConfigError` naming the file and
the field path, so `python -m pipelines.<stage>` fails before any Ray work starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import types
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config problem; the message names the file and the field path."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check `value` against the annotation `tp`, converting only where it is lossless (int -> float)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"{path}: must not be null")
        errors = []
        for opt in options:
            if opt is type(None):
                continue
            try:
                return _coerce(value, opt, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of {_type_name(tp)}")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{path}: {value!r} is not one of {list(get_args(tp))}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping for {tp.__name__}, got {type(value).__name__}")
        return _build(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        (item_tp, *_) = get_args(tp) or (Any,)
        items = [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        _, val_tp = get_args(tp) or (Any, Any)
        return {str(k): _coerce(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {type(value).__name__} {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {type(value).__name__} {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{path}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def _build(cls: type[T], data: dict, path: str) -> T:
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(
            f"{where}{unknown[0]}: unknown field (known fields of {cls.__name__}: {', '.join(sorted(fields))})"
        )
    kwargs = {}
    for name, f in fields.items():
        fpath = f"{path}.{name}" if path else name
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], fpath)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{fpath}: required field is missing")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{path}.{e}" if path and not str(e).startswith(path) else str(e)) from None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path or cls.__name__}: {e}") from None


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value (for example train.lr=3e-4)")
    key, raw = item.split("=", 1)
    value = yaml.safe_load(raw) if raw != "" else ""
    # YAML reads '3e-4' as a string; numbers people type on a command line should stay numbers.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            pass
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set dotted `key=value` overrides on a plain dict (values parsed as YAML scalars)."""
    for item in overrides:
        keys, value = _parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {k} is not a mapping")
        node[keys[-1]] = value
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Build `cls` from the YAML file at `path` (optional) plus dotted overrides; raise ConfigError on any problem."""
    data: dict = {}
    source = "<overrides>"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{source}: config file not found")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: top level must be a mapping of {cls.__name__} fields")
    return from_dict(cls, apply_overrides(data, list(overrides or [])), source)


def from_dict(cls: type[T], data: dict, source: str = "<dict>") -> T:
    """Build `cls` from plain data, checking types; errors are prefixed with `source`."""
    try:
        return _build(cls, data, "")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def to_dict(cfg: Any) -> dict:
    """The config as plain YAML/JSON-able data (the inverse of load_config)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> scalar, for MLflow params."""
    out: dict[str, Any] = {}
    data = to_dict(cfg) if dataclasses.is_dataclass(cfg) else cfg
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = json.dumps(v) if isinstance(v, list) else v
    return out


def config_hash(cfg: Any) -> str:
    """Stable short hash of a config's content."""
    blob = json.dumps(to_dict(cfg) if dataclasses.is_dataclass(cfg) else cfg, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def stage_argparser(description: str) -> argparse.ArgumentParser:
    """The argument parser every stage shares: `--config FILE` plus trailing `key=value` overrides."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", "-c", help="YAML file mirroring the stage's Config dataclass")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.lr=3e-4")
    return parser


def parse_stage_args(cls: type[T], description: str, argv: list[str] | None = None) -> T:
    """Parse `--config FILE key=value ...` into a validated `cls`; exit with the ConfigError message on failure."""
    args = stage_argparser(description).parse_args(argv)
    try:
        return load_config(cls, args.config, args.overrides)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None


def require(cond: bool, field: str, message: str) -> None:
    """Raise ConfigError for `field` unless `cond`; used in `__post_init__` validation."""
    if not cond:
        raise ConfigError(f"{field}: {message}")

