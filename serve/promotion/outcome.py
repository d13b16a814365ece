"""What a rollout (or a canary) ended with: one of the outcomes below, the versions and the reason."""

from __future__ import annotations

from dataclasses import dataclass, field

DEPLOYED, UNCHANGED, REJECTED, ROLLED_BACK, SKIPPED, ERROR = (
    "deployed", "unchanged", "rejected", "rolled_back", "skipped", "error")


@dataclass
class RolloutResult:
    status: str
    """deployed | unchanged | rejected | rolled_back | skipped | error"""
    model: str
    version: str | None = None
    previous_version: str | None = None
    reason: str = ""
    run_id: str | None = None
    seconds: float = 0.0
    """Rollout start -> new version answering (deployed), or -> rollback done."""
    phases: dict[str, float] = field(default_factory=dict)
    """Where `seconds` went, phase -> seconds, summing to it (serve/promotion/rollout_phases.py; empty for a canary)."""

    def line(self) -> str:
        to = f"{self.model}/{self.version}" if self.version else self.model
        frm = f" (was {self.previous_version})" if self.previous_version else ""
        return f"rollout {self.status}: {to}{frm} in {self.seconds:.1f}s" + (f": {self.reason}" if self.reason else "")
