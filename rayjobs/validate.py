"""Offline validation of KubeRay manifests: everything short of a live API server, in four passes.

1. `crd-schema` (rayjobs.crd_schema): the KubeRay v1.7.0 CRD's OpenAPI schema and CEL rules, strict field validation.
2. `kuberay` (rayjobs.kuberay_rules): what the operator's validation.go and RayCluster webhook reject.
3. `ray` (rayjobs.ray_schemas): serveConfigV2, runtimeEnvYAML and entrypoint against Ray's own schemas.
4. `preflight` (rayjobs.preflight, rayjobs.hardening): rayline's checks for manifests that are accepted but would
   hang, OOM or leak, and for pods without rayline's hardening (restricted security contexts, no needless
   service-account token, credentials per role).

The core kinds rayline renders next to its Ray objects (Namespace, ServiceAccount, Secret, NetworkPolicy, Role,
RoleBinding) go through their own schema (rayjobs.core_schemas) and the hardening checks instead.
A manifest that passes is "validated", not "applied": no cluster has seen it. YAML is read the way kubectl
reads it: duplicate keys are errors and timestamps stay strings. A document of any other kind with no CRD in the
CRD directory (say a ConfigMap next to the RayJob) is reported, not skipped, so nothing passes unchecked.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable

import yaml

from rayjobs.cluster_profile import Profile
from rayjobs.core_schemas import check_core, is_core
from rayjobs.crd_schema import Problem, check_schema, with_defaults
from rayjobs.hardening import check_hardening
from rayjobs.kuberay_rules import check_kuberay_rules
from rayjobs.preflight import check_preflight
from rayjobs.ray_schemas import check_ray_schemas

__all__ = ["Problem", "ValidatedDocument", "load_manifests", "validate_documents", "validate_files", "validate_manifest"]

_BASE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _ManifestLoader(_BASE_LOADER):  # type: ignore[misc,valid-type]
    """SafeLoader that, like kubectl, rejects duplicate keys and keeps timestamps as strings."""


_ManifestLoader.yaml_implicit_resolvers = {
    first: [r for r in resolvers if r[0] != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in _BASE_LOADER.yaml_implicit_resolvers.items()
}


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first defined on line {seen[key]})", key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        except TypeError:  # an unhashable key; construct_mapping reports it
            pass
    return loader.construct_mapping(node, deep=True)


_ManifestLoader.add_constructor("tag:yaml.org,2002:map", _construct_mapping)


@dataclasses.dataclass
class ValidatedDocument:
    """One YAML document of a file and what the four layers found in it."""

    source: str  # "file.yaml", or "file.yaml#2" for the 2nd document of a multi-document file
    kind: str
    name: str
    problems: list[Problem]


def validate_manifest(doc: dict, crd_dir: Path | None = None, project_root: Path | None = None,
                      feature_gates: dict[str, bool] | None = None, profile: Profile | None = None) -> list[Problem]:
    """Every problem in one manifest, all four layers (a core kind: its schema, then the hardening checks).

    crd_dir: directory of CRD YAMLs (default: the KubeRay v1.7.0 CRDs shipped in rayjobs/crds/v1.7.0).
    project_root: where `python -m MODULE` entrypoints and Serve import paths must be importable from
    (default: this repository). feature_gates: KubeRay operator gates that differ from v1.7.0's defaults.
    profile: the cluster profile it was rendered with, for the Secret names (default: the built-in profile).
    """
    if not isinstance(doc, dict):
        return [Problem("", f"a manifest must be a YAML mapping, got {type(doc).__name__}", "yaml")]
    if is_core(doc):
        problems = check_core(doc)
        return problems or check_hardening(doc, profile)
    problems = check_schema(doc, crd_dir)
    layers = (
        # The operator sees the object after the API server applied the CRD defaults.
        ("kuberay", lambda: check_kuberay_rules(with_defaults(doc, crd_dir), feature_gates)),
        ("ray", lambda: check_ray_schemas(doc, project_root)),
        ("preflight", lambda: check_preflight(doc) + check_hardening(doc, profile)),
    )
    for layer, run in layers:
        try:
            problems += run()
        except (TypeError, AttributeError, ValueError, KeyError, IndexError):
            if not problems:
                raise  # a well-formed manifest must never crash a layer: that is a bug here
            # A mistyped field the schema already reported can trip later layers; the server would stop there too.
            problems.append(Problem("", f"{layer} checks skipped: fix the problems above first", layer))
    return problems


def load_manifests(path: Path) -> list[Any]:
    """The YAML documents of a file (a `kind: List` is expanded), empty documents dropped; raises yaml.YAMLError."""
    with open(path, encoding="utf-8") as f:
        docs = [d for d in yaml.load_all(f, Loader=_ManifestLoader) if d is not None]
    return [item for d in docs for item in (d.get("items") or [] if isinstance(d, dict) and d.get("kind") == "List" else [d])]


def validate_documents(path: Path | str, crd_dir: Path | None = None, project_root: Path | None = None,
                       feature_gates: dict[str, bool] | None = None,
                       profile: Profile | None = None) -> list[ValidatedDocument]:
    """Validate each document of one file; unreadable or unparsable files become a single `yaml` problem."""
    path = Path(path)
    try:
        docs = load_manifests(path)
    except OSError as e:
        return [ValidatedDocument(str(path), "", "", [Problem("", f"cannot read file: {e.strerror}", "yaml")])]
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        message = f"{where}{getattr(e, 'problem', None) or e}"
        return [ValidatedDocument(str(path), "", "", [Problem("", f"not valid YAML: {message}", "yaml")])]
    if not docs:
        return [ValidatedDocument(str(path), "", "", [Problem("", "no YAML documents in file", "yaml")])]
    results = []
    for n, doc in enumerate(docs, start=1):
        source = str(path) if len(docs) == 1 else f"{path}#{n}"
        kind = str(doc.get("kind", "")) if isinstance(doc, dict) else ""
        name = str((doc.get("metadata") or {}).get("name", "")) if isinstance(doc, dict) and isinstance(doc.get("metadata"), dict) else ""
        results.append(ValidatedDocument(source, kind, name, validate_manifest(doc, crd_dir, project_root, feature_gates, profile)))
    return results


def validate_files(paths: Iterable[Path | str], crd_dir: Path | None = None, project_root: Path | None = None,
                   feature_gates: dict[str, bool] | None = None, profile: Profile | None = None) -> dict[str, list[Problem]]:
    """{source: problems} for every document of every file; a source is the path, or `path#N` for the
    N-th document (1-based) of a multi-document file. Empty lists mean the document validated."""
    return {
        d.source: d.problems
        for p in paths
        for d in validate_documents(p, crd_dir, project_root, feature_gates, profile)
    }
