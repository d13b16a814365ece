"""Layer 1: a KubeRay manifest against its CRD's OpenAPI schema, as an API server with strict field validation would.

No API server runs here, so this module does its job offline: it loads the KubeRay v1.7.0 CRDs (default
`<project root>/../shared/kuberay-crds/v1.7.0/`, or any directory of CRD YAML such as
`kubectl get crd rayjobs.ray.io -o yaml` output), picks the CRD by the manifest's apiVersion group and kind
and the schema of that version, applies the schema's defaults and reports every problem it finds:

- unknown fields (unless `x-kubernetes-preserve-unknown-fields`), with a "did you mean" for typos;
- types (`integer` never accepts booleans or 1.0, `number`, `string`, `boolean`), `x-kubernetes-int-or-string`,
  `nullable` (a null in a non-nullable field is dropped, as the server prunes it), int32/int64 and
  date-time formats, enum, required, minimum/maximum, min/maxItems, min/maxLength, min/maxProperties, pattern;
- `x-kubernetes-list-type: map` (duplicate map keys) and `set` (duplicate items);
- `x-kubernetes-validations`: `evaluate_cel` (bottom of this module) runs the CEL subset these CRDs use;
  a rule outside it is reported as "unsupported CEL rule", never passed; transition rules (`oldSelf`)
  are skipped because a fresh manifest is a create;
- the top-level `metadata` as ObjectMeta: name (DNS-1123 subdomain, as for every custom resource),
  namespace (DNS-1123 label), label keys/values, annotation keys, string maps.

`status` is not checked: these CRDs have a status subresource, so the server drops it on create.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import datetime
import difflib
import functools
import re
from pathlib import Path
from typing import Any

import yaml

LAYER = "crd-schema"
DEFAULT_CRD_DIR = Path(__file__).resolve().parents[1].parent / "shared/kuberay-crds/v1.7.0"
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


# --- Kubernetes name rules (k8s.io/apimachinery/pkg/util/validation) -------------------------------------
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


def dns1123_label_errors(value: str) -> list[str]:
    """Why `value` is not a DNS-1123 label (namespace names, Service names); empty if it is one."""
    errs = [] if _DNS1123_LABEL.fullmatch(value) else ["must consist of lower case alphanumerics or '-', and start and end with an alphanumeric"]
    return errs + (["must be no more than 63 characters"] if len(value) > 63 else [])


def dns1035_label_errors(value: str) -> list[str]:
    """Why `value` is not a DNS-1035 label (KubeRay's rule for RayCluster/RayJob/RayService names)."""
    errs = [] if _DNS1035_LABEL.fullmatch(value) else ["must consist of lower case alphanumerics or '-', start with a letter and end with an alphanumeric"]
    return errs + (["must be no more than 63 characters"] if len(value) > 63 else [])


def dns1123_subdomain_errors(value: str) -> list[str]:
    """Why `value` is not a DNS-1123 subdomain (custom resource names, label key prefixes)."""
    ok = all(_DNS1123_LABEL.fullmatch(part) for part in value.split("."))
    errs = [] if ok else ["must consist of lower case alphanumerics, '-' or '.', and start and end with an alphanumeric"]
    return errs + (["must be no more than 253 characters"] if len(value) > 253 else [])


def qualified_name_errors(value: str) -> list[str]:
    """Why `value` is not a qualified name (`prefix/name`), the rule for label and annotation keys."""
    prefix, _, name = value.rpartition("/")
    errs = [f"prefix {e}" for e in dns1123_subdomain_errors(prefix)] if "/" in value else []
    if not _QUALIFIED_NAME.fullmatch(name):
        errs.append("name part must be alphanumerics, '-', '_' or '.', starting and ending with an alphanumeric")
    if len(name) > 63:
        errs.append("name part must be no more than 63 characters")
    return errs


def label_value_errors(value: str) -> list[str]:
    """Why `value` is not a valid label value (empty, or a qualified name part of at most 63 characters)."""
    if value == "":
        return []
    return qualified_name_errors(value) if "/" not in value else ["must not contain '/'"]


# --- CRD loading ----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=32)
def _crds_in_file(path: str, mtime: float) -> tuple[dict, ...]:
    """CustomResourceDefinitions in one YAML/JSON file (multi-doc or a `kind: List`); cached per mtime."""
    with open(path, encoding="utf-8") as f:
        docs = [d for d in yaml.load_all(f, Loader=_LOADER) if isinstance(d, dict)]
    docs = [i for d in docs for i in (d.get("items") or [] if d.get("kind") == "List" else [d])]
    return tuple(d for d in docs if d.get("kind") == "CustomResourceDefinition")


def find_version(api_version: str, kind: str, crd_dir: Path | None = None) -> dict:
    """The CRD `spec.versions[]` entry serving `api_version` (`group/version`) for `kind`; raises CrdNotFound."""
    crd_dir = Path(crd_dir) if crd_dir else DEFAULT_CRD_DIR
    if not crd_dir.is_dir():
        raise CrdNotFound(f"CRD directory {crd_dir} does not exist; pass --crd-dir with the KubeRay CRD YAMLs")
    group, _, version = api_version.rpartition("/")
    files = sorted(p for p in crd_dir.iterdir() if p.suffix in (".yaml", ".yml", ".json"))
    # Parse the file named after the kind first: each CRD is ~1 MB of YAML.
    files.sort(key=lambda p: kind.lower() not in p.name.lower())
    for p in files:
        for crd in _crds_in_file(str(p), p.stat().st_mtime):
            spec = crd.get("spec", {})
            if spec.get("group") != group or spec.get("names", {}).get("kind") != kind:
                continue
            for v in spec.get("versions", []):
                if v.get("name") == version and v.get("served", True):
                    return v
            served = [v.get("name") for v in spec.get("versions", []) if v.get("served", True)]
            raise CrdNotFound(f"{group} {kind} is not served at version {version!r} (served: {served})")
    raise CrdNotFound(f"no CRD for apiVersion {api_version!r} kind {kind!r} in {crd_dir}")


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


# --- schema walk ----------------------------------------------------------------------------------------
_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_PATTERN_NAMES = {  # the patterns these CRDs repeat, said in words
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$":
        "must be a Kubernetes quantity such as 500m, 2, 1.5 or 16Gi",
}
_DATE_TIME = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")


def _type_of(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, (str, datetime.date)):
        return "string"
    return {dict: "object", list: "array"}.get(type(value), type(value).__name__)


def _fits(value: Any, typ: str) -> bool:
    actual = _type_of(value)
    return actual == typ or (typ == "number" and actual == "integer")


class _Walker:
    """Validates a value against a structural schema, appending to `problems`."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []
        self.structural = 0  # problems other than failed CEL rules

    def add(self, path: str, message: str, cel: bool = False) -> None:
        self.problems.append(Problem(path, message, LAYER))
        self.structural += not cel

    def check(self, value: Any, schema: dict, path: str) -> None:
        before = self.structural
        if schema.get("x-kubernetes-int-or-string"):
            if _type_of(value) not in ("integer", "string"):
                return self.add(path, f"must be an integer or a string, got {_type_of(value)} {value!r}")
            self._scalar(value, schema, path)
        elif "type" in schema:
            if not _fits(value, schema["type"]):
                return self.add(path, f"must be of type {schema['type']}, got {_type_of(value)} {value!r}")
            {"object": self._object, "array": self._array}.get(schema["type"], self._scalar)(value, schema, path)
        elif not schema.get("x-kubernetes-preserve-unknown-fields"):
            self._combinators(value, schema, path)
        if self.structural == before:  # CEL only sees values that passed the structural checks
            for rule in schema.get("x-kubernetes-validations", []):
                self._cel(value, rule, path)

    def _combinators(self, value: Any, schema: dict, path: str) -> None:
        for key in ("anyOf", "oneOf"):
            if key in schema:
                ok = sum(not _Walker._errors(value, s, path) for s in schema[key])
                if ok == 0 or (key == "oneOf" and ok > 1):
                    self.add(path, f"{value!r} does not match {'any' if ok == 0 else 'exactly one'} of {schema[key]}")
        for s in schema.get("allOf", []):
            for p in _Walker._errors(value, s, path):
                self.add(p.path, p.message)

    @staticmethod
    def _errors(value: Any, schema: dict, path: str) -> list[Problem]:
        w = _Walker()
        w.check(value, schema, path)
        return w.problems

    def _object(self, value: dict, schema: dict, path: str) -> None:
        props, addl = schema.get("properties", {}), schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields", False)
        for key, v in value.items():
            if not isinstance(key, str):
                self.add(child_path(path, str(key)), f"field names must be strings, got {_type_of(key)} {key!r}")
                continue
            sub = props.get(key, addl if isinstance(addl, dict) else None)
            if sub is None:
                if not (addl is True or preserve):
                    near = difflib.get_close_matches(key, props, n=1, cutoff=0.75)
                    hint = f' (did you mean "{near[0]}"?)' if near else ""
                    known = "" if near or not props or len(props) > 12 else f"; known fields: {', '.join(sorted(props))}"
                    self.add(child_path(path, key), f'unknown field "{key}"{hint}{known}')
                continue
            if v is None and not sub.get("nullable"):
                continue  # the server prunes non-nullable nulls before validating
            self.check(v, sub, child_path(path, key))
        for req in schema.get("required", []):
            if value.get(req) is None:
                self.add(child_path(path, req), "Required value")
        self._bounds(len(value), schema, "minProperties", "maxProperties", path, "properties")

    def _array(self, value: list, schema: dict, path: str) -> None:
        items = schema.get("items")
        if isinstance(items, dict):
            for i, v in enumerate(value):
                if v is None and not items.get("nullable"):
                    self.add(child_path(path, i), "must not be null")
                else:
                    self.check(v, items, child_path(path, i))
        self._bounds(len(value), schema, "minItems", "maxItems", path, "items")
        list_type = schema.get("x-kubernetes-list-type")
        seen: dict[str, int] = {}
        for i, v in enumerate(value):
            if list_type == "map" and isinstance(v, dict):
                key = repr(tuple(v.get(k) for k in schema.get("x-kubernetes-list-map-keys", [])))
                what = ", ".join(f"{k}={v.get(k)!r}" for k in schema.get("x-kubernetes-list-map-keys", []))
            elif list_type == "set" or schema.get("uniqueItems"):
                key, what = repr(v), repr(v)
            else:
                continue
            if key in seen:
                self.add(child_path(path, i), f"Duplicate value: {what} (same as [{seen[key]}])")
            seen.setdefault(key, i)

    def _scalar(self, value: Any, schema: dict, path: str) -> None:
        if "enum" in schema and value not in schema["enum"]:
            self.add(path, f"Unsupported value: {value!r}: supported values: {', '.join(map(repr, schema['enum']))}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            lo, hi = _INT_RANGES.get(schema.get("format"), (None, None))
            if isinstance(value, int) and lo is not None and not lo <= value <= hi:
                self.add(path, f"{value} is out of the {schema['format']} range [{lo}, {hi}]")
            if "minimum" in schema and (value < schema["minimum"] or (schema.get("exclusiveMinimum") and value == schema["minimum"])):
                self.add(path, f"Invalid value: {value}: should be greater than or equal to {schema['minimum']}")
            if "maximum" in schema and (value > schema["maximum"] or (schema.get("exclusiveMaximum") and value == schema["maximum"])):
                self.add(path, f"Invalid value: {value}: should be less than or equal to {schema['maximum']}")
            if schema.get("multipleOf") and value % schema["multipleOf"]:
                self.add(path, f"Invalid value: {value}: should be a multiple of {schema['multipleOf']}")
        if isinstance(value, str):
            self._bounds(len(value), schema, "minLength", "maxLength", path, "characters")
            if "pattern" in schema and not re.search(schema["pattern"], value):
                what = _PATTERN_NAMES.get(schema["pattern"], f"should match {schema['pattern']!r}")
                self.add(path, f"Invalid value: {value!r}: {what}")
            if schema.get("format") == "date-time" and not _DATE_TIME.fullmatch(value):
                self.add(path, f"Invalid value: {value!r}: should be an RFC 3339 date-time")

    def _bounds(self, n: int, schema: dict, lo_key: str, hi_key: str, path: str, unit: str) -> None:
        if lo_key in schema and n < schema[lo_key]:
            self.add(path, f"should have at least {schema[lo_key]} {unit}, has {n}")
        if hi_key in schema and n > schema[hi_key]:
            self.add(path, f"may not have more than {schema[hi_key]} {unit}, has {n}")

    def _cel(self, value: Any, rule: dict, path: str) -> None:
        expr = rule.get("rule", "")
        where = path + rule.get("fieldPath", "") if rule.get("fieldPath", "").startswith(".") else path
        if re.search(r"\boldSelf\b", expr) and not rule.get("optionalOldSelf"):
            return  # a transition rule: the server only runs it on update, and this is a create
        try:
            ok = evaluate_cel(expr, value)
        except UnsupportedCel as e:
            return self.add(where, f"unsupported CEL rule {expr!r} ({e}); check it by hand or extend rayjobs.crd_schema")
        except CelError as e:
            return self.add(where, f"CEL rule {expr!r} could not be evaluated: {e}")
        if not ok:
            self.add(where, rule.get("message") or f"failed rule: {expr}", cel=True)


# --- the CEL subset -------------------------------------------------------------------------------------
class UnsupportedCel(ValueError):
    """The rule uses CEL outside the subset rayline evaluates."""


class CelError(ValueError):
    """The rule is in the subset but failed at run time (e.g. a missing field read without has())."""


_CEL_TOKEN = re.compile(r"\s*(?:(&&|\|\||==|!=|[!()\[\],.])|('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")|(\d+)|([A-Za-z_]\w*))")


@functools.lru_cache(maxsize=256)
def _parse_cel(expr: str) -> tuple:
    """Parse `expr` into a tuple AST; raises UnsupportedCel for anything outside the subset."""
    tokens, pos = [], 0
    while pos < len(expr.rstrip()):
        m = _CEL_TOKEN.match(expr, pos)
        if not m:
            raise UnsupportedCel(f"unexpected text at {expr[pos:pos + 12]!r}")
        op, string, num, ident = m.groups()
        if op:
            tokens.append(("op", op))
        elif string:
            tokens.append(("lit", ast.literal_eval(string)))
        else:
            tokens.append(("lit", int(num)) if num else ("id", ident))
        pos = m.end()
    toks = tokens + [("end", None)]
    i = 0

    def peek(*ops: str) -> bool:
        return toks[i][0] in ("op", "id") and toks[i][1] in ops

    def take(*ops: str) -> str:
        nonlocal i
        if not peek(*ops):
            raise UnsupportedCel(f"expected {' or '.join(ops)}, found {toks[i][1]!r}")
        i += 1
        return toks[i - 1][1]

    def binary(next_fn, *ops: str):
        node = next_fn()
        while peek(*ops):
            node = (take(*ops), node, next_fn())
        return node

    def relation() -> tuple:
        node = unary()
        return (take("==", "!=", "in"), node, unary()) if peek("==", "!=", "in") else node

    def unary() -> tuple:
        if peek("!"):
            take("!")
            return ("!", unary())
        return primary()

    def primary() -> tuple:
        nonlocal i
        kind, val = toks[i]
        if peek("("):
            take("(")
            node = binary(lambda: binary(relation, "&&"), "||")
            take(")")
            return node
        if peek("["):
            take("[")
            items = [] if peek("]") else [binary(lambda: binary(relation, "&&"), "||")]
            while peek(","):
                take(",")
                items.append(binary(lambda: binary(relation, "&&"), "||"))
            take("]")
            return ("list", items)
        if kind == "lit" or (kind == "id" and val in ("true", "false", "null")):
            i += 1
            return ("lit", {"true": True, "false": False, "null": None}.get(val, val) if kind == "id" else val)
        if kind == "id" and val == "has":
            take("has")
            take("(")
            node = member()
            take(")")
            if node[0] != "field":
                raise UnsupportedCel("has() needs a field selection like has(self.x)")
            return ("has", node)
        return member()

    def member() -> tuple:
        nonlocal i
        if toks[i] != ("id", "self"):
            raise UnsupportedCel(f"only `self` is supported as a variable, found {toks[i][1]!r}")
        i += 1
        node: tuple = ("self",)
        while peek("."):
            take(".")
            if toks[i][0] != "id":
                raise UnsupportedCel("expected a field name after '.'")
            i += 1
            node = ("field", node, toks[i - 1][1])
        if peek("("):
            raise UnsupportedCel("function and method calls other than has() are not supported")
        return node

    tree = binary(lambda: binary(relation, "&&"), "||")
    if toks[i][0] != "end":
        raise UnsupportedCel(f"unexpected {toks[i][1]!r}")
    return tree


def _cel_eq(a: Any, b: Any) -> bool:
    return isinstance(a, bool) == isinstance(b, bool) and a == b  # CEL never equates true with 1


def _cel_eval(node: tuple, self_value: Any) -> Any:
    op = node[0]
    if op == "self":
        return self_value
    if op == "lit":
        return node[1]
    if op == "list":
        return [_cel_eval(n, self_value) for n in node[1]]
    if op == "field":
        obj = _cel_eval(node[1], self_value)
        if not isinstance(obj, dict) or node[2] not in obj:
            raise CelError(f"no such key: {node[2]}")
        return obj[node[2]]
    if op == "has":
        obj = _cel_eval(node[1][1], self_value)
        if not isinstance(obj, dict):
            raise CelError("has() on a value that is not an object")
        return node[1][2] in obj
    if op == "!":
        v = _cel_eval(node[1], self_value)
        if not isinstance(v, bool):
            raise CelError("! needs a bool")
        return not v
    if op in ("&&", "||"):
        # CEL's logical operators are commutative over errors: `error || true` is true.
        results = []
        for side in node[1:]:
            try:
                results.append(_cel_eval(side, self_value))
            except CelError as e:
                results.append(e)
        short = op == "||"
        if any(r is short for r in results):
            return short
        for r in results:
            if not isinstance(r, bool):
                raise r if isinstance(r, CelError) else CelError(f"{op} needs bools")
        return not short
    left, right = _cel_eval(node[1], self_value), _cel_eval(node[2], self_value)
    if op == "in":
        if isinstance(right, dict):
            return left in right
        if not isinstance(right, list):
            raise CelError("`in` needs a list or map on the right")
        return any(_cel_eq(left, r) for r in right)
    return _cel_eq(left, right) == (op == "==")


def evaluate_cel(expr: str, self_value: Any) -> bool:
    """Evaluate a CRD validation rule on `self_value`.

    Supported: `self` and field selection (`self.a.b`), `has(self.a)`, `!`, `&&`, `||`, `==`, `!=`, `in`,
    parentheses, string/int/bool/null literals and list literals. Anything else raises UnsupportedCel;
    run-time failures (reading a missing field) raise CelError.
    """
    result = _cel_eval(_parse_cel(expr), self_value)
    if not isinstance(result, bool):
        raise CelError(f"rule evaluated to {result!r}, not a bool")
    return result


# --- ObjectMeta and the entry point ---------------------------------------------------------------------
_OBJECT_META = {
    "name": str, "generateName": str, "namespace": str, "labels": dict, "annotations": dict, "finalizers": list,
    "ownerReferences": list, "uid": str, "resourceVersion": str, "generation": int, "creationTimestamp": (str, datetime.date),
    "deletionTimestamp": (str, datetime.date), "deletionGracePeriodSeconds": int, "managedFields": list, "selfLink": str,
}


def _check_object_meta(meta: Any, w: _Walker) -> None:
    if not isinstance(meta, dict):
        return w.add("metadata", f"must be of type object, got {_type_of(meta)}")
    for key, v in meta.items():
        path = child_path("metadata", str(key))
        if key not in _OBJECT_META:
            near = difflib.get_close_matches(str(key), _OBJECT_META, n=1, cutoff=0.75)
            w.add(path, f'unknown field "{key}"' + (f' (did you mean "{near[0]}"?)' if near else ""))
        elif v is not None and (isinstance(v, bool) or not isinstance(v, _OBJECT_META[key])):
            w.add(path, f"must be of type {getattr(_OBJECT_META[key], '__name__', 'string')}, got {_type_of(v)}")
    name = meta.get("name")
    if not name and not meta.get("generateName"):
        w.add("metadata.name", "Required value: name or generateName is required")
    if isinstance(name, str) and name:
        for e in dns1123_subdomain_errors(name):
            w.add("metadata.name", f"Invalid value: {name!r}: a DNS-1123 subdomain {e}")
    if isinstance(meta.get("namespace"), str):
        for e in dns1123_label_errors(meta["namespace"]):
            w.add("metadata.namespace", f"Invalid value: {meta['namespace']!r}: a DNS-1123 label {e}")
    for field in ("labels", "annotations"):
        entries = meta.get(field) if isinstance(meta.get(field), dict) else {}
        for k, v in entries.items():
            path = child_path(f"metadata.{field}", str(k))
            if not isinstance(v, str):
                w.add(path, f"{field} values must be strings, got {_type_of(v)} {v!r} (quote it in YAML)")
            elif field == "labels":
                for e in label_value_errors(v):
                    w.add(path, f"Invalid label value {v!r}: {e}")
            for e in qualified_name_errors(str(k)):
                w.add(path, f"Invalid {field[:-1]} key {k!r}: {e}")


def check_schema(doc: dict, crd_dir: Path | None = None) -> list[Problem]:
    """Layer 1: every way `doc` breaks its CRD's schema, CEL rules included, as a list of Problems."""
    w = _Walker()
    api_version, kind = doc.get("apiVersion"), doc.get("kind")
    if not isinstance(api_version, str) or not isinstance(kind, str):
        w.add("apiVersion" if not isinstance(api_version, str) else "kind", "Required value: a string")
        return w.problems
    try:
        schema = find_version(api_version, kind, crd_dir)["schema"]["openAPIV3Schema"]
    except CrdNotFound as e:
        return [Problem("kind", str(e), LAYER)]
    _check_object_meta(doc.get("metadata"), w)
    body = {k: v for k, v in apply_defaults(doc, schema).items() if k not in ("metadata", "status")}
    w.check(body, {**schema, "properties": {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}}, "")
    return w.problems


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
