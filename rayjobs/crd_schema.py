"""Layer 1: a KubeRay manifest against its CRD's OpenAPI schema, as an API server with strict field validation would.

No API server runs here, so this module does its job offline. It loads the CRDs (by default the KubeRay v1.7.0
CRDs shipped in `rayjobs/crds/v1.7.0/`, or any directory of CRD YAML such as `kubectl get crd rayjobs.ray.io
-o yaml` output), picks the CRD by the manifest's apiVersion group and kind and the schema of that version,
applies the schema's defaults as the server does, and reports every problem:

- the structural schema, by `jsonschema`: the CRD's OpenAPI v3 schema translated to JSON Schema draft 4
  (`to_json_schema`) with the Kubernetes extensions on top: unknown fields are errors unless
  `x-kubernetes-preserve-unknown-fields` (with a "did you mean" for typos), `x-kubernetes-int-or-string`,
  `nullable`, the int32/int64/date-time formats, and `x-kubernetes-list-type` map keys and set items unique;
- the `x-kubernetes-validations` CEL rules, by `cel-python`, on values that passed the structural checks;
  transition rules (`oldSelf`) are skipped because a fresh manifest is a create;
- the top-level `metadata` as ObjectMeta: name (DNS-1123 subdomain, as for every custom resource),
  namespace (DNS-1123 label), label keys/values, annotation keys, string maps.

`status` is not checked: these CRDs have a status subresource, so the server drops it on create.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import re
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import yaml
from jsonschema.exceptions import ValidationError

from rayjobs.k8s_names import dns1123_label_errors, dns1123_subdomain_errors, label_value_errors, qualified_name_errors

LAYER = "crd-schema"
DEFAULT_CRD_DIR = Path(__file__).resolve().parent / "crds" / "v1.7.0"
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C loader parses the 1 MB CRDs ~10x faster


@dataclasses.dataclass(frozen=True)
class Problem:
    """One reason a manifest would be rejected or misbehave: field path, what is wrong, which layer found it."""

    path: str
    message: str
    layer: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message} [{self.layer}]"


class CrdNotFound(LookupError):
    """No CRD in the directory serves the manifest's apiVersion and kind."""


def child_path(base: str, key: str | int) -> str:
    """`spec` + `ttl` -> `spec.ttl`; + 0 -> `spec[0]`; keys that are not identifiers go in brackets."""
    if isinstance(key, int):
        return f"{base}[{key}]"
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", key):
        return f"{base}.{key}" if base else key
    return f"{base}[{key}]"


# --- CRD loading ----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=32)
def _crds_in_file(path: str, mtime: float) -> tuple[dict, ...]:
    """CustomResourceDefinitions in one YAML/JSON file (multi-doc or a `kind: List`); cached per mtime."""
    with open(path, encoding="utf-8") as f:
        docs = [d for d in yaml.load_all(f, Loader=_LOADER) if isinstance(d, dict)]
    docs = [i for d in docs for i in (d.get("items") or [] if d.get("kind") == "List" else [d])]
    return tuple(d for d in docs if d.get("kind") == "CustomResourceDefinition")


def _locate(api_version: str, kind: str, crd_dir: Path | None) -> tuple[str, float, int, int]:
    """(file, its mtime, CRD index in the file, version index) serving `api_version` and `kind`."""
    crd_dir = Path(crd_dir) if crd_dir else DEFAULT_CRD_DIR
    if not crd_dir.is_dir():
        raise CrdNotFound(f"CRD directory {crd_dir} does not exist; pass --crd-dir with the KubeRay CRD YAMLs")
    group, _, version = api_version.rpartition("/")
    files = sorted(p for p in crd_dir.iterdir() if p.suffix in (".yaml", ".yml", ".json"))
    # Parse the file named after the kind first: each CRD is ~1 MB of YAML.
    files.sort(key=lambda p: kind.lower() not in p.name.lower())
    for p in files:
        mtime = p.stat().st_mtime
        for c, crd in enumerate(_crds_in_file(str(p), mtime)):
            spec = crd.get("spec", {})
            if spec.get("group") != group or spec.get("names", {}).get("kind") != kind:
                continue
            versions = spec.get("versions", [])
            for v, entry in enumerate(versions):
                if entry.get("name") == version and entry.get("served", True):
                    return str(p), mtime, c, v
            served = [v.get("name") for v in versions if v.get("served", True)]
            raise CrdNotFound(f"{group} {kind} is not served at version {version!r} (served: {served})")
    raise CrdNotFound(f"no CRD for apiVersion {api_version!r} kind {kind!r} in {crd_dir}")


