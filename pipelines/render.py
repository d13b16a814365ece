"""Render a stage config into a validated KubeRay manifest (RayJob, or RayService for serving) and its cluster's
NetworkPolicy.

    python -m pipelines.render --stage data|train|tune|batch_infer|rollout|serve --config configs/...yaml
                               [--profile configs/k8s/default.yaml] [--image IMAGE] [-o rayjobs/FILE.yaml]
    python -m pipelines.render --shipped     # re-render every manifest in rayjobs/ from configs/, and the
                                             # namespace's (Namespace, NetworkPolicies, ServiceAccounts, RBAC)
    python -m pipelines.render --podmonitor [--podmonitor-label release=prometheus] [-o FILE]
                               # a Prometheus Operator PodMonitor for every rayline Ray pod (rayjobs/monitoring.py)
"""

from __future__ import annotations

import argparse
import sys

import yaml

from core.config import ConfigError
from rayjobs import render, stages


def _podmonitor(profile, label_args: list[str], out: str | None) -> int:
    from rayjobs.monitoring import check_podmonitor, podmonitor

    labels = {}
    for item in label_args:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"--podmonitor-label {item!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
        labels[key] = value
    doc = podmonitor(profile, labels)
    problems = check_podmonitor(doc)
    for prob in problems:
        print(f"{out or '<stdout>'}: {prob}", file=sys.stderr)
    if problems:
        return 1
    text = yaml.safe_dump(doc, sort_keys=False)
    if out:
        with open(out, "w") as f:
            f.write(text)
    else:
        print(text)
    print(f"{out or '<stdout>'}: PodMonitor rendered and validated (not applied)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", choices=sorted(stages.STAGES))
    p.add_argument("--config", "-c")
    p.add_argument("--profile", default=None, help="cluster profile YAML (default configs/k8s/default.yaml)")
    p.add_argument("--image", default=None, help="container image (its tag must carry the pinned Ray version)")
    p.add_argument("--crd-dir", default=None, help="KubeRay CRDs to validate against (default: v1.7.0, shipped in rayjobs/crds/v1.7.0)")
    p.add_argument("-o", "--out", default=None, help="write here (default: print)")
    p.add_argument("--shipped", action="store_true", help="re-render rayjobs/*.yaml from the shipped configs")
    p.add_argument("--podmonitor", action="store_true", help="render a PodMonitor for rayline's Ray pods instead")
    p.add_argument("--podmonitor-label", action="append", default=[], metavar="KEY=VALUE",
                   help="label on the PodMonitor that your Prometheus selects it by (repeatable)")
    p.add_argument("overrides", nargs="*", help="stage config key=value overrides")
    args = p.parse_args(argv)
    try:
        profile = render.load_profile(args.profile, args.image)
        if args.podmonitor:
            return _podmonitor(profile, args.podmonitor_label, args.out)
        if args.shipped:
            results = render.render_shipped(profile=profile)
        elif not (args.stage and args.config):
            p.error("--stage and --config are required (or --shipped)")
        elif args.out:
            results = {args.out: render.render_to_file(args.stage, args.config, args.out, profile, args.overrides,
                                                       args.crd_dir)}
        else:
            docs = render.render_documents(args.stage, args.config, profile, args.overrides)
            results = {"<stdout>": render.validate_rendered(docs, profile, args.crd_dir)}
            if not results["<stdout>"]:
                print(yaml.safe_dump_all(docs, sort_keys=False))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    failed = False
    for target, problems in results.items():
        if problems:
            failed = True
            for prob in problems:
                print(f"{target}: {prob.path}: {prob.message} [{prob.layer}]" if hasattr(prob, "path")
                      else f"{target}: {prob}", file=sys.stderr)
        else:
            print(f"{target}: rendered and validated (not applied)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
