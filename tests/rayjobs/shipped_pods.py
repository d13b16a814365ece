"""The shipped manifests and the pods each one creates, as the rayjobs tests read them."""

from __future__ import annotations

import yaml

from rayjobs import stages

ROOT = stages.PROJECT_ROOT


def shipped(fname: str) -> dict:
    """The first document (the RayJob or RayService) of a shipped manifest under rayjobs/."""
    return next(yaml.safe_load_all((ROOT / "rayjobs" / "rendered" / fname).read_text()))


def pods(doc: dict) -> list[tuple[str, dict]]:
    """(name, pod template) of every pod the manifest creates: head, worker groups, and a RayJob's submitter."""
    cluster = doc["spec"].get("rayClusterSpec") or doc["spec"]["rayClusterConfig"]
    out = [("head", cluster["headGroupSpec"]["template"])]
    out += [(g["groupName"], g["template"]) for g in cluster["workerGroupSpecs"]]
    return out + ([("submitter", doc["spec"]["submitterPodTemplate"])] if "submitterPodTemplate" in doc["spec"] else [])


HEAD = "spec.rayClusterSpec.headGroupSpec.template.spec"
WORKER = "spec.rayClusterSpec.workerGroupSpecs[0].template.spec"
SERVE_WORKER = "spec.rayClusterConfig.workerGroupSpecs[0].template.spec"


def at(doc: dict, path: str):
    """The node at a dotted path with [i] indexes (`spec.workerGroupSpecs[0].template`) in a manifest."""
    node = doc
    for part in path.replace("]", "").replace("[", ".").split("."):
        node = node[int(part)] if part.isdigit() else node[part]
    return node
