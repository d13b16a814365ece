"""Promotion -> rollout for real: MLflow alias moves, the Serve app follows (or refuses), under loopback load.

One Serve app for the module, first deployed by a rollout of v1. Then, in order:
  promote v2 while a few clients hammer the app: zero failed requests, answers switch to v2, tags + run;
  promote v4 (eval below the gate) via `python -m pipelines.rollout`, and v5 (weights cut short):
      refused, reasons tagged, alias back on v2, serving untouched;
  promote v3 (weights that do not fit its config, so the engine cannot start) under load: deploy fails,
      the app rolls back to v2 without a failed request, the alias returns to v2, the failure is tagged.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from core import registry
from core.config import from_dict
from stack.tiny_model import build_tiny_model
from serve.promotion import rollout_record as rec
from serve.promotion.deploy_target import LocalServe
from serve.promotion.outcome import DEPLOYED, REJECTED, ROLLED_BACK
from serve.promotion.rollout import Rollout
from serve.promotion.rollout_config import Config as RolloutConfig
from serve.promotion.rollout_phases import phases_of
from tests.serve.serving import openai_client, register_fresh, serve_config_dict, serving_keys
from tests.serve.load import LoadThreads

# The module's app is started in the first test's setup, which pytest-timeout counts against that test;
# on a busy 2-core box one engine start alone can take minutes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

MODEL = "rayline-rollout-test"
APP = "rayline-test-rollout"
PREFIX = "/rollout-test"
GATE = {"min_metrics": {"eval.exact_match": 0.5}}


def broken_copy(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    if how == "shape":  # whole files and a matching embedding (the gate passes), but the MLP weights do not fit
        cfg = json.loads((dst / "config.json").read_text())
        cfg["intermediate_size"] *= 2
        (dst / "config.json").write_text(json.dumps(cfg))
    else:  # an upload cut short
        w = dst / "model.safetensors"
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    return dst


@pytest.fixture(scope="module")
def setup(local_stack, tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollout")
    v2_dir = build_tiny_model(tmp / "v2", "tiny", seed=1)
    versions = register_fresh(MODEL, [
        (str(tiny_model_dir), {"eval.exact_match": "0.6"}),                            # v1
        (str(v2_dir), {"eval.exact_match": "0.7"}),                                      # v2
        (str(broken_copy(tiny_model_dir, tmp / "v3", "shape")), {"eval.exact_match": "0.8"}),  # v3: engine fails
        (str(tiny_model_dir), {"eval.exact_match": "0.1"}),                              # v4: below the gate
        (str(broken_copy(tiny_model_dir, tmp / "v5", "truncate")), {"eval.exact_match": "0.9"}),  # v5: cut short
    ])
    assert versions == ["1", "2", "3", "4", "5"]
    serve_yaml = tmp / "serve.yaml"
    serve_yaml.write_text(yaml.safe_dump(serve_config_dict(APP, PREFIX, MODEL)))
    rollout_yaml = tmp / "rollout.yaml"
    rollout_yaml.write_text(yaml.safe_dump({
        "model": MODEL, "serve_config": str(serve_yaml), "gate": GATE, "deploy_timeout_s": 900, "smoke_timeout_s": 120,
    }))
    cfg = from_dict(RolloutConfig, yaml.safe_load(rollout_yaml.read_text()))
    rollout = Rollout(cfg)
    registry.set_alias(MODEL, "champion", "1")
    try:
        first = rollout.once("test:setup")
        assert first.status == DEPLOYED and first.version == "1", first.line()
        yield {"rollout": rollout, "rollout_yaml": rollout_yaml,
               "base_url": f"http://127.0.0.1:{local_stack.serve_port}{PREFIX}/v1"}
    finally:
        LocalServe(APP).delete()


class Load(LoadThreads):
    """A few loopback clients (non-streamed and streamed) for as long as it runs; bounded in time."""

    def __init__(self, base_url: str, clients: int = 3, limit_s: float = 1800, pause_s: float = 0.2):
        super().__init__(clients, self._run)
        self.client = openai_client(base_url)
        self.stop_at, self.pause_s = time.time() + limit_s, pause_s
        self.results: list[tuple[float, float, str | None]] = []  # (started, finished, fingerprint)
        self.errors: list[str] = []

    def _one(self, i: int) -> str | None:
        if i % 3 == 2:
            fp = None
            for chunk in self.client.chat.completions.create(
                    model="rayline", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True):
                fp = chunk.system_fingerprint or fp
            return fp
        return self.client.completions.create(model="rayline", prompt=f"client {i}", max_tokens=8).system_fingerprint

    def _run(self, i: int) -> None:
        while not self.stop.is_set() and time.time() < self.stop_at:
            t = time.time()
            try:
                fp = self._one(i)
                self.results.append((t, time.time(), fp))
                time.sleep(self.pause_s)  # steady traffic, not a CPU hog that starves the rollout it watches
            except Exception as e:  # every failure counts; the test asserts there are none
                self.errors.append(f"{time.time() - t:.1f}s {type(e).__name__}: {e}")
                time.sleep(0.5)

    def answered_since(self, t: float) -> list[str | None]:
        """Fingerprints of the requests that started after `t` and were answered."""
        return [fp for start, _, fp in list(self.results) if start > t]

    def wait_for_answers_since(self, t: float, n: int, timeout_s: float = 180) -> list[str | None]:
        """Wait until `n` requests started after `t` were answered (or failed, or `timeout_s` passed)."""
        deadline = time.time() + timeout_s
        while len(self.answered_since(t)) < n and not self.errors and time.time() < deadline:
            time.sleep(0.2)
        return self.answered_since(t)


def version_tags(version: str) -> dict:
    return registry.client().get_model_version(MODEL, version).tags


def alias_version() -> str:
    return str(registry.get_alias(MODEL, "champion").version)


def builds_of(stack_cfg, app: str) -> int:
    """How often Serve's controller has built `app` on the stack: its log line for each build task it starts."""
    line = f"Importing and building app '{app}'."
    return sum(log.read_text(errors="replace").count(line)
               for log in Path(stack_cfg.ray_temp_dir).glob("session_*/logs/serve/controller_*.log"))


