"""Where one rollout's seconds went: consecutive phases that add up to its duration, logged on its run.

    gate           the attempt's start (the alias and the served config read) -> the gate's verdict (checkpoint
                   resolved and hashed, eval evidence read)
    apply          the app config rendered and handed to the target (dashboard PUT, RayService patch)
    build          -> the first replica of the new version exists: Serve ran the app's builder (`import_path`)
                   and placed the replica (local Serve only; elsewhere this time is in `healthy`)
    replica_start  -> the new replicas RUNNING (those Serve started so far: with several, rolled in turns, the first
                   turn): the replica's process, vLLM's import, the engine's start, the weights' load
    healthy        -> the target calls the app healthy on the new version (Serve: the old replicas out of service)
    verify         -> a smoke request answered by the new version
    rollback       (a failed deploy or verify) -> the previous config back and answering
    record         -> the version tags and the run written (every attempt's last phase)

Each phase is the time from the previous mark to its own, so the phases sum to the run's `duration_s` exactly;
a phase a rollout did not pass through (a rejected one has no `build`) is absent, not zero. The run carries them as
metrics `rollout/seconds_<phase>` (serve/promotion/rollout.py `finish`).
"""

from __future__ import annotations

import time

PHASES = ("gate", "apply", "build", "replica_start", "healthy", "verify", "rollback", "record")
METRIC_PREFIX = "rollout/seconds_"


class PhaseClock:
    """Marks the end of each phase of one rollout; `seconds` holds phase -> seconds, in the order passed."""

    def __init__(self, start: float | None = None):
        self.start = self.last = time.time() if start is None else start
        self.seconds: dict[str, float] = {}

    def mark(self, phase: str, at: float | None = None) -> None:
        """End `phase` now (or at `at`): it gets the time since the previous mark (a phase marked twice adds up)."""
        if phase not in PHASES:
            raise ValueError(f"unknown rollout phase {phase!r} (one of {', '.join(PHASES)})")
        at = time.time() if at is None else max(at, self.last)
        self.seconds[phase] = self.seconds.get(phase, 0.0) + at - self.last
        self.last = at

    @property
    def total(self) -> float:
        """Start -> the last mark: the sum of the phases."""
        return self.last - self.start

    def metrics(self) -> dict[str, float]:
        """The phases as the run's metrics (`rollout/seconds_<phase>`)."""
        return {METRIC_PREFIX + phase: s for phase, s in self.seconds.items()}

    def line(self) -> str:
        return ", ".join(f"{phase} {s:.1f}s" for phase, s in self.seconds.items())


def phases_of(run_metrics: dict[str, float]) -> dict[str, float]:
    """A rollout run's phases back from its metrics (phase -> seconds), in PHASES order."""
    return {p: run_metrics[METRIC_PREFIX + p] for p in PHASES if METRIC_PREFIX + p in run_metrics}