def find_version(api_version: str, kind: str, crd_dir: Path | None = None) -> dict:
    """The CRD `spec.versions[]` entry serving `api_version` (`group/version`) for `kind`; raises CrdNotFound."""
    path, mtime, c, v = _locate(api_version, kind, crd_dir)
    return _crds_in_file(path, mtime)[c]["spec"]["versions"][v]


def apply_defaults(value: Any, schema: dict) -> Any:
    """A copy of `value` with the schema's `default`s filled in and non-nullable nulls dropped, as the server does."""
    if isinstance(value, dict):
        props, addl = schema.get("properties", {}), schema.get("additionalProperties")
        out = {}
        for k, v in value.items():
            sub = props.get(k, addl if isinstance(addl, dict) else None)
            if v is None and sub is not None and not sub.get("nullable"):
                continue
            out[k] = apply_defaults(v, sub) if sub else copy.deepcopy(v)
        for k, sub in props.items():
            if k not in out and "default" in sub:
                out[k] = apply_defaults(copy.deepcopy(sub["default"]), sub)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(v, schema["items"]) for v in value]
    return copy.deepcopy(value)


# --- OpenAPI v3 -> JSON Schema, and the Kubernetes keywords jsonschema lacks ------------------------------
_NESTED = ("properties", "additionalProperties", "items", "not", "allOf", "anyOf", "oneOf")
_DROPPED = ("description", "default", "nullable", "example", "externalDocs")


def to_json_schema(schema: dict, structural: bool = True) -> dict:
    """A CRD's OpenAPI v3 schema as JSON Schema draft 4 (OpenAPI 3.0's base) that jsonschema checks as the server does.

    Objects that do not preserve unknown fields get `additionalProperties: false` (strict field validation);
    int-or-string becomes `type: [integer, string]`; nullable adds `null`. Branches of anyOf/allOf/oneOf/not
    only validate values (`structural=False`): they never reject fields. `x-kubernetes-*` keys stay for the
    keywords this module adds.
    """
    out = {k: v for k, v in schema.items() if k not in _NESTED + _DROPPED}
    if "properties" in schema:
        out["properties"] = {k: to_json_schema(s, structural) for k, s in schema["properties"].items()}
    addl = schema.get("additionalProperties")
    if isinstance(addl, dict):
        out["additionalProperties"] = to_json_schema(addl, structural)
    elif addl is not None:
        out["additionalProperties"] = addl
    elif structural and schema.get("type") == "object" and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if isinstance(schema.get("items"), dict):
        out["items"] = to_json_schema(schema["items"], structural)
    if "not" in schema:
        out["not"] = to_json_schema(schema["not"], structural=False)
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema:
            out[key] = [to_json_schema(s, structural=False) for s in schema[key]]
    if schema.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
        if out.get("anyOf") == [{"type": "integer"}, {"type": "string"}]:
            del out["anyOf"]  # the same thing, said the way OpenAPI v3.0 has to
    if schema.get("nullable"):
        if "type" in out:
            out["type"] = [*([out["type"]] if isinstance(out["type"], str) else out["type"]), "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_DATE_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")
