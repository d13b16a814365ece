"""Champion and challenger: a version set as `challenger` takes a growing share of live traffic beside the champion,
is judged on live metrics at each step, and becomes champion or is rolled back.

`Rollout.once` hands over to `Canary.run` when `canary.steps` is set and `NAME@challenger` names a version:
  1. gate      the same gate as a plain rollout (eval tags, complete checkpoint); refused -> tagged, alias removed
  2. deploy    the challenger as a Serve app of its own (`<app>-challenger` at `<route>/-challenger`), pinned to its
               version, beside the champion's app (on Kubernetes: one more application in the same serveConfigV2);
               one replica to start with, scaling on its own load up to the champion's max_replicas
  3. steps     for each share: set `canary` in the `user_config` of the champion deployment that serves the routes
               (the engine replicas, or with `ingress: deployment` the OpenAI ingress replicas; serve/online/app.py
               `routes_deployment_name`): they route without restarting (serve/online/canary_split.py). Run the step's
               window with a quality probe (known answers sent to both sides), then judge the window's live
               metrics (error ratio, TTFT p50/p99, inter-token latency, probe exact match) against the thresholds
               in `canary`: every champion replica's, read from Prometheus `canary.metrics_lag_s` after the window
               (serve/promotion/canary_metrics.py), or, without a Prometheus, the stats of the one replica the rollout's
               request reaches
  4. promote   every step passed: `champion` moves to the challenger's version, `challenger` is removed, the champion
               app is rolled to it (the plain rollout's deploy and verify) and the challenger app removed
     roll back a step failed (or the challenger never answered): the split is removed, then the challenger app, then
               the alias; the reason is on the version and the run
Every step is a row of the run's `canary_steps.json` artifact and of its metrics (step = the step's index), and the
challenger's version carries `canary.*` tags: the MLflow UI answers "why was v7 rolled back".
"""

from __future__ import annotations

import json
import logging
import random
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities.model_registry import ModelVersion

from core import registry
from serve.promotion import rollout_record as rec
from serve.online.app import ServedModel, render_serve_config, routes_deployment_name
from serve.online.canary_split import CHALLENGER, CHAMPION, ROUTE_HEADER, STATS_PATH
from serve.promotion.deploy_target import DeployError
from serve.promotion.outcome import DEPLOYED, REJECTED, ROLLED_BACK, SKIPPED, UNCHANGED, RolloutResult
from serve.promotion.rollout_config import CanaryConfig
from serve.promotion.verify import key_header, wait_until_answering, wait_until_healthy

log = logging.getLogger("rayline.canary")

TAG_CANARY_STATUS = "canary.status"
TAG_CANARY_STEP = "canary.step"
TAG_CANARY_REASON = "canary.reason"
TAG_CANARY_RUN = "canary.run_id"
TAG_CANARY_AGAINST = "canary.champion_version"


def with_canary(app_config: dict[str, Any], deployment: str, canary: dict[str, Any] | None) -> dict[str, Any]:
    """The app config with `canary` set in the engine deployment's user_config, or (None) switched off there. Off is
    an explicit `canary: null`: a deployment whose user_config is dropped keeps its replicas' last one, as Serve
    only calls `reconfigure` with a user_config."""
    deployments = [dict(d) for d in app_config.get("deployments") or []]
    ours = next((d for d in deployments if d.get("name") == deployment), None)
    if ours is None:
        if canary is None:
            return app_config
        ours = {"name": deployment}
        deployments.append(ours)
    ours["user_config"] = {**(ours.get("user_config") or {}), "canary": canary}
    return {**app_config, "deployments": deployments}


def judge(sides: dict[str, dict[str, Any]], probe: dict[str, float] | None, cfg: CanaryConfig) -> list[str]:
    """Why the step fails (empty: it passes): the challenger's live figures against the champion's and the limits."""
    ch, cp = sides[CHALLENGER], sides[CHAMPION]
    problems = []
    if ch["requests"] < cfg.min_requests:
        problems.append(f"only {ch['requests']} live challenger requests in the step (canary.min_requests "
                        f"{cfg.min_requests})")
    if ch["requests"] and ch["error_ratio"] > cfg.max_error_ratio:
        problems.append(f"challenger error ratio {ch['error_ratio']:.3f} ({ch['errors']}/{ch['requests']}) > "
                        f"canary.max_error_ratio {cfg.max_error_ratio}")
    for key, limit, name in (("ttft_p50_s", cfg.max_ttft_p50_ratio, "max_ttft_p50_ratio"),
                             ("ttft_p99_s", cfg.max_ttft_p99_ratio, "max_ttft_p99_ratio"),
                             ("itl_mean_s", cfg.max_itl_ratio, "max_itl_ratio")):
        mine, theirs = ch.get(key), cp.get(key)
        if mine is not None and theirs is not None and mine > (theirs + cfg.latency_slack_s) * limit:
            problems.append(f"challenger {key} {mine:.3f}s > ({theirs:.3f}s champion + {cfg.latency_slack_s}s) x "
                            f"canary.{name} {limit}")
    if probe is not None and probe[CHALLENGER] < probe[CHAMPION] - cfg.max_quality_drop:
        problems.append(f"probe exact match {probe[CHALLENGER]:.2f} < champion's {probe[CHAMPION]:.2f} - "
                        f"canary.max_quality_drop {cfg.max_quality_drop}")
    return problems