def test_promote_under_load_switches_to_v2_without_a_failed_request(setup, local_stack):
    v1, v2 = f"{MODEL}/1", f"{MODEL}/2"
    app = setup["rollout"].serve_cfg.app_name
    builds = builds_of(local_stack, app)
    assert builds >= 1  # v1's deploy built the app
    with Load(setup["base_url"]) as load:
        time.sleep(3)
        promoted_at = time.time()
        registry.set_alias(MODEL, "champion", "2")
        result = setup["rollout"].once("test:promote")
        answering_after = time.time() - promoted_at
        done_at = time.time()
        after = load.wait_for_answers_since(done_at, n=6)  # two rounds of the three clients
    print(f"\nrollout time (alias set -> v2 answering): {answering_after:.1f}s; {len(load.results)} requests")
    assert result.status == DEPLOYED and (result.previous_version, result.version) == ("1", "2"), result.line()
    assert load.errors == [], load.errors[:5]
    seen = [fp for _, _, fp in sorted(load.results)]
    assert seen[0] == v1 and seen[-1] == v2 and set(seen) == {v1, v2}
    # Once the rollout is verified, only v2 answers: requests that started after it, each answered by v2.
    assert len(after) >= 6 and set(after) == {v2}, after
    new, old = version_tags("2"), version_tags("1")
    assert new[rec.TAG_STATUS] == "deployed" and new[rec.TAG_DEPLOYED_AT] and new[rec.TAG_TRIGGERED_BY] == "test:promote"
    assert new[rec.TAG_PREVIOUS_VERSION] == "1" and new[rec.TAG_RUN_ID] == result.run_id
    assert old[rec.TAG_STATUS] == "retired" and old[rec.TAG_RETIRED_AT] and old[rec.TAG_RETIRED_BY] == "2"
    run = registry.client().get_run(result.run_id)
    assert run.data.tags["rollout.status"] == "deployed" and run.data.tags["rollout.from_version"] == "1"
    assert 0 < run.data.metrics["duration_s"] <= answering_after + 1
    # Where its seconds went, on the run as on the result (serve/promotion/rollout_phases.py): each phase of a deploy
    # on local Serve, in order, adding up to the run's duration.
    phases = phases_of(run.data.metrics)
    print("rollout phases: " + ", ".join(f"{p} {s:.1f}s" for p, s in phases.items()))
    assert list(phases) == ["gate", "apply", "build", "replica_start", "healthy", "verify", "record"], phases
    assert phases == pytest.approx(result.phases) and min(phases.values()) >= 0
    assert sum(phases.values()) == pytest.approx(run.data.metrics["duration_s"], abs=0.01)
    # What the attempt used (the rollout's own process: the gate hashes v2's files) on the run and on v2.
    assert run.data.metrics["usage/cpu_s"] > 0 and run.data.metrics["usage/gpu_s"] == 0
    assert new["rayline.usage.rollout_cpu_s"] == f"{run.data.metrics['usage/cpu_s']:.1f}"
    assert float(new["rayline.usage.total_cpu_s"]) >= float(new["rayline.usage.rollout_cpu_s"])
    # The same serving config: Serve reused v1's build (the version is in the replicas' actor options, not in `args`).
    assert builds_of(local_stack, app) == builds
    # Nothing to do when the alias already points at what is served.
    assert setup["rollout"].once("test:again").status == "unchanged"


