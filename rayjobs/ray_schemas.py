"""Layer 3: the Ray-side payloads inside a KubeRay manifest, checked with Ray's own schemas.

- RayService `spec.serveConfigV2` (a YAML string) must parse to a mapping that `ray.serve.schema.ServeDeploySchema`
  accepts; pydantic errors come back as paths like `spec.serveConfigV2.applications[0].import_path`. Fields the
  Serve models do not declare are reported too, since Serve drops them silently (a typo'd `num_replica`).
  Each application's `import_path` module must be findable from the project root, and the attribute name must
  appear in its source.
- RayJob `spec.runtimeEnvYAML` must parse to a mapping that `ray.runtime_env.RuntimeEnv` accepts, with only
  built-in runtime_env fields; app-level `runtime_env` in serveConfigV2 gets the same check.
- RayJob `spec.entrypoint`: required unless InteractiveMode; `python -m MODULE ...` needs MODULE findable from the
  project root.

Modules are located with `importlib.machinery.PathFinder` / `importlib.util.find_spec` only: nothing is
imported, so checking `serve.online.app:build_app` never loads vLLM or torch.
"""

from __future__ import annotations

import difflib
import importlib.machinery
import importlib.util
import re
import shlex
import types
import typing
from pathlib import Path
from typing import Any, Callable

import pydantic
import yaml

from rayjobs.crd_schema import Problem, child_path

LAYER = "ray"
PROJECT_ROOT = Path(__file__).resolve().parents[1]
Add = Callable[[str, str], None]


def load_serve_config(spec: Any) -> dict | None:
    """The parsed `serveConfigV2` of a RayService spec, or None when it is absent or not a YAML mapping."""
    text = spec.get("serveConfigV2") if isinstance(spec, dict) else None
    try:
        parsed = yaml.safe_load(text) if isinstance(text, str) else None
    except yaml.YAMLError:
        return None
    return parsed if isinstance(parsed, dict) else None


def find_module(name: str, project_root: Path | None = None) -> importlib.machinery.ModuleSpec | None:
    """Locate module `name` (dotted) from `project_root` first, then installed packages, importing nothing."""
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        return None
    spec = importlib.machinery.PathFinder.find_spec(parts[0], [str(project_root or PROJECT_ROOT)])
    if spec is None:
        try:  # installed packages, including editable installs' meta-path finders; a top-level lookup imports nothing
            spec = importlib.util.find_spec(parts[0])
        except (ImportError, ValueError):
            return None
    for i in range(1, len(parts)):
        # PathFinder with an explicit path finds a submodule without importing its parent package.
        if spec is None or not spec.submodule_search_locations:
            return None
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), list(spec.submodule_search_locations))
    return spec


def _check_import_path(import_path: Any, path: str, project_root: Path | None, add: Add) -> None:
    if not isinstance(import_path, str) or not import_path:
        return  # ServeDeploySchema reports the missing/mistyped field
    module, sep, attr = import_path.partition(":")
    if not sep:  # Serve also accepts `pkg.module.attr`
        module, _, attr = import_path.rpartition(".")
    spec = find_module(module, project_root)
    if spec is None:
        add(path, f"module {module!r} is not importable from {project_root or PROJECT_ROOT} (checked with find_spec, nothing imported)")
        return
    if attr and spec.origin and spec.origin.endswith(".py"):
        source = Path(spec.origin).read_text(encoding="utf-8", errors="replace")
        if "import *" not in source and not re.search(rf"\b{re.escape(attr)}\b", source):
            add(path, f"{spec.origin} never mentions {attr!r}; the import_path attribute does not exist")


def _pydantic_path(base: str, err: dict, data: Any) -> str:
    """Map a pydantic error location onto the data, skipping union/validator tags that are not in it."""
    path, cur, loc = base, data, err["loc"]
    for i, part in enumerate(loc):
        if isinstance(part, int) and isinstance(cur, list) and 0 <= part < len(cur):
            path, cur = child_path(path, part), cur[part]
        elif isinstance(part, str) and isinstance(cur, dict) and part in cur:
            path, cur = child_path(path, part), cur[part]
        elif isinstance(part, str) and i == len(loc) - 1 and isinstance(cur, dict) and part.isidentifier():
            return child_path(path, part)  # a missing field
    # Model-level validators name the field only in the message, e.g. "`num_replicas` must be ...".
    named = re.match(r"(?:Value error, )?`(\w+)`", err["msg"])
    if named and isinstance(cur, dict) and named.group(1) in cur:
        path = child_path(path, named.group(1))
    return path