def load_probe(uri: str) -> list[tuple[list[dict], str]]:
    """(prompt messages, known answer) of each chat record of a JSONL file (an eval split)."""
    from serve.batch.rows import split_messages

    out = []
    for n, line in enumerate(Path(uri).read_text(encoding="utf-8-sig").splitlines(), 1):
        if not line.strip():
            continue
        messages, reference, problem = split_messages(json.loads(line).get("messages"))
        if problem or reference is None:
            raise ValueError(f"canary.probe_uri: {uri} line {n}: {problem or 'no answer (last message: assistant)'}")
        out.append((messages, reference))
    if not out:
        raise ValueError(f"canary.probe_uri: {uri} holds no records")
    return out


def _post(url: str, body: dict, headers: dict[str, str], timeout_s: float = 60) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


class Canary:
    """One canary of `name@<canary.alias>` beside the champion the rollout's app serves."""

    def __init__(self, rollout, target=None):
        self.r = rollout
        self.cfg: CanaryConfig = rollout.cfg.canary
        sc = rollout.serve_cfg
        route = self.cfg.route_prefix or sc.route_prefix.rstrip("/") + "/-challenger"
        # The challenger takes a share of the traffic: it starts with one replica and scales on its own load up to
        # the champion's max_replicas.
        self.serve_cfg = replace(sc, app_name=f"{sc.app_name}-challenger", route_prefix=route,
                                 autoscaling=replace(sc.autoscaling, min_replicas=1, initial_replicas=None))
        self.target = target or rollout.target.for_app(self.serve_cfg.app_name)
        champion_v1 = rollout.base_url.rstrip("/")
        root = champion_v1.removesuffix("/v1").removesuffix(sc.route_prefix.rstrip("/"))
        self.champion_root = champion_v1.removesuffix("/v1")
        self.forward_url = root + route.rstrip("/")
        self.base_url = self.forward_url + "/v1"
        self.deployment = routes_deployment_name(sc)  # the replicas that run the split
        self.prometheus = rollout.canary_metrics_url

    # -- the canary --------------------------------------------------------------------------------------------

    def run(self, mv: ModelVersion, trigger: str):

        r, cfg, name, version = self.r, self.cfg, mv.name, str(mv.version)
        self._version = version
        champion_app = r.target.current()
        champion = r.served(champion_app or {})
        if champion_app is None or champion is None or champion.name != name:
            return RolloutResult(SKIPPED, name, version, reason=f"{name}@{cfg.alias} is set, but the app "
                                 f"{r.serve_cfg.app_name} serves no champion of {name} to run a canary beside")
        if champion.version == version:
            registry.delete_alias(name, cfg.alias)
            return RolloutResult(UNCHANGED, name, version, champion.version,
                                 reason=f"{name}/{version} is the champion already; {cfg.alias} removed")
        start = time.time()
        tags = {**rec.run_tags(name, cfg.alias, champion.version, version, trigger, r.target.describe()),
                "rollout.kind": "canary", "canary.mode": cfg.mode, "canary.steps": json.dumps(cfg.steps)}
        with registry.start_run(r.cfg.experiment, f"{name}-v{version}-canary", tags=tags) as run:
            run_id = run.info.run_id
            log.info("canary %s/%s beside champion %s/%s (%s, steps %s)", name, version, name, champion.version,
                     cfg.mode, cfg.steps)
            registry.set_version_tags(name, version, {TAG_CANARY_STATUS: "running", TAG_CANARY_RUN: run_id,
                                                      TAG_CANARY_AGAINST: champion.version})
            served, problems = r.gate(name, version, mv.tags)
            if problems:
                rec.record_rejected(name, version, problems, trigger, run_id)
                self._end(name, version, "rejected", "gate refused: " + "; ".join(problems))
                return r.finish(RolloutResult(REJECTED, name, version, champion.version,
                                               "gate refused: " + "; ".join(problems) + f"; {cfg.alias} removed",
                                               run_id), start)
            reason = self._start_challenger(served)
            steps: list[dict[str, Any]] = []
            if not reason:
                mlflow.log_metric("challenger_ready_s", time.time() - start)
                reason = self._steps(steps, start)
            mlflow.log_dict(steps, "canary_steps.json")
            if reason:
                cleanup = self._remove()
                rec.record_rolled_back(name, version, reason, trigger, run_id)
                self._end(name, version, "rolled_back", reason)
                return r.finish(RolloutResult(ROLLED_BACK, name, version, champion.version,
                                               f"{reason}; {cleanup}; {cfg.alias} removed", run_id), start)
            return self._promote(champion_app, champion, served, trigger, run_id, start)

    def _start_challenger(self, served: ServedModel) -> str:
        """Deploy the challenger's app and wait until it answers as its version; the reason when it does not."""
        rendered = render_serve_config(self.serve_cfg, served, self.r.adapters_for_base)
        mlflow.log_dict(rendered, "challenger_serve_config.json")
        t = time.time()
        try:
            self.target.apply(rendered)
        except DeployError as e:
            return f"challenger deploy failed: {e}"
        healthy = wait_until_healthy(self.target.state, served, self.r.cfg.deploy_timeout_s, self.r.cfg.fail_fast,
                                     applied_at=t)
        mlflow.log_metric("challenger_deploy_s", time.time() - t)
        if not healthy.ok:
            return f"challenger deploy failed: {healthy.reason}"
        answer = wait_until_answering(self.base_url, self.serve_cfg.served_model_id, served.label,
                                      self.r.cfg.smoke_prompt, self.r.cfg.smoke_timeout_s, api_key=self.r.admin_key)
        return "" if answer.ok else f"challenger verify failed: {answer.reason}"

    def _split(self, share: float | None) -> None:
        """Set the champion replicas' split (None: none) in the app as it runs now, and wait until they report it."""
        canary = None if share is None else {"share": share, "mode": self.cfg.mode, "url": self.forward_url,
                                             "sticky_header": self.cfg.sticky_header}
        current = self.r.target.current()
        if current is None:
            raise DeployError(f"the champion app {self.r.serve_cfg.app_name} is gone")
        self.r.target.restore(with_canary(current, self.deployment, canary))
        deadline = time.time() + 120
        last = ""
        while time.time() < deadline:
            try:
                reported = self.stats(0)["config"] or None
                if (reported or {}).get("share") == (canary or {}).get("share"):
                    return
                last = f"replicas report {reported}"
            except (OSError, ValueError) as e:
                last = str(e)
            time.sleep(0.5)
        raise DeployError(f"the champion replicas did not take canary {canary} within 120s ({last})")

    def stats(self, since: float) -> dict[str, Any]:
        req = urllib.request.Request(f"{self.champion_root}{STATS_PATH}?since={since}",
                                     headers=key_header(self.r.admin_key))  # an admin-only route (serve/online/api_auth.py)
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def _steps(self, steps: list[dict[str, Any]], start: float) -> str:
        """Run every step; the reason the canary fails, or "" when every step passed."""
        cfg = self.cfg
        probe_set = load_probe(cfg.probe_uri) if cfg.probe_uri else None
        for i, share in enumerate(cfg.steps):
            try:
                self._split(share)
            except DeployError as e:
                return f"step {i} ({share:.0%}): {e}"
            t0 = time.time()
            if i == 0:
                mlflow.log_metric("first_canary_s", t0 - start)  # alias seen -> the replicas route live requests to it
            probe = self.probe(probe_set, seed=i) if probe_set else None
            try:
                sides, window = self.live_figures(t0)
            except (OSError, ValueError, KeyError) as e:
                source = f"Prometheus at {self.prometheus}" if self.prometheus else "the champion replicas' stats route"
                return f"step {i} ({share:.0%}): its live metrics could not be read from {source}: {e}"
            problems = judge(sides, probe, cfg)
            if self.prometheus and not any(side["requests"] for side in sides.values()):
                problems.append(f"Prometheus at {self.prometheus} holds no canary requests of app "
                                f"{self.r.serve_cfg.app_name} in the window {window} (does it scrape the replicas' "
                                f"nodes? is canary.metrics_lag_s longer than their report + scrape interval?)")
            step = {"step": i, "share": share, "mode": cfg.mode, "started_at": t0, "window_s": round(time.time() - t0, 1),
                    "metrics": {"source": "prometheus" if self.prometheus else "replica", "window": window},
                    "sides": sides, "probe": probe, "passed": not problems, "problems": problems}
            steps.append(step)
            self._log_step(step)
            log.info("canary step %d (%s %.0f%%): %s", i, cfg.mode, share * 100,
                     "passed" if not problems else "; ".join(problems))
            if problems:
                return f"step {i} ({share:.0%} {cfg.mode}) failed: " + "; ".join(problems)
        return ""

    def live_figures(self, t0: float) -> tuple[dict[str, Any], list[float]]:
        """Wait out the step begun at `t0`; then each side's live figures over it, and the window they cover."""
        from serve.promotion import canary_metrics

        end = t0 + self.cfg.step_s
        if not self.prometheus:
            time.sleep(max(0.0, end - time.time()))
            return self.stats(t0)["sides"], [t0, time.time()]
        lag = self.cfg.metrics_lag_s
        time.sleep(max(0.0, end + lag - time.time()))  # the split stays as it is until the window's end is stored
        read = canary_metrics.window(self.prometheus, self.r.serve_cfg.app_name, t0 + lag, end + lag)
        return read["sides"], read["window"]

    def probe(self, records: list[tuple[list[dict], str]], seed: int) -> dict[str, float]:
        """Exact match of each side on a sample of known answers (forced to a side by header, not counted live)."""
        from serve.batch.metrics import exact_match

        sample = random.Random(seed).sample(records, min(self.cfg.probe_size, len(records)))
        out = {}
        for side in (CHAMPION, CHALLENGER):
            right = 0
            for messages, answer in sample:
                body = {"model": self.r.serve_cfg.served_model_id, "messages": messages,
                        "max_tokens": self.cfg.probe_max_tokens,
                        "temperature": 0.0}
                # The force header is honoured for an admin key only (serve/online/api_auth.py).
                reply = _post(f"{self.champion_root}/v1/chat/completions", body,
                              {ROUTE_HEADER: side, **key_header(self.r.admin_key)})
                right += exact_match(reply["choices"][0]["message"]["content"], answer)
            out[side] = right / len(sample)
        return out

    def _log_step(self, step: dict[str, Any]) -> None:
        i = step["step"]
        figures = {"canary.share": step["share"], "canary.passed": float(step["passed"])}
        for side, m in step["sides"].items():
            for k, v in m.items():
                if v is not None:
                    figures[f"canary.{side}.{k}"] = float(v)
        for side, em in (step["probe"] or {}).items():
            figures[f"canary.{side}.probe_exact_match"] = em
        mlflow.log_metrics(figures, step=i)
        registry.set_version_tags(self.r.name, self._version, {TAG_CANARY_STEP: f"{i}: {step['share']:.0%} "
                                                      f"{'passed' if step['passed'] else 'failed'}"})

    def _remove(self) -> str:
        """Take the challenger out of traffic, then remove its app: what happened, in a few words."""
        notes = []
        try:
            self._split(None)
            notes.append("split removed")
        except DeployError as e:
            notes.append(f"SPLIT NOT REMOVED: {e}")
        try:
            self.target.delete()
            notes.append(f"{self.serve_cfg.app_name} removed")
        except DeployError as e:
            notes.append(f"CHALLENGER APP NOT REMOVED: {e}")
        return ", ".join(notes)

    def _end(self, name: str, version: str, status: str, reason: str) -> None:
        registry.set_version_tags(name, version, {TAG_CANARY_STATUS: status, TAG_CANARY_REASON: reason[: rec.MAX_REASON]})
        registry.delete_alias(name, self.cfg.alias)

    def _promote(self, champion_app: dict, champion: ServedModel, served: ServedModel, trigger: str, run_id: str,
                 start: float):
        """Every step passed: the challenger's version becomes champion and the champion app serves it."""

        r, name, version = self.r, served.name or self.r.name, served.version or ""
        registry.set_alias(name, r.cfg.alias, version)
        registry.delete_alias(name, self.cfg.alias)
        rendered = render_serve_config(r.serve_cfg, served, r.adapters_for_base, running=champion_app)
        mlflow.log_dict(rendered, "serve_config.json")
        outcome = r.deploy_and_verify(rendered, served)
        if not outcome.ok:
            rollback = r.roll_back(r.pinned(champion_app, champion), champion, rendered.get("http_options"))
            self.target.delete()
            registry.set_alias(name, r.cfg.alias, champion.version)
            reason = f"promotion after the canary failed: {outcome.reason}; {rollback}"
            rec.record_rolled_back(name, version, reason, trigger, run_id)
            self._end(name, version, "rolled_back", reason)
            return r.finish(RolloutResult(ROLLED_BACK, name, version, champion.version, reason, run_id), start)
        rec.record_deployed(name, version, champion.version, trigger, run_id)
        try:
            self.target.delete()
        except DeployError as e:
            log.warning("the challenger app %s was not removed: %s", self.serve_cfg.app_name, e)
        self._end(name, version, "promoted", f"passed {len(self.cfg.steps)} steps {self.cfg.steps}")
        return r.finish(RolloutResult(DEPLOYED, name, version, champion.version,
                                       f"canary passed {len(self.cfg.steps)} steps; {r.cfg.alias} moved", run_id), start)
