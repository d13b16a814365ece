"""How the demo drives the stages as a user does: each stage submitted as a Ray job through the Jobs API
(`pipelines.submit`), its log streamed to a file with a progress line, its outcome read back from MLflow by the run's
`rayline.ray_job_id` tag; promotion with the MLflow UI's REST call; one chat request with the `openai` client."""

from __future__ import annotations

import base64
import json
import re
import time
import urllib.request
from pathlib import Path

from core import registry
from pipelines.submit import submit_stage
from rayjobs import stages


class StageFailed(RuntimeError):
    pass


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_NOISE = re.compile(r"\b(INFO|WARNING|DEBUG)\b|it/s\]|row/s\]|\d+/\d+ \[|^\W*$")


class ProgressLog:
    """A stage's log into its file and, every `every_s` seconds, one line on stdout: the time so far and the
    last line the stage printed itself (Ray's own INFO/WARNING records and progress bars are skipped)."""

    def __init__(self, out, every_s: float = 20.0):
        self.out, self.every_s = out, every_s
        self.start = self.shown = time.time()
        self.last = ""

    def write(self, text: str) -> int:
        self.out.write(text)
        for line in _ANSI.sub("", text).splitlines():
            line = line.strip()
            if line and not _NOISE.search(line):
                self.last = line[:140]
        now = time.time()
        if self.last and now - self.shown >= self.every_s:
            print(f"    ... {now - self.start:.0f}s: {self.last}", flush=True)
            self.shown = now
        return len(text)

    def flush(self) -> None:
        self.out.flush()


def run_stage(stage: str, config: str, overrides: list[str], logs: Path, log_name: str = "") -> str:
    """Submit a stage as a Ray job, stream its log to a file, and return the job id; raise with the log tail on failure."""
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{log_name or stage}.log"
    t = time.time()
    print(f"    ray job: python -m {stages.get_stage(stage).module} --config {config} ({len(overrides)} overrides); log: {log}",
          flush=True)
    with open(log, "w") as out:
        result = submit_stage(stage, config, overrides, stream=ProgressLog(out))
    print(f"    {result.status} in {time.time() - t:.0f}s (job {result.job_id})", flush=True)
    if result.status != "SUCCEEDED":
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise StageFailed(f"stage {stage} {result.status} (job {result.job_id}); full log: {log}\n{tail}")
    return result.job_id


def _first_run(filter_string: str):
    """The oldest MLflow run in any experiment that matches `filter_string`, or None."""
    import mlflow

    runs = mlflow.search_runs(search_all_experiments=True, output_format="list", filter_string=filter_string,
                              order_by=["attributes.start_time ASC"])
    return runs[0] if runs else None


def run_of_job(job_id: str):
    """The MLflow run a stage job created (runs carry `rayline.ray_job_id`)."""
    run = _first_run(f"tags.`{registry.TAG_RAY_JOB_ID}` = '{job_id}'")
    if run is None:
        raise StageFailed(f"job {job_id} left no MLflow run tagged {registry.TAG_RAY_JOB_ID}")
    return run


def data_run_of_job(job_id: str, log: Path):
    """The data stage's run: the job's own, or, when the job found its version already prepared (a second
    demo on the same corpus), the run that prepared it, found by the manifest the job printed."""
    try:
        return run_of_job(job_id)
    except StageFailed:
        printed = [ln.split(" ", 1)[1] for ln in log.read_text().splitlines() if ln.startswith("manifest: ")]
        if not printed:
            raise
        run = _first_run(f"tags.`{registry.TAG_DATASET_MANIFEST}` = '{printed[-1].strip()}' "
                         f"and tags.`{registry.TAG_STAGE}` = 'data'")
        if run is None:
            raise StageFailed(f"job {job_id}: no MLflow data run for {printed[-1]}") from None
        return run


def _as_promoter(path: str, body: dict, login: Path) -> dict:
    """One MLflow REST call logged in as the promoter (HTTP basic auth, as the browser sends it)."""
    from core.secret_files import read_login

    user, password = read_login(login)
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    req = urllib.request.Request(f"{registry.tracking_uri()}/api/2.0/mlflow/{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Basic {auth}"},
                                 method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"{}")


def promote(candidates: str, version: str, production: str, login: Path, alias: str = registry.DEFAULT_ALIAS) -> str:
    """What a promoter does in the MLflow UI: "Promote model" copies the candidate version into the production model
    (its source `models:/<candidates>/<version>`, its run and tags with it), then the alias goes on the copy. The
    same REST calls the UI makes, as the promoter; returns the production version."""
    mv = registry.client().get_model_version(candidates, version)
    created = _as_promoter("model-versions/create", {
        "name": production, "source": f"models:/{candidates}/{version}", "run_id": mv.run_id,
        "tags": [{"key": k, "value": v} for k, v in mv.tags.items()],
        "description": f"promoted from {candidates}/{version}"}, login)
    copy = str(created["model_version"]["version"])
    _as_promoter("registered-models/alias", {"name": production, "alias": alias, "version": copy}, login)
    return copy


def chat(base_url: str, question: str, model: str = "rayline") -> tuple[str, str]:
    """One OpenAI-client chat request; returns (answer, what served it: the version in `system_fingerprint`, or for
    an adapter (`rayline:<name>`) the response's `model`, which names the adapter version)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1")  # the key: $OPENAI_API_KEY, the stack's client key (`stack env`)
    resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                          max_tokens=16, temperature=0)
    return resp.choices[0].message.content, (resp.model if ":" in model else resp.system_fingerprint) or ""


def registered_version(name: str, run, job: str) -> str:
    """The version of `name` the training run registered."""
    versions = registry.client().search_model_versions(f"name = '{name}' and run_id = '{run.info.run_id}'")
    if not versions:
        raise StageFailed(f"train job {job} registered no version of {name}")
    version = str(max(int(v.version) for v in versions))
    print(f"    registered models:/{name}/{version}")
    return version