def _model_types(tp: Any) -> list[tuple[type, bool]]:
    """The pydantic models an annotation holds directly or as a list element: [(model, is_list)]."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(tp, type) and issubclass(tp, pydantic.BaseModel):
        return [(tp, False)]
    if origin in (list, typing.List) and args:
        return [(m, True) for m, nested in _model_types(args[0]) if not nested]
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return [m for a in args for m in _model_types(a)]
    return []


def _unknown_fields(model: type, data: Any, path: str, add: Add) -> None:
    if not isinstance(data, dict):
        return
    fields = model.model_fields
    names = set(fields) | {f.alias for f in fields.values() if f.alias}
    extra = model.model_config.get("extra")
    for key, value in data.items():
        key_path = child_path(path, str(key))
        if key not in names:
            if extra not in ("allow", "forbid"):  # with "forbid" pydantic itself reports it
                near = difflib.get_close_matches(str(key), sorted(names), n=1, cutoff=0.75)
                add(key_path, f'unknown field "{key}" ({model.__name__} ignores it silently)' + (f'; did you mean "{near[0]}"?' if near else ""))
            continue
        for sub, is_list in _model_types(fields[key].annotation):
            for i, item in enumerate(value if is_list and isinstance(value, list) else [value]):
                _unknown_fields(sub, item, child_path(key_path, i) if is_list else key_path, add)


def check_runtime_env(env: Any, path: str, add: Add) -> None:
    """`env` (a parsed runtime_env mapping) must be accepted by `ray.runtime_env.RuntimeEnv`, built-in fields only."""
    from ray.runtime_env import RuntimeEnv

    if env is None:
        return
    if not isinstance(env, dict):
        return add(path, f"runtime_env must be a mapping, got {type(env).__name__}")
    for key in env:
        if key not in RuntimeEnv.known_fields:
            near = difflib.get_close_matches(str(key), sorted(RuntimeEnv.known_fields), n=1, cutoff=0.7)
            hint = f'; did you mean "{near[0]}"?' if near else "; only valid with a custom runtime_env plugin installed"
            add(child_path(path, str(key)), f"{key!r} is not a built-in runtime_env field{hint}")
    try:
        RuntimeEnv(**{k: v for k, v in env.items() if k in RuntimeEnv.known_fields})
    except Exception as e:  # RuntimeEnv raises TypeError/ValueError/others with a readable message
        add(path, f"ray.runtime_env.RuntimeEnv rejects it: {str(e).splitlines()[0]}")


def check_serve_config(spec: dict, project_root: Path | None, add: Add) -> None:
    """serveConfigV2 through ServeDeploySchema, unknown fields, app runtime_envs and import paths."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    base, text = "spec.serveConfigV2", spec.get("serveConfigV2")
    if not isinstance(text, str) or not text.strip():
        return add(base, "no serveConfigV2: KubeRay would start the cluster but deploy no Serve applications")
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1} of the embedded YAML)" if mark else ""
        return add(base, f"serveConfigV2 is not valid YAML{where}: {getattr(e, 'problem', None) or e}")
    if not isinstance(config, dict):
        return add(base, f"serveConfigV2 must be a YAML mapping with `applications`, got {type(config).__name__}")
    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as e:
        for err in e.errors():
            add(_pydantic_path(base, err, config), err["msg"].removeprefix("Value error, "))
    except (AttributeError, TypeError, KeyError) as e:  # some Serve validators assume well-typed input
        add(base, f"ServeDeploySchema failed on this config ({type(e).__name__}: {e}); look for a field of the wrong type")
    _unknown_fields(ServeDeploySchema, config, base, add)
    for i, app in enumerate(config.get("applications") if isinstance(config.get("applications"), list) else []):
        if isinstance(app, dict):
            app_path = f"{base}.applications[{i}]"
            check_runtime_env(app.get("runtime_env"), f"{app_path}.runtime_env", add)
            _check_import_path(app.get("import_path"), f"{app_path}.import_path", project_root, add)


def entrypoint_module(entrypoint: str) -> str | None:
    """MODULE of an entrypoint like `python -m MODULE ...` (also python3, -u etc. before -m); None otherwise."""
    try:
        words = shlex.split(entrypoint)
    except ValueError:
        return None
    for i, word in enumerate(words):
        if re.fullmatch(r"(.*/)?python(\d+(\.\d+)*)?", word):
            rest = words[i + 1 :]
            for j, arg in enumerate(rest):
                if arg == "-m" and j + 1 < len(rest):
                    return rest[j + 1]
                if arg.startswith("-m") and len(arg) > 2:
                    return arg[2:]
                if not arg.startswith("-"):
                    return None  # a script path: python runs it and ignores later -m
            return None
    return None


def check_rayjob(spec: dict, base: str, project_root: Path | None, add: Add) -> None:
    """runtimeEnvYAML through RuntimeEnv; entrypoint present and its `python -m` module findable."""
    text = spec.get("runtimeEnvYAML")
    if isinstance(text, str) and text.strip():
        try:
            env = yaml.safe_load(text)
        except yaml.YAMLError as e:
            add(f"{base}.runtimeEnvYAML", f"runtimeEnvYAML is not valid YAML: {str(e).splitlines()[0]}")
        else:
            check_runtime_env(env, f"{base}.runtimeEnvYAML", add)
    entrypoint = spec.get("entrypoint")
    if not isinstance(entrypoint, str) or not entrypoint.strip():
        if spec.get("submissionMode") != "InteractiveMode":
            add(f"{base}.entrypoint", "no entrypoint: `ray job submit` needs a command unless submissionMode is InteractiveMode")
        return
    try:
        shlex.split(entrypoint)
    except ValueError as e:
        return add(f"{base}.entrypoint", f"entrypoint is not a valid shell command: {e}")
    module = entrypoint_module(entrypoint)
    if module is not None and find_module(module, project_root) is None:
        add(f"{base}.entrypoint", f"`python -m {module}`: module {module!r} is not importable from {project_root or PROJECT_ROOT}")


def check_ray_schemas(doc: dict, project_root: Path | None = None) -> list[Problem]:
    """Layer 3 for one manifest: serveConfigV2 (RayService), runtimeEnvYAML and entrypoint (RayJob, RayCronJob)."""
    problems: list[Problem] = []

    def add(path: str, message: str) -> None:
        problems.append(Problem(path, message, LAYER))

    spec = doc.get("spec")
    if not isinstance(spec, dict):
        return problems
    if doc.get("kind") == "RayService":
        check_serve_config(spec, project_root, add)
    elif doc.get("kind") == "RayJob":
        check_rayjob(spec, "spec", project_root, add)
    elif doc.get("kind") == "RayCronJob" and isinstance(spec.get("jobTemplate"), dict):
        check_rayjob(spec["jobTemplate"], "spec.jobTemplate", project_root, add)
    return problems
