"""Promotion -> rollout: make the Serve app serve the version an MLflow alias points at, or refuse and say why.

One attempt (`Rollout.once`), when `NAME@alias` is not the version the app serves (the base model, or with
`adapter` one of the LoRA adapters the same replicas serve, swapped in place without an engine restart):
  1. gate     the eval run of these exact bytes vs thresholds, bytes = registered manifest, checkpoint complete
              (serve/promotion/gate.py, serve/online/engine.py checked_digest); refuse -> tag, alias back
  2. deploy   render the app pinned to the version; dashboard REST PUT or RayService patch (serve/promotion/deploy_target.py)
  3. verify   app RUNNING on the new config, then a smoke request answered by the new version (serve/promotion/verify.py)
  4. record   version tags and a run in the `rayline-rollout` experiment (serve/promotion/rollout_record.py)
  5. roll back on a failed deploy/verify: the previous app config goes back, the alias returns to the
     version still serving, the failure is tagged on the version and the run.
`Rollout.watch` repeats it every `poll_interval_s` and at once on MLflow webhook calls (serve/promotion/webhook.py).
"""

from __future__ import annotations

import logging
import threading
import time

import mlflow
from mlflow.exceptions import MlflowException

from core import metrics, registry, usage
from core.config import load_config
from core.ray_cluster import init_ray, ray_job_id
from serve.promotion import rollout_record as rec
from serve.promotion.canary import Canary
from serve.promotion.outcome import DEPLOYED, ERROR, REJECTED, ROLLED_BACK, SKIPPED, UNCHANGED, RolloutResult
from serve.online.adapters import resolve_adapter
from serve.online.app import (ServedModel, adapters_of, is_engine_deployment, pin_model, render_serve_config,
                              resolve_served_adapters, resolve_served_model, served_model_of)
from serve.promotion.deploy_target import DeployError, KubeRayService, LocalServe
from serve.promotion.gate import evidence_problems, gate_problems
from serve.promotion.rollout_config import Config
from serve.promotion.rollout_phases import PhaseClock
from serve.online.serve_config import Config as ServeConfig
from serve.promotion.verify import VerifyOutcome, admin_key, served_versions, wait_until_answering, wait_until_healthy
from serve.promotion.webhook import WebhookReceiver, register_webhook

log = logging.getLogger("rayline.rollout")
# How often the deploy's wait asks the target for the app's state: a phase ends within this of when it really ended.
HEALTH_POLL_S = 0.2

def load_serve_config(cfg: Config) -> ServeConfig:
    """The serving config the app is rendered from: `serve_config` (cwd, then project root) + `serve_overrides`."""
    return load_config(ServeConfig, registry.project_path(cfg.serve_config), cfg.serve_overrides)


