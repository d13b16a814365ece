"""A train-family stage as a user runs it, outside pytest too (bench/bench_faults.py): `python -m pipelines.<stage>
--config <cfg as YAML>` in a subprocess, over the sample corpus prepared by the real data stage, with a train config
from configs/train/tiny.yaml. Each stage prints its result as one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from core.config import dump_yaml, load_config
from train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
TEST_EXPERIMENT = "rayline-test-train"

# 128 train rows / 2 workers / micro-batch 8 = 8 steps per epoch: 12 steps cross an epoch boundary,
# checkpoints every 3 steps land mid-epoch (3, 6) and on the boundary's far side (9, 12).
FAST = [
    "train.micro_batch_size=8", "train.max_steps=12", "train.checkpoint_every_steps=3", "train.eval_every_steps=4",
    "train.eval_batch_size=16",
]


def prepare_sample_data(corpus: Path, tokenizer: Path, out: Path) -> str:
    """`python -m pipelines.prepare_data` of the sample corpus (stack/sample_corpus.py) into `out`; its manifest URI."""
    cmd = [sys.executable, "-m", "pipelines.prepare_data", "--config", str(ROOT / "configs/data/sample.yaml"),
           f"inputs=[{corpus / 'train.jsonl'}, {corpus / 'malformed.jsonl'}]", f"eval_inputs=[{corpus / 'eval.jsonl'}]",
           f"output_uri={out}", f"tokenizer={tokenizer}", "mlflow_experiment=rayline-test-data"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = [line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("manifest: ")]
    assert manifest, proc.stdout[-2000:]
    return manifest[-1].strip()


def train_config(model: Path, manifest: str, storage: str, *overrides: str, run_name: str | None = None) -> TrainConfig:
    """A TrainConfig from configs/train/tiny.yaml over `manifest` (FAST), a unique run name and registered model."""
    name = run_name or f"t-{uuid.uuid4().hex[:8]}"
    base = [f"run_name={name}", f"model.path={model}", f"data.manifest_uri={manifest}",
            f"checkpoint.storage_path={storage}", f"mlflow.experiment={TEST_EXPERIMENT}",
            f"mlflow.register_as=rayline-test-{uuid.uuid4().hex[:6]}", *FAST]
    return load_config(TrainConfig, ROOT / "configs/train/tiny.yaml", [*base, *overrides])


class StageRun:
    """One `python -m pipelines.<stage>` process: exit status, output, and its `result: {...}` line parsed."""

    def __init__(self, proc: subprocess.CompletedProcess):
        self.returncode, self.stdout, self.stderr = proc.returncode, proc.stdout, proc.stderr
        lines = [line for line in proc.stdout.splitlines() if line.startswith("result: ")]
        self.result = json.loads(lines[-1][len("result: "):]) if lines else None

    def __str__(self) -> str:
        return f"exit {self.returncode}\n--- stdout ---\n{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-6000:]}"


class StartedStage:
    """A `python -m pipelines.<stage>` process running in the background, its output going to files."""

    def __init__(self, proc: subprocess.Popen, out: Path, err: Path):
        self.proc, self._out, self._err = proc, out, err

    def finish(self, timeout: float) -> StageRun:
        """Wait for the process; one still running after `timeout` is killed and its run (exit -9, its output
        ending with a line that says so) comes back for the test's assertion to show."""
        timed_out = False
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        err = self._err.read_text() + (f"\n[killed by the test: still running after {timeout} s]" if timed_out else "")
        return StageRun(subprocess.CompletedProcess(self.proc.args, self.proc.returncode, self._out.read_text(), err))


class History:
    """MLflow metric histories of a run."""

    def __init__(self):
        from core import registry

        self.client = registry.client()

    def values(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """(step, value) in logging order (a resumed run may log steps after its checkpoint twice)."""
        hist = self.client.get_metric_history(run_id, key)
        return [(m.step, m.value) for m in sorted(hist, key=lambda m: (m.timestamp, m.step))]

    def curve(self, run_id: str, key: str = "loss") -> dict[int, float]:
        """Step -> the last value logged at that step."""
        return dict(self.values(run_id, key))

    def assert_resumed(self, run_id: str, resumes: list[tuple[int, int]], total: int) -> None:
        """The loss curve of a run that lost a worker after step `killed_after` and resumed from its checkpoint at
        `resumed_at`, for each (resumed_at, killed_after) of `resumes` in order: every step up to the checkpoint once,
        then those run before the kill (each may be missing: step metrics go to MLflow once a second and at each
        checkpoint), then every step from the checkpoint on again. Nothing restarted from zero."""
        steps = [s for s, _ in self.values(run_id, "loss")]
        # (steps, optional prefix?) in order: 1..r1, [r1+1..k1], r1+1..r2, [r2+1..k2], ..., rN+1..total.
        parts, done = [], 0
        for resumed_at, killed_after in resumes:
            parts += [(list(range(done + 1, resumed_at + 1)), False),
                      (list(range(resumed_at + 1, killed_after + 1)), True)]
            done = resumed_at
        parts.append((list(range(done + 1, total + 1)), False))

        def matches(rest: list[int], parts: list[tuple[list[int], bool]]) -> bool:
            if not parts:
                return not rest
            (seq, optional), later = parts[0], parts[1:]
            lengths = range(len(seq), -1, -1) if optional else [len(seq)]
            return any(rest[:n] == seq[:n] and matches(rest[n:], later) for n in lengths)

        assert matches(steps, parts), (steps, resumes)


def start_stage(stage: str, cfg, workdir: Path, env: dict[str, str] | None = None) -> StartedStage:
    """Start `python -m pipelines.<stage> --config <cfg written as YAML in workdir>` with extra env."""
    name = f"{stage}-{uuid.uuid4().hex[:8]}"
    path, out, err = workdir / f"{name}.yaml", workdir / f"{name}.out", workdir / f"{name}.err"
    path.write_text(dump_yaml(cfg))
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", f"pipelines.{stage}", "--config", str(path)], cwd=ROOT,
                                env={**os.environ, **(env or {})}, stdout=o, stderr=e, text=True)
    return StartedStage(proc, out, err)