def test_cli_refuses_a_version_below_the_eval_gate(setup):
    registry.set_alias(MODEL, "champion", "4")
    out = subprocess.run([sys.executable, "-m", "pipelines.rollout", "--config", str(setup["rollout_yaml"]),
                          "--model", MODEL, "--alias", "champion"],
                         capture_output=True, text=True, timeout=600, cwd=registry.PROJECT_ROOT)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"rollout rejected: {MODEL}/4 (was 2)" in out.stdout
    assert "eval.exact_match=0.1 < 0.5" in out.stdout
    tags = version_tags("4")
    assert tags[rec.TAG_STATUS] == "rejected" and "eval.exact_match=0.1 < 0.5" in tags[rec.TAG_REJECTED_REASON]
    assert alias_version() == "2"
    assert setup["rollout"].target.state().status == "RUNNING"
    assert served_fingerprint(setup) == f"{MODEL}/2"


def test_gate_refuses_a_checkpoint_cut_short(setup):
    registry.set_alias(MODEL, "champion", "5")
    result = setup["rollout"].once("test:truncated")
    assert result.status == REJECTED and "model.safetensors" in result.reason and "cut short" in result.reason
    assert "cut short" in version_tags("5")[rec.TAG_REJECTED_REASON]
    assert alias_version() == "2" and served_fingerprint(setup) == f"{MODEL}/2"


class PinnedVersions(LoadThreads):
    """The version the app's deployed config pins, as the Serve controller reports it every 0.25 s while it runs:
    (time, version)."""

    def __init__(self, target):
        super().__init__(1, self._run)
        self.target, self.seen = target, []

    def _run(self, _: int) -> None:
        from serve.online.app import served_model_of

        while not self.stop.is_set():
            pinned = served_model_of(self.target.current() or {})
            self.seen.append((time.time(), pinned.version if pinned else None))
            time.sleep(0.25)


def test_broken_checkpoint_rolls_back_while_serving_continues(setup, local_stack):
    app = setup["rollout"].serve_cfg.app_name
    builds = builds_of(local_stack, app)
    with Load(setup["base_url"], clients=2) as load, PinnedVersions(setup["rollout"].target) as pinned:
        registry.set_alias(MODEL, "champion", "3")
        result = setup["rollout"].once("test:broken")
        time.sleep(2)
    assert result.status == ROLLED_BACK, result.line()
    assert "failed to start" in result.reason and f"rolled back to {MODEL}/2, answering again" in result.reason
    assert load.errors == [], load.errors[:5]
    assert {fp for _, _, fp in load.results} == {f"{MODEL}/2"}
    # Requests ran through the failed deploy: while Serve held v3's config (from the deploy until the rollback put
    # v2's back) clients sent requests, and v2 answered them within that time.
    broken = [t for t, version in pinned.seen if version == "3"]
    assert broken and pinned.seen[-1][1] == "2", pinned.seen
    during = [fp for start, end, fp in load.results if broken[0] <= start and end <= broken[-1]]
    print(f"failed deploy held v3's config {broken[-1] - broken[0]:.1f}s; {len(during)} requests sent and answered "
          "in it")
    assert len(during) >= 2, (broken[0], broken[-1], load.results)
    tags = version_tags("3")
    assert tags[rec.TAG_STATUS] == "rolled_back" and "failed to start" in tags[rec.TAG_FAILED_REASON]
    assert alias_version() == "2"
    assert version_tags("2")[rec.TAG_STATUS] == "deployed"
    run = registry.client().get_run(result.run_id)
    assert run.data.tags["rollout.status"] == "rolled_back" and "rollback_s" in run.data.metrics
    phases = phases_of(run.data.metrics)
    assert "rollback" in phases and "verify" not in phases and list(phases)[-1] == "record", phases
    assert sum(phases.values()) == pytest.approx(run.data.metrics["duration_s"], abs=0.01)
    # Neither the failed deploy nor the restore built the app again (the same serving config throughout).
    assert builds_of(local_stack, app) == builds