class Rollout:
    """Follows `model@alias` for one Serve application on one target (local Serve or a RayService)."""

    def __init__(self, cfg: Config, serve_cfg: ServeConfig | None = None, target=None):
        self.cfg = cfg
        self.serve_cfg = serve_cfg or load_serve_config(cfg)
        ref, where = self.serve_cfg.engine.model, "engine.model"
        if cfg.adapter:
            adapters = self.serve_cfg.lora.adapters
            if cfg.adapter not in adapters:
                raise ValueError(f"adapter: {cfg.adapter!r} is not served (the serving config's lora.adapters: "
                                 f"{sorted(adapters) or 'none'})")
            ref, where = adapters[cfg.adapter], f"lora.adapters.{cfg.adapter}"
        if not cfg.model and not ref.startswith("models:/"):
            raise ValueError(f"model: not given, and the serving config's {where} ({ref}) is not a models:/ reference")
        self.name = cfg.model or registry.parse_model_ref(ref)[0]
        self.client_name = f"{self.serve_cfg.served_model_id}:{cfg.adapter}" if cfg.adapter else ""
        self.adapters_for_base: dict | None = None  # the served adapters, pinned by the gate onto a new base
        if target is None:
            k = cfg.kubernetes
            target = (KubeRayService(self.serve_cfg.app_name, k.name, k.namespace) if cfg.target == "kubernetes"
                      else LocalServe(self.serve_cfg.app_name, cfg.dashboard_url))
        self.target = target
        self.base_url = cfg.kubernetes.serve_url if cfg.target == "kubernetes" else self.serve_cfg.base_url()
        self.admin_key = admin_key(self.serve_cfg)  # what its requests to the app send; none: refused here, not mid-way
        self.canary_metrics_url = cfg.canary.metrics_url() if cfg.canary.steps else ""  # a bad setting fails here
        self.clock: PhaseClock | None = None  # the phases of the attempt under way (serve/promotion/rollout_phases.py)

    # -- one attempt ---------------------------------------------------------------------------------

    def once(self, triggered_by: str | None = None) -> RolloutResult:
        cfg, name = self.cfg, self.name
        clock = PhaseClock()  # from the alias read on, so the phases cover alias read -> new version answering
        self.clock, self._cpu_start = None, usage.driver_cpu_s()
        trigger = triggered_by or cfg.triggered_by or rec.default_trigger()
        if cfg.canary.steps and not cfg.adapter:
            challenger = registry.get_alias(name, cfg.canary.alias)
            if challenger is not None:

                return Canary(self).run(challenger, trigger)
        mv = registry.get_alias(name, cfg.alias)
        if mv is None:
            return RolloutResult(SKIPPED, name, reason=f"alias {name}@{cfg.alias} is not set in MLflow")
        version = str(mv.version)
        previous_app = self.target.current()
        previous = self.served(previous_app or {})
        prev_version = previous.version if previous and previous.name == name else None
        if prev_version == version:
            return RolloutResult(UNCHANGED, name, version, prev_version, reason=f"already serving {name}/{version}")
        earlier = mv.tags.get(rec.TAG_STATUS)
        if not cfg.rollback_alias and earlier in (rec.STATUS_REJECTED, rec.STATUS_ROLLED_BACK):
            why = mv.tags.get(rec.TAG_REJECTED_REASON) or mv.tags.get(rec.TAG_FAILED_REASON, "")
            return RolloutResult(SKIPPED, name, version, prev_version,
                                 reason=f"{name}/{version} was {earlier} before ({why}); point {cfg.alias} at another version")

        start, self.clock = clock.start, clock
        tags = rec.run_tags(name, cfg.alias, prev_version, version, trigger, self.target.describe())
        with registry.start_run(cfg.experiment, f"{name}-v{version}", tags=tags) as run:
            run_id = run.info.run_id
            log.info("rollout %s/%s (serving %s) triggered by %s", name, version, prev_version or "nothing", trigger)
            served, problems = self.gate(name, version, mv.tags)
            clock.mark("gate")
            mlflow.log_metric("gate_s", clock.seconds["gate"])
            # Provenance: the candidate a promoter copied in (only promoters and the rollout may write `name`; MLflow
            # records no author of an alias) and the exact bytes the gate approved.
            mlflow.set_tags({"rollout.promoted_from": mv.source.removeprefix("models:/") if mv.source.startswith(
                "models:/") else f"{name}/{version}", "rollout.weights_digest": (served.digest if served else "") or ""})
            if problems:
                rec.record_rejected(name, version, problems, trigger, run_id)
                alias_note = self._restore_alias(name, prev_version)
                reason = "gate refused: " + "; ".join(problems) + alias_note
                return self.finish(RolloutResult(REJECTED, name, version, prev_version, reason, run_id), start)

            rendered = self._render(previous_app or {}, served)
            mlflow.log_dict(rendered, "serve_config.json")
            outcome = self.deploy_and_verify(rendered, served)
            if outcome.ok:
                rec.record_deployed(name, version, prev_version, trigger, run_id)
                return self.finish(RolloutResult(DEPLOYED, name, version, prev_version, run_id=run_id), start)

            rollback = self.roll_back(self.pinned(previous_app, previous), previous, rendered.get("http_options"))
            clock.mark("rollback")
            rec.record_rolled_back(name, version, outcome.reason, trigger, run_id)
            alias_note = self._restore_alias(name, prev_version)
            reason = f"{outcome.reason}; {rollback}{alias_note}"
            return self.finish(RolloutResult(ROLLED_BACK, name, version, prev_version, reason, run_id), start)

    def served(self, app_config: dict) -> ServedModel | None:
        """What the followed model is in a deployed app config: the base, or the adapter's pinned version."""
        if not self.cfg.adapter:
            pinned = served_model_of(app_config)
            if pinned or not app_config:
                return pinned
            card = self._reported(self.serve_cfg.served_model_id)  # built unpinned: the version its replicas load
            return ServedModel.from_args(card) if card and card.get("version") else None
        spec = adapters_of(app_config).get(self.cfg.adapter)
        if spec and not spec.get("version"):  # an alias each replica resolved itself: ask them which version
            spec = self._reported(self.client_name) or spec
        return ServedModel(source=spec.get("source", ""), ref=spec["ref"], name=spec.get("name"),
                           version=spec.get("version")) if spec else None

    def _reported(self, model_id: str) -> dict | None:
        """The version the running app reports for `model_id` (its model card), or None when it does not answer."""
        try:
            return served_versions(self.base_url, api_key=self.admin_key).get(model_id)
        except (OSError, ValueError, KeyError) as e:
            log.warning("could not read the served versions from %s/models: %s", self.base_url, e)
            return None

    def _render(self, previous_app: dict, served: ServedModel) -> dict:
        """The app config serving `served`: pinned to it (with the adapters the gate pinned onto it), or (an
        adapter) the running app with it swapped in."""
        if not self.cfg.adapter:
            return render_serve_config(self.serve_cfg, served, self.adapters_for_base, running=previous_app)
        adapters = {**adapters_of(previous_app), self.cfg.adapter: {
            "ref": served.ref, "source": served.source, "name": served.name, "version": served.version,
            "digest": served.digest,
            "label": served.label}}
        return render_serve_config(self.serve_cfg, served_model_of(previous_app), adapters, running=previous_app)

    def gate(self, name: str, version: str, tags: dict[str, str]) -> tuple[ServedModel | None, list[str]]:
        """Resolve the version's checkpoint and run the gate; (served model, reasons to refuse)."""
        if self.cfg.adapter:
            return self._gate_adapter(name, version, tags)
        try:
            served = resolve_served_model(f"models:/{name}/{version}", self.serve_cfg.model_cache_dir or None,
                                          alias=self.cfg.alias)
        except (LookupError, OSError, ValueError, MlflowException) as e:  # ManifestMismatch is a ValueError
            return None, [f"checkpoint of {name}/{version} cannot be resolved: {e}"]
        problems = gate_problems(name, version, served.digest, served.source, self.cfg.gate)
        self.adapters_for_base = None
        if self.serve_cfg.lora.adapters and not problems:
            # The served adapters must fit the new base too (each was trained on one base version): refused here,
            # not by replicas failing to load them after the deploy.
            try:
                self.adapters_for_base = resolve_served_adapters(self.serve_cfg, served)
            except (LookupError, OSError, ValueError, MlflowException) as e:
                problems.append(f"{e}; point that adapter's alias at one trained on {name}/{version} first")
        return served, problems

    def _gate_adapter(self, name: str, version: str, tags: dict[str, str]) -> tuple[ServedModel | None, list[str]]:
        """The adapter version's eval tags, and the adapter against the base the app serves (files, rank within
        the engines' max_lora_rank, target modules, shapes, the base version it was trained on), before any
        replica sees it: one bad adapter must never reach replicas that serve every other one."""
        from serve.online.engine import ModelInfo

        base = served_model_of(self.target.current() or {})
        if base is None:  # deployed unpinned (a RayService's serveConfigV2): the base version its replicas report
            card = self._reported(self.serve_cfg.served_model_id) or {}
            if not (card.get("name") and card.get("version")):
                return None, [f"the app {self.serve_cfg.app_name} serves no base to load {name}/{version} onto (its "
                              f"config pins none and {self.base_url}/models reports none); deploy it first "
                              "(python -m pipelines.serve)"]
            try:
                base = resolve_served_model(f"models:/{card['name']}/{card['version']}",
                                            self.serve_cfg.model_cache_dir or None)
            except (LookupError, OSError, ValueError, MlflowException) as e:
                return None, [f"the base the app serves ({card['name']}/{card['version']}) cannot be resolved: {e}"]
        info = ModelInfo(ref=base.ref, uri=base.source, name=base.name, version=base.version)
        try:
            a = resolve_adapter(f"models:/{name}/{version}", base.source, info, self.serve_cfg.model_cache_dir or None,
                                self.serve_cfg.lora.max_lora_rank, where=f"{name}/{version}")
        except (LookupError, OSError, ValueError, MlflowException) as e:
            return None, [str(e)]
        served = ServedModel(source=a.path, ref=f"models:/{name}/{version}", name=name, version=version,
                             alias=self.cfg.alias, digest=a.info.digest)
        return served, evidence_problems(name, version, a.info.digest, self.cfg.gate)

    def _expect(self, served: ServedModel) -> tuple[str, str, str]:
        """(model clients send, what the answer must carry, in which field) once `served` answers."""
        if self.cfg.adapter:
            return self.client_name, f"{self.client_name}@{served.label}", "model"
        return self.serve_cfg.served_model_id, served.label, "system_fingerprint"

    def deploy_and_verify(self, rendered: dict, served: ServedModel) -> VerifyOutcome:
        """Apply `rendered`, wait until the target runs it healthy, then until `served` answers a smoke request; marks
        the phases apply, build, replica_start, healthy and verify on the attempt's clock."""
        cfg = self.cfg
        clock = self.clock or PhaseClock()  # a canary's promotion keeps no phases
        replicas_before = self._replica_ids()
        t = time.time()
        try:
            self.target.apply(rendered)
        except DeployError as e:
            return VerifyOutcome(False, f"deploy failed: {e}")
        finally:
            clock.mark("apply")
        base = served_model_of(rendered["applications"][0]) if cfg.adapter else served
        if base is not None:
            healthy = wait_until_healthy(self.target.state, base, cfg.deploy_timeout_s, cfg.fail_fast, applied_at=t,
                                         poll_s=HEALTH_POLL_S, replicas_before=replicas_before, on_phase=clock.mark)
            clock.mark("healthy")
            mlflow.log_metric("deploy_s", time.time() - t)
            if not healthy.ok:
                return VerifyOutcome(False, f"deploy failed: {healthy.reason}")
        model_id, label, field = self._expect(served)
        answer = wait_until_answering(self.base_url, model_id, label, cfg.smoke_prompt, cfg.smoke_timeout_s,
                                      poll_s=0.2, field=field, api_key=self.admin_key)
        clock.mark("verify")
        mlflow.log_metric("verify_s", answer.seconds)
        if answer.ok:
            mlflow.log_metric("switch_s", time.time() - t)  # deploy -> the new version answering
        return answer if answer.ok else VerifyOutcome(False, f"verify failed: {answer.reason}")

    def _replica_ids(self) -> set[str] | None:
        """The ids of the app's replicas now, where the target reports replicas (local Serve), else None."""
        replicas = getattr(self.target, "replicas", None)
        if replicas is None:
            return None
        try:
            return {r["replica_id"] for r in replicas()}
        except DeployError:
            return None

    def pinned(self, app_config: dict | None, previous: ServedModel | None) -> dict | None:
        """The previous app config to restore, with the previous version pinned where it named an alias (deployed
        unpinned, as a RayService's serveConfigV2): restored as it was, it would resolve the alias again, which
        still names the version being rolled back."""
        if not app_config or previous is None or not (previous.name and previous.version):
            return app_config
        ref = f"models:/{previous.name}/{previous.version}"
        if self.cfg.adapter:
            adapters = adapters_of(app_config)
            if self.cfg.adapter not in adapters or adapters[self.cfg.adapter].get("version"):
                return app_config
            deployments = [{**d, "user_config": {**(d.get("user_config") or {}),
                                                 "adapters": {**adapters, self.cfg.adapter: {"ref": ref}}}}
                           if is_engine_deployment(d) else d
                           for d in app_config.get("deployments") or []]
            return {**app_config, "deployments": deployments}
        if served_model_of(app_config) is not None:
            return app_config
        try:
            model = resolve_served_model(ref, self.serve_cfg.model_cache_dir or None)
        except (LookupError, OSError, ValueError, MlflowException) as e:
            log.warning("rolling back to the unpinned config as it was: %s cannot be resolved (%s)", ref, e)
            return app_config
        return pin_model(app_config, model)

    def roll_back(self, previous_app: dict | None, previous: ServedModel | None, http_options: dict | None) -> str:
        """Put the previous app config back and wait until it answers again; returns what happened."""
        t = time.time()
        try:
            if previous_app is None:
                self.target.delete()
                return "nothing was served before; the failed app was removed"
            self.target.restore(previous_app, http_options)
        except DeployError as e:
            return f"ROLLBACK FAILED: {e}"
        if previous is None:
            return "the previous app config is back (it pins no version, so no smoke check)"
        base = served_model_of(previous_app)  # the base the restored config pins (None: it pins none)
        healthy = wait_until_healthy(self.target.state, base, self.cfg.deploy_timeout_s, fail_fast=False, applied_at=t)
        if not healthy.ok:
            return f"ROLLBACK NOT HEALTHY: {healthy.reason}"
        model_id, label, field = self._expect(previous)
        answer = wait_until_answering(self.base_url, model_id, label, self.cfg.smoke_prompt, self.cfg.smoke_timeout_s,
                                      field=field, api_key=self.admin_key)
        mlflow.log_metric("rollback_s", time.time() - t)
        if not answer.ok:
            return f"ROLLBACK NOT ANSWERING: {answer.reason}"
        return f"rolled back to {previous.label}, answering again"

    def _restore_alias(self, name: str, prev_version: str | None) -> str:
        if not self.cfg.rollback_alias:
            return ""
        if prev_version is None:
            return f"; alias {self.cfg.alias} left as is (no earlier version of {name} was serving)"
        registry.set_alias(name, self.cfg.alias, prev_version)
        return f"; alias {self.cfg.alias} moved back to {name}/{prev_version}"

    def finish(self, result: RolloutResult, start: float) -> RolloutResult:
        """Close the attempt: its duration and phases (`rollout/seconds_<phase>`) and status on the run, the counters."""
        result.seconds = time.time() - start
        clock, self.clock = self.clock, None
        if clock is not None and clock.start == start:
            clock.mark("record")
            result.seconds, result.phases = clock.total, dict(clock.seconds)
            mlflow.log_metrics(clock.metrics())
            log.info("rollout %s/%s phases: %s", result.model, result.version, clock.line())
        mlflow.log_metric("duration_s", result.seconds)
        mlflow.set_tags({rec.TAG_STATUS: result.status, "rollout.reason": result.reason[: rec.MAX_REASON]})
        rec.record_usage(result.model, result.version, result.run_id, result.status == DEPLOYED,
                         usage.driver_cpu_s() - self._cpu_start)
        if result.status not in (UNCHANGED, SKIPPED):
            metrics.inc("rayline_rollouts", 1, model=result.model, outcome=result.status)
            metrics.observe("rayline_rollout_duration_seconds", result.seconds, model=result.model, outcome=result.status)
        log.info(result.line())
        return result

    # -- following the alias --------------------------------------------------------------------------

    def watch(self, stop: threading.Event | None = None) -> list[RolloutResult]:
        """Roll out whenever the alias moves: poll, and wake at once on webhook calls. Returns the attempts made."""
        cfg = self.cfg
        stop = stop or threading.Event()
        wake = threading.Event()
        trigger = {"next": "watch:start"}

        def on_alias(data: dict, delivery_id: str) -> None:
            trigger["next"] = f"webhook:{delivery_id or 'mlflow'} ({data.get('name')}@{data.get('alias')} -> {data.get('version')})"
            wake.set()

        receiver = None
        if cfg.webhook_port:
            secret = cfg.webhook_secret()  # none: a ConfigError, the watch does not start
            aliases = (cfg.alias, cfg.canary.alias) if cfg.canary.steps and not cfg.adapter else cfg.alias
            receiver = WebhookReceiver(self.name, aliases, on_alias, cfg.webhook_host, cfg.webhook_port,
                                       cfg.webhook_path, secret).start()
            log.info("webhook receiver on %s", receiver.url)
            if cfg.register_webhook:
                try:
                    register_webhook(cfg.webhook_url or receiver.url, self.name, secret)
                except Exception as e:  # the watch still polls; say what MLflow needs
                    log.warning("could not register the MLflow webhook (%s); MLflow lets only its admins manage "
                                "webhooks (register it once with RAYLINE_ROLE=admin, then watch as the rollout with "
                                "register_webhook: false), and to call a loopback URL its server needs "
                                "MLFLOW_WEBHOOK_ALLOWED_SCHEMES=http,https and MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true; "
                                "polling every %ss", e, cfg.poll_interval_s)
        attempts: list[RolloutResult] = []
        try:
            while not stop.is_set():
                try:
                    result = self.once(trigger["next"])
                except Exception as e:  # MLflow or the target briefly down: report and keep watching
                    result = RolloutResult(ERROR, self.name, reason=f"{type(e).__name__}: {e}")
                log.info(result.line())
                if result.status not in (UNCHANGED, SKIPPED):
                    attempts.append(result)
                if cfg.max_rollouts and len(attempts) >= cfg.max_rollouts:
                    break
                woke = wake.wait(cfg.poll_interval_s)
                wake.clear()
                if not woke:
                    trigger["next"] = "watch:poll"
        finally:
            if receiver:
                receiver.stop()
        return attempts


def main(cfg: Config) -> RolloutResult | list[RolloutResult]:
    """One rollout attempt, or with `watch` the attempts made until stopped (Ctrl-C) or `max_rollouts`."""
    if ray_job_id():
        init_ray()  # on the cluster (a Ray job, the rendered RayJob): rollouts count in rayline's metrics
    rollout = Rollout(cfg)
    if cfg.watch:
        try:
            return rollout.watch()
        except KeyboardInterrupt:
            return []
    return rollout.once()
