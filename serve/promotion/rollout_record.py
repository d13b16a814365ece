"""What a rollout writes to MLflow, so "which version served when, and why not that one" has an answer.

Model version tags (times are UTC ISO-8601):
  deployed_at, rollout.status=deployed, rollout.triggered_by, rollout.run_id, rollout.previous_version
  retired_at, rollout.status=retired, rollout.retired_by_version          (the version it replaced)
  rollout.status=rejected, rollout.rejected_reason, rollout.rejected_at   (refused by the gate)
  rollout.status=rolled_back, rollout.failed_reason, rollout.failed_at     (deploy or verify failed)
One run per rollout attempt in the `rayline-rollout` experiment: tags rollout.model / from_version /
to_version / status / triggered_by / target, metrics duration_s (start -> new version answering),
gate_s, deploy_s, verify_s, the phases `rollout/seconds_<phase>` that add up to duration_s
(serve/promotion/rollout_phases.py), and the rendered serve config as the artifact `serve_config.json`.
"""

from __future__ import annotations

import getpass
import socket
from datetime import datetime, timezone

from core import registry, usage

TAG_STATUS = "rollout.status"
TAG_DEPLOYED_AT = "deployed_at"
TAG_RETIRED_AT = "retired_at"
TAG_TRIGGERED_BY = "rollout.triggered_by"
TAG_RUN_ID = "rollout.run_id"
TAG_PREVIOUS_VERSION = "rollout.previous_version"
TAG_RETIRED_BY = "rollout.retired_by_version"
TAG_REJECTED_REASON = "rollout.rejected_reason"
TAG_REJECTED_AT = "rollout.rejected_at"
TAG_FAILED_REASON = "rollout.failed_reason"
TAG_FAILED_AT = "rollout.failed_at"

STATUS_DEPLOYED, STATUS_RETIRED, STATUS_REJECTED, STATUS_ROLLED_BACK = "deployed", "retired", "rejected", "rolled_back"

# MLflow caps tag values at 8000 characters; reasons are cut well below that.
MAX_REASON = 4000


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def default_trigger() -> str:
    """Who started this rollout when nobody said: the Ray job, else the user and host."""
    job_id = registry.ray_job_id()
    if job_id:
        return f"ray-job:{job_id}"
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"cli:{user}@{socket.gethostname()}"


def _reason(text: str) -> str:
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


def record_deployed(name: str, version: str, previous: str | None, triggered_by: str, run_id: str | None) -> None:
    """Tag the version now serving, and retire the one it replaced (when it is a version of the same model)."""
    at = now_iso()
    tags = {TAG_STATUS: STATUS_DEPLOYED, TAG_DEPLOYED_AT: at, TAG_TRIGGERED_BY: triggered_by,
            TAG_PREVIOUS_VERSION: previous or ""}
    if run_id:
        tags[TAG_RUN_ID] = run_id
    registry.set_version_tags(name, version, tags)
    if previous and previous != version:
        registry.set_version_tags(name, previous, {TAG_STATUS: STATUS_RETIRED, TAG_RETIRED_AT: at, TAG_RETIRED_BY: version})


def record_rejected(name: str, version: str, reasons: list[str], triggered_by: str, run_id: str | None) -> None:
    tags = {TAG_STATUS: STATUS_REJECTED, TAG_REJECTED_REASON: _reason("; ".join(reasons)),
            TAG_REJECTED_AT: now_iso(), TAG_TRIGGERED_BY: triggered_by}
    if run_id:
        tags[TAG_RUN_ID] = run_id
    registry.set_version_tags(name, version, tags)


def record_rolled_back(name: str, version: str, reason: str, triggered_by: str, run_id: str | None) -> None:
    tags = {TAG_STATUS: STATUS_ROLLED_BACK, TAG_FAILED_REASON: _reason(reason), TAG_FAILED_AT: now_iso(),
            TAG_TRIGGERED_BY: triggered_by}
    if run_id:
        tags[TAG_RUN_ID] = run_id
    registry.set_version_tags(name, version, tags)


def run_tags(name: str, alias: str, from_version: str | None, to_version: str, triggered_by: str, target: str) -> dict:
    """Tags of the rollout run (plus the lineage every rayline run carries)."""
    return registry.lineage_tags(
        "rollout", **{"rollout.model": name, "rollout.alias": alias, "rollout.from_version": from_version or "",
                      "rollout.to_version": to_version, TAG_TRIGGERED_BY: triggered_by, "rollout.target": target},
    )


def record_usage(name: str, version: str | None, run_id: str | None, deployed: bool, cpu_s: float) -> None:
    """An attempt's CPU seconds (the rollout's own process: the gate's hashing, the deploy and verify calls) on its
    run, in Prometheus and, once deployed, on the version. The new replicas' start-up runs in Serve's processes, which
    belong to Serve's own job: not in this figure."""
    used = usage.Usage(cpu_s, 0.0, 1, cpu_s)
    usage.record("rollout", used, run_id, model=name, version=version or "")
    if deployed:
        usage.tag_version(name, version, "rollout", used)