def served_fingerprint(setup) -> str:
    from serve.promotion.verify import smoke_request

    return smoke_request(setup["base_url"], "rayline", "ping", api_key=serving_keys().client)["system_fingerprint"]


def test_forged_promotions_are_refused_while_serving_stays(setup, local_stack, tmp_path):
    """Issue 48's forged promotion and its variants, each promoted while clients use the app: refused with a message
    naming what is wrong, the alias back on v2, v2 answering every request. What serves is decided by eval runs of
    the exact bytes (serve/promotion/gate.py) and the bytes' manifest (core/weights_manifest.py), never by tags."""
    from stack import mlflow_auth
    from core import weights_manifest
    from stack.tiny_model import build_tiny_model
    from serve.batch.tracking import record_figures

    c = registry.client()
    v2 = c.get_model_version(MODEL, "2")
    untrained = build_tiny_model(tmp_path / "untrained", "tiny", seed=7)
    refused = {}
    with Load(setup["base_url"], clients=2) as load:
        # 1. A version registered with v2's source and tags, its eval tag set to 0.99 and the checkpoint tag pointed
        #    at an untrained model: no eval run of it exists, so the gate refuses (tags do not count).
        forged = c.create_model_version(MODEL, source=v2.source, run_id=v2.run_id, tags={
            **v2.tags, "eval.exact_match": "0.99", registry.TAG_CHECKPOINT_URI: str(untrained)})
        # 2. A tag forged on a version that was evaluated below the gate (v4: 0.1).
        registry.set_version_tags(MODEL, "4", {"eval.exact_match": "0.99"})
        # 3. A version evaluated at 0.9, then a weight file changed in the registry's artifact store on disk.
        with registry.start_run("rayline-tests", "tampered") as run:
            tampered = registry.register_checkpoint(
                MODEL, str(build_tiny_model(tmp_path / "v-tampered", "tiny", seed=3)), run_id=run.info.run_id)
        record_figures(MODEL, tampered.version, {"exact_match": 0.9})
        on_disk = local_stack.state / "mlflow" / "artifacts" / tampered.source.split("mlflow-artifacts:/", 1)[1]
        weights = on_disk / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0x01
        weights.write_bytes(bytes(data))
        for version, what in ((forged.version, "forged"), ("4", "tag"), (tampered.version, "tampered")):
            registry.set_alias(MODEL, "champion", version)
            result = setup["rollout"].once(f"test:{what}")
            refused[what] = result
            assert result.status == REJECTED and alias_version() == "2", result.line()
        # 4. A trainer's login may neither register a version of a model that serves nor move its alias: MLflow
        #    refuses both at the door (stack/mlflow_auth.py: only promoters and the rollout write it).
        mlflow_auth.provision(registry.tracking_uri(), local_stack.state, [MODEL])
        saved = os.environ.get("RAYLINE_ROLE")
        os.environ["RAYLINE_ROLE"] = "trainer"
        try:
            trainer = registry.client()
            for attempt in (lambda: trainer.set_registered_model_alias(MODEL, "champion", "1"),
                            lambda: trainer.create_model_version(MODEL, source=v2.source, run_id=v2.run_id)):
                with pytest.raises(Exception, match="403|Permission denied|PERMISSION_DENIED"):
                    attempt()
        finally:
            os.environ["RAYLINE_ROLE"] = saved or "admin"
            registry.client()
        time.sleep(1)
    print("\n" + "\n".join(f"{what:9} {r.status}: {r.reason}" for what, r in refused.items()))
    assert f"no finished eval run of {MODEL}/{forged.version} over its bytes" in refused["forged"].reason
    assert "eval.exact_match=0.1 < 0.5" in refused["tag"].reason
    assert "model.safetensors: changed since registration" in refused["tampered"].reason
    assert weights_manifest.build(str(on_disk))["digest"] != tampered.tags[registry.TAG_WEIGHTS_DIGEST]
    assert alias_version() == "2" and served_fingerprint(setup) == f"{MODEL}/2"
    assert load.errors == [], load.errors[:5]
    assert {fp for _, _, fp in load.results} == {f"{MODEL}/2"}