# The formats these CRDs use; the server ignores formats it does not know, and so does an empty FormatChecker.
_FORMATS = jsonschema.FormatChecker(formats=())
for _name, (_lo, _hi) in _INT_RANGES.items():
    _FORMATS.checks(_name)(lambda v, lo=_lo, hi=_hi: not isinstance(v, int) or isinstance(v, bool) or lo <= v <= hi)
_FORMATS.checks("date-time")(lambda v: not isinstance(v, str) or bool(_DATE_TIME.fullmatch(v)))


def _list_type(validator: Any, list_type: str, instance: Any, schema: dict) -> Iterator[ValidationError]:
    """x-kubernetes-list-type: `map` items unique by their x-kubernetes-list-map-keys, `set` items unique."""
    if list_type not in ("map", "set") or not validator.is_type(instance, "array"):
        return
    keys = schema.get("x-kubernetes-list-map-keys", [])
    seen: dict[str, int] = {}
    for i, item in enumerate(instance):
        if list_type == "map":
            if not isinstance(item, dict):
                continue
            key = json.dumps([item.get(k) for k in keys], sort_keys=True, default=str)
            what = ", ".join(f"{k}={item.get(k)!r}" for k in keys)
        else:
            key, what = json.dumps(item, sort_keys=True, default=str), repr(item)
        if key in seen:
            yield ValidationError(f"Duplicate value: {what} (same as [{seen[key]}])", path=[i])
        seen.setdefault(key, i)


def _cel_rules(validator: Any, rules: list, instance: Any, schema: dict) -> Iterator[ValidationError]:
    """x-kubernetes-validations, by cel-python, once the value passed the structural checks (as on the server)."""
    structural = {k: v for k, v in schema.items() if k != "x-kubernetes-validations"}
    if not _Structural(structural, format_checker=_FORMATS).is_valid(instance):
        return
    for rule in rules:
        expr = rule.get("rule", "")
        if re.search(r"\boldSelf\b", expr) and not rule.get("optionalOldSelf"):
            continue  # a transition rule: the server runs it on update only, and a manifest is a create
        at = [part for part in rule.get("fieldPath", "").split(".") if part]
        try:
            ok = evaluate_cel(expr, instance)
        except CelError as e:
            yield ValidationError(f"CEL rule {expr!r} could not be evaluated by cel-python: {e}; check it by hand", path=at)
            continue
        if not ok:
            yield ValidationError(rule.get("message") or f"failed rule: {expr}", path=at)


_Structural = jsonschema.validators.extend(jsonschema.Draft4Validator, {"x-kubernetes-list-type": _list_type})
_Kubernetes = jsonschema.validators.extend(_Structural, {"x-kubernetes-validations": _cel_rules})


@functools.lru_cache(maxsize=32)
def _compiled(path: str, mtime: float, c: int, v: int) -> tuple[dict, Any]:
    """(OpenAPI schema, jsonschema validator of everything but metadata and status) of one CRD version."""
    schema = _crds_in_file(path, mtime)[c]["spec"]["versions"][v]["schema"]["openAPIV3Schema"]
    body = dict(schema, properties={k: s for k, s in schema.get("properties", {}).items() if k not in ("metadata", "status")})
    return schema, _Kubernetes(to_json_schema(body), format_checker=_FORMATS)


# --- CEL ------------------------------------------------------------------------------------------------
class CelError(ValueError):
    """cel-python could not compile or evaluate a rule (a Kubernetes-only function, a field read without has())."""


@functools.cache
def _cel_environment() -> Any:
    import celpy  # building its parser takes ~1 s: only manifests that reach a rule pay for it

    return celpy.Environment()


@functools.lru_cache(maxsize=256)
def _cel_program(expr: str) -> Any:
    import celpy

    env = _cel_environment()
    try:
        return env.program(env.compile(expr))
    except celpy.CELParseError as e:
        raise CelError(f"does not parse: {e}") from None


