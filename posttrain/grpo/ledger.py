"""The sample ledger: one JSON line per policy update, naming the prompts it consumed (stream positions) and the
policy step(s) its samples came from. Resuming from a checkpoint cuts the ledger back to that checkpoint's step, so
the ledger of a finished run is its exact history: each prompt consumed once, each update from one policy step."""

from __future__ import annotations

import json
from pathlib import Path


class Ledger:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def entries(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def append(self, step: int, prompt_indices: list[int], policy_steps: list[int], reward_mean: float) -> None:
        """Record update `step` (1-based: the policy step it produces): its prompts and its samples' policy steps."""
        entry = {"step": step, "prompts": prompt_indices, "policy_steps": sorted(set(policy_steps)),
                 "reward_mean": round(reward_mean, 6)}
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    def rewind(self, step: int) -> int:
        """Drop the updates after `step` (they are redone from the checkpoint); returns how many were dropped."""
        kept = [e for e in self.entries() if e["step"] <= step]
        dropped = len(self.entries()) - len(kept)
        self.path.write_text("".join(json.dumps(e) + "\n" for e in kept))
        return dropped


def check_history(entries: list[dict], max_staleness: int) -> dict[str, int]:
    """What the ledger must show: consecutive steps, every prompt position consumed exactly once with none skipped,
    each update's samples from one policy step no older than `max_staleness`. Raises ValueError naming the
    first breach; returns totals."""
    seen: list[int] = []
    for n, e in enumerate(entries, 1):
        if e["step"] != n:
            raise ValueError(f"ledger: update {n} is recorded as step {e['step']}")
        if len(e["policy_steps"]) != 1:
            raise ValueError(f"ledger: step {e['step']} mixes samples of policy steps {e['policy_steps']}")
        lag = (e["step"] - 1) - e["policy_steps"][0]
        if not 0 <= lag <= max_staleness:
            raise ValueError(f"ledger: step {e['step']} trained on samples of policy step {e['policy_steps'][0]} "
                             f"(lag {lag}, allowed {max_staleness})")
        seen += e["prompts"]
    if sorted(seen) != list(range(len(seen))):
        dup = sorted({i for i in seen if seen.count(i) > 1})
        raise ValueError(f"ledger: prompts consumed twice {dup[:5]} or skipped")
    return {"updates": len(entries), "prompts": len(seen)}
