"""Is the new version serving? The target's app status, then a smoke request that must name the new version.

The served version is read from the response's `system_fingerprint` ("name/N", set per engine by
serve/online/app.py), so the check proves the answering replica runs the new checkpoint, not only that
the app is up. Every request here carries an API key (`api_key`; rayline's own callers send the admin key,
`admin_key(cfg)`), as every route of the app needs one (serve/online/api_auth.py).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

from core import api_keys
from serve.online.app import ServedModel, served_model_of
from serve.promotion.deploy_target import AppState, DeployError
from serve.online.serve_config import Config as ServeConfig

FAILED = ("DEPLOY_FAILED", "UNHEALTHY")


@dataclass
class VerifyOutcome:
    ok: bool
    reason: str = ""
    seconds: float = 0.0


def admin_key(cfg: ServeConfig) -> str:
    """The admin key rayline's own requests to the app send: the serving config's `auth.admin_key_file`, else
    $RAYLINE_ADMIN_KEY_FILE (ValueError saying which to set when neither gives one)."""
    return api_keys.admin_key(cfg.auth.admin_key_file)


def key_header(api_key: str) -> dict[str, str]:
    """The header that carries an API key ({} without one: the app then answers 401)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def smoke_request(base_url: str, model_id: str, prompt: str, timeout_s: float = 30.0, api_key: str = "") -> dict:
    """One short completion; returns the response body (raises on HTTP errors or bad JSON)."""
    body = json.dumps({"model": model_id, "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base_url.rstrip('/')}/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", **key_header(api_key)})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def served_versions(base_url: str, timeout_s: float = 30.0, api_key: str = "") -> dict[str, dict]:
    """What the running app says it serves: model id (`rayline`, `rayline:<adapter>`) -> its model card's
    `metadata.rayline` ({ref, name, version, label, ...}), from GET /models. This is how a rollout learns the
    versions of an app deployed unpinned (a RayService's serveConfigV2), whose config names only aliases."""
    req = urllib.request.Request(f"{base_url.rstrip('/')}/models", headers=key_header(api_key))
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        cards = json.loads(r.read()).get("data") or []
    return {c["id"]: c["metadata"]["rayline"] for c in cards if (c.get("metadata") or {}).get("rayline")}


def wait_until_healthy(
    state: Callable[[], AppState], expected: ServedModel, timeout_s: float, fail_fast: bool = True,
    applied_at: float | None = None, poll_s: float = 1.0, replicas_before: set[str] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> VerifyOutcome:
    """Poll the target until the app runs `expected` (RUNNING), has failed, or `timeout_s` passes.

    With `replicas_before` (the replica ids the target reported before the deploy) and `on_phase`, the wait also says
    when it sees the new version's first replica (`on_phase("build")`) and all of them RUNNING
    (`on_phase("replica_start")`), where the target reports replicas (serve/promotion/rollout_phases.py)."""
    start = time.time()
    last = ""
    seen: set[str] = set()
    while time.time() - start < timeout_s:
        try:
            st = state()
        except DeployError as e:
            last = str(e)
            time.sleep(poll_s)
            continue
        pinned = served_model_of(st.app_config or {})
        fresh = applied_at is None or st.deployed_at is None or st.deployed_at >= applied_at - 1.0
        if pinned == expected and fresh:
            if on_phase is not None and replicas_before is not None:
                _new_replica_phases(st, replicas_before, seen, on_phase)
            if st.status == "RUNNING":
                return VerifyOutcome(True, seconds=time.time() - start)
            if st.status in FAILED:
                return VerifyOutcome(False, f"app {st.status}: {st.replica_failure() or st.message}", time.time() - start)
            failure = st.replica_failure()
            if fail_fast and failure:
                return VerifyOutcome(False, f"a new replica failed to start: {failure}", time.time() - start)
        last = f"status {st.status} {st.message}".strip()
        time.sleep(poll_s)
    return VerifyOutcome(False, f"not healthy after {timeout_s:.0f}s (last seen: {last[:1000]})", time.time() - start)


def _new_replica_phases(st: AppState, before: set[str], seen: set[str], on_phase: Callable[[str], None]) -> None:
    """Report `build` when a replica the deploy started first shows up, `replica_start` when all of them run."""
    new = [r for r in st.replicas if r.get("replica_id") not in before]
    if new and "build" not in seen:
        seen.add("build")
        on_phase("build")
    if new and "replica_start" not in seen and all(r.get("state") == "RUNNING" for r in new):
        seen.add("replica_start")
        on_phase("replica_start")


def wait_until_answering(base_url: str, model_id: str, expected_label: str, prompt: str, timeout_s: float,
                         poll_s: float = 0.5, field: str = "system_fingerprint", api_key: str = "") -> VerifyOutcome:
    """Send smoke requests until one is answered with `field` (the base's version in `system_fingerprint`, an
    adapter's versioned name in `model`) equal to `expected_label`."""
    start = time.time()
    last = ""
    while time.time() - start < timeout_s:
        try:
            fp = smoke_request(base_url, model_id, prompt, timeout_s=min(30.0, timeout_s), api_key=api_key).get(field)
            if fp == expected_label:
                return VerifyOutcome(True, seconds=time.time() - start)
            last = f"answered by {fp!r}, expected {expected_label!r}"
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}: {e.read().decode(errors='replace')[:500]}"
            if e.code in (401, 403):  # the key, not the app: waiting would not change the answer
                return VerifyOutcome(False, f"smoke request to {base_url} refused ({last}): is the admin key "
                                            "(auth.admin_key_file / RAYLINE_ADMIN_KEY_FILE) in the app's keys file?",
                                     time.time() - start)
        except (OSError, ValueError) as e:
            last = str(e)
        time.sleep(poll_s)
    return VerifyOutcome(False, f"smoke request to {base_url} not answered by {expected_label} within {timeout_s:.0f}s "
                                f"({last})", time.time() - start)