def evaluate_cel(expr: str, self_value: Any) -> bool:
    """A CRD validation rule evaluated by cel-python with `self` bound to `self_value` (YAML/JSON data).

    Raises CelError if the rule does not parse, fails at run time (a field read without has(), a function
    of Kubernetes' CEL libraries that cel-python lacks) or does not give a bool.
    """
    import celpy

    try:
        result = _cel_program(expr).evaluate({"self": celpy.json_to_cel(self_value)})
    except celpy.CELEvalError as e:
        raise CelError(str(e.args[0]).split(" (in activation")[0]) from None
    if not isinstance(result, celpy.celtypes.BoolType):
        raise CelError(f"rule evaluated to {result!r}, not a bool")
    return bool(result)


# --- jsonschema errors -> Problems ----------------------------------------------------------------------
_PATTERN_NAMES = {  # the patterns these CRDs repeat, said in words
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$":
        "must be a Kubernetes quantity such as 500m, 2, 1.5 or 16Gi",
}
_BOUNDS = {"minItems": ("at least", "items"), "maxItems": ("no more than", "items"),
           "minLength": ("at least", "characters"), "maxLength": ("no more than", "characters"),
           "minProperties": ("at least", "properties"), "maxProperties": ("no more than", "properties")}


def _type_of(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return "null" if value is None else "boolean"
    return {int: "integer", float: "number", str: "string", dict: "object", list: "array"}.get(type(value), type(value).__name__)


def _unknown_field(key: Any, known: dict) -> str:
    near = difflib.get_close_matches(str(key), known, n=1, cutoff=0.75)
    if near:
        return f'unknown field "{key}" (did you mean "{near[0]}"?)'
    return f'unknown field "{key}"' + (f"; known fields: {', '.join(sorted(known))}" if known and len(known) <= 12 else "")


def _message(e: ValidationError) -> str:
    kw, v, want = e.validator, e.instance, e.validator_value
    if kw == "type":
        if e.schema.get("x-kubernetes-int-or-string"):
            return f"must be an integer or a string, got {_type_of(v)} {v!r}"
        typ = want if isinstance(want, str) else want[0]
        quote = f' (quote it in YAML: "{v}")' if typ == "string" and isinstance(v, (bool, int, float)) else ""
        return f"must be of type {typ}, got {_type_of(v)} {v!r}{quote}"
    if kw == "enum":
        return f"Unsupported value: {v!r}: supported values: {', '.join(map(repr, want))}"
    if kw in ("minimum", "maximum"):
        return f"Invalid value: {v}: should be {'greater' if kw == 'minimum' else 'less'} than or equal to {want}"
    if kw == "pattern":
        return f"Invalid value: {v!r}: {_PATTERN_NAMES.get(want, f'should match {want!r}')}"
    if kw == "format" and want in _INT_RANGES:
        return f"{v} is out of the {want} range [{_INT_RANGES[want][0]}, {_INT_RANGES[want][1]}]"
    if kw == "format":
        return f"Invalid value: {v!r}: should be an RFC 3339 date-time"
    if kw in _BOUNDS:
        return f"should have {_BOUNDS[kw][0]} {want} {_BOUNDS[kw][1]}, has {len(v)}"
    return e.message  # the Kubernetes keywords above wrote their own; anything else in jsonschema's words


def _problems(errors: Iterator[ValidationError], base: str) -> list[Problem]:
    """One Problem per field a jsonschema error names: an unknown field or a missing required one each get their own."""
    out: list[Problem] = []
    for e in errors:
        path = base
        for key in e.absolute_path:
            path = child_path(path, key if isinstance(key, int) else str(key))
        if e.validator == "additionalProperties":
            known = e.schema.get("properties", {})
            out += [Problem(child_path(path, str(k)), _unknown_field(k, known), LAYER) for k in e.instance if k not in known]
        elif e.validator == "required":
            out += [Problem(child_path(path, k), "Required value", LAYER) for k in e.validator_value if k not in e.instance]
        else:
            out.append(Problem(path, _message(e), LAYER))
    return list(dict.fromkeys(out))


# --- ObjectMeta and the entry points --------------------------------------------------------------------
_STRING, _STRING_MAP = {"type": "string"}, {"type": "object", "additionalProperties": {"type": "string"}}
_OBJECT_META = _Structural({"type": "object", "additionalProperties": False, "properties": {
    "name": _STRING, "generateName": _STRING, "namespace": _STRING, "labels": _STRING_MAP, "annotations": _STRING_MAP,
    "finalizers": {"type": "array", "items": _STRING}, "ownerReferences": {"type": "array"}, "uid": _STRING,
    "resourceVersion": _STRING, "generation": {"type": "integer"}, "creationTimestamp": _STRING,
    "deletionTimestamp": _STRING, "deletionGracePeriodSeconds": {"type": "integer"}, "managedFields": {"type": "array"},
    "selfLink": _STRING}})


def _check_object_meta(meta: Any) -> list[Problem]:
    if isinstance(meta, dict):
        meta = {k: v for k, v in meta.items() if v is not None}  # the server prunes nulls
    problems = _problems(_OBJECT_META.iter_errors(meta), "metadata")
    if not isinstance(meta, dict):
        return problems
    name = meta.get("name")
    if not name and not meta.get("generateName"):
        problems.append(Problem("metadata.name", "Required value: name or generateName is required", LAYER))
    if isinstance(name, str) and name:
        problems += [Problem("metadata.name", f"Invalid value: {name!r}: a DNS-1123 subdomain {e}", LAYER)
                     for e in dns1123_subdomain_errors(name)]
    namespace = meta.get("namespace")
    if isinstance(namespace, str):
        problems += [Problem("metadata.namespace", f"Invalid value: {namespace!r}: a DNS-1123 label {e}", LAYER)
                     for e in dns1123_label_errors(namespace)]
    for field in ("labels", "annotations"):
        for k, v in (meta.get(field) if isinstance(meta.get(field), dict) else {}).items():
            path = child_path(f"metadata.{field}", str(k))
            if field == "labels" and isinstance(v, str):
                problems += [Problem(path, f"Invalid label value {v!r}: {e}", LAYER) for e in label_value_errors(v)]
            problems += [Problem(path, f"Invalid {field[:-1]} key {k!r}: {e}", LAYER) for e in qualified_name_errors(str(k))]
    return problems


def check_schema(doc: dict, crd_dir: Path | None = None) -> list[Problem]:
    """Layer 1: every way `doc` breaks its CRD's schema, CEL rules included, as a list of Problems."""
    api_version, kind = doc.get("apiVersion"), doc.get("kind")
    if not isinstance(api_version, str) or not isinstance(kind, str):
        return [Problem("apiVersion" if not isinstance(api_version, str) else "kind", "Required value: a string", LAYER)]
    try:
        schema, validator = _compiled(*_locate(api_version, kind, crd_dir))
    except CrdNotFound as e:
        return [Problem("kind", str(e), LAYER)]
    problems = _check_object_meta({} if doc.get("metadata") is None else doc["metadata"])
    body = {k: v for k, v in apply_defaults(doc, schema).items() if k not in ("metadata", "status")}
    return problems + _problems(validator.iter_errors(body), "")


def with_defaults(doc: dict, crd_dir: Path | None = None) -> dict:
    """`doc` as the operator would receive it: CRD defaults applied (unchanged copy if no CRD is found)."""
    api_version, kind = doc.get("apiVersion"), doc.get("kind")
    try:
        if not isinstance(api_version, str) or not isinstance(kind, str):
            raise CrdNotFound("apiVersion and kind must be strings")
        schema = find_version(api_version, kind, crd_dir)["schema"]["openAPIV3Schema"]
    except CrdNotFound:
        return copy.deepcopy(doc)
    return apply_defaults(doc, schema)
