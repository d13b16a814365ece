"""Validate KubeRay manifests offline: `python -m pipelines.validate FILE... [--crd-dir DIR]`.

Runs the four layers of `rayjobs.validate` (CRD schema + CEL, KubeRay operator rules, Ray schemas, rayline
preflight with its hardening checks) on every document of every file (a Namespace, ServiceAccount, Secret,
NetworkPolicy, Role or RoleBinding: its schema and the hardening checks) and prints

    FILE: validated (RayJob my-job): 3 layers + preflight passed
    FILE#2: validated (NetworkPolicy my-job-ray-cluster): schema + preflight passed
    FILE: spec.shutdownAfterJobFinish: unknown field "shutdownAfterJobFinish" ... [crd-schema]

Exit status 1 if any document has a problem, 0 if all validated. Nothing is applied to a cluster.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from core.config import ConfigError, load_config
from rayjobs.cluster_profile import Profile
from rayjobs.core_schemas import SCHEMAS
from rayjobs.validate import validate_documents


def _gate(text: str) -> tuple[str, bool]:
    name, sep, value = text.partition("=")
    if not sep or value.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"--feature-gate wants NAME=true|false, got {text!r}")
    return name, value.lower() == "true"


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, validate, print one line per validated document or per problem; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m pipelines.validate", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="manifest YAML files (multi-document and kind: List work)")
    parser.add_argument("--crd-dir", type=Path, default=None, help="directory of CRD YAMLs, e.g. `kubectl get crd ... -o yaml` output (default: rayjobs/crds/v1.7.0)")
    parser.add_argument("--project-root", type=Path, default=None, help="where entrypoint modules and Serve import paths must be importable from")
    parser.add_argument("--feature-gate", type=_gate, action="append", default=[], metavar="NAME=BOOL",
                        help="KubeRay operator feature gate that differs from v1.7.0's defaults (repeatable)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="cluster profile the manifests were rendered with, for its Secret names (default: the built-in one)")
    args = parser.parse_args(argv)
    try:
        profile = load_config(Profile, args.profile) if args.profile else None
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    core_kinds = {kind for _, kind in SCHEMAS}
    failed = False
    for path in args.files:
        for doc in validate_documents(path, args.crd_dir, args.project_root, dict(args.feature_gate), profile):
            if not doc.problems:
                layers = "schema" if doc.kind in core_kinds else "3 layers"
                print(f"{doc.source}: validated ({doc.kind} {doc.name}): {layers} + preflight passed")
            for p in doc.problems:
                failed = True
                print(f"{doc.source}: {p.path or '<document>'}: {p.message} [{p.layer}]")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
