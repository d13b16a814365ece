"""A termination notice saves work: when a node the run trains on is told it will go (a spot reclaim, a KubeRay pod
deleted with its grace period), every rank takes a checkpoint at the next step boundary, if one can finish before the
node goes, and then waits for Ray Train to restart the run from it.

How a notice reaches the loop (Ray 2.60): Kubernetes sends SIGTERM to the pod's main process, `ray start --block`,
which marks its node as draining (reason PREEMPTION, deadline = now + RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S) and tears
the node down when the deadline comes. Ray Train's preemption watcher sees the drain and hands the notice to every
worker; `ray.train.get_preemption_info()`, called by every rank at every step boundary, returns it (train/worker.py
`ray_notice`). Ray Train's controller then waits until the deadline and restarts the worker group from the latest
checkpoint, as a preemption (counted against `FailureConfig.max_preemption_failures`, not `max_failures`).

Whether a save fits: the deadline minus now must hold the save's expected time (the longest of the run's last
SaveTimes.KEEP saves, or `checkpoint.save_estimate_s` before the run has measured one) plus `checkpoint.notice_margin_s`.
A notice without a deadline is given `checkpoint.notice_grace_s` from when it was seen. A save that does not fit is
skipped and the run trains on; a save cut off all the same is never resumed from (its commit marker never lands:
train/checkpoint.py). Nothing here knows Ray: the notice comes from `poll`, the ranks agree through `agree`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from train.checkpoint import TrainerState

# Ray Train's controller waits this long for a notice without a deadline (DEFAULT_PREEMPTION_DEADLINE_S) before it
# restarts the group; the wait after a notice's save must outlast it.
RAY_UNKNOWN_DEADLINE_S = 120.0
# After the deadline, how long a rank that saved waits for Ray to restart the group before it gives up with an error.
RESTART_SLACK_S = 60.0


@dataclass(frozen=True)
class Notice:
    """A node of the run is going: when (unix seconds; None when Ray was told no deadline), which nodes and ranks."""

    deadline_s: float | None
    nodes: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()


class SaveTimes:
    """A running measure of how long checkpoints take (every save, each rank its own)."""

    KEEP = 3

    def __init__(self, recent: list[float] | None = None, first_guess_s: float = 10.0):
        self._recent = list(recent or [])[-self.KEEP:]
        self.first_guess_s = first_guess_s

    def add(self, seconds: float) -> None:
        self._recent = (self._recent + [seconds])[-self.KEEP:]

    @property
    def recent(self) -> list[float]:
        return list(self._recent)

    def estimate(self) -> float:
        """The longest of the last KEEP saves: a save's time varies with storage and load, and a late save is lost."""
        return max(self._recent) if self._recent else self.first_guess_s


@dataclass(frozen=True)
class Decision:
    """What a rank concluded about a notice: whether a save fits, the time left, the time a save needs."""

    fits: bool
    left_s: float
    needed_s: float


def decide(notice: Notice, now: float, seen_at: float, save_s: float, margin_s: float, grace_s: float) -> Decision:
    """Whether a save expected to take `save_s` (plus `margin_s`) finishes before the notice's deadline (or, without
    one, `grace_s` after the notice was seen at `seen_at`)."""
    deadline = notice.deadline_s if notice.deadline_s is not None else seen_at + grace_s
    left, needed = deadline - now, save_s + margin_s
    return Decision(left >= needed, left, needed)


class NotDrained(RuntimeError):
    """A rank that saved on a notice waited past the node's deadline and Ray Train did not restart the group."""


class NoticeSaver:
    """The loop's notice hook (train/loop.py StepNotice): asks `poll` at each step boundary, decides once per notice
    whether a checkpoint fits, and after the notice's checkpoint holds the rank until the group is restarted.

    `poll` and `agree` are collectives: every rank calls them at the same step. `agree(fits)` is True only when
    every rank's `fits` is, so all ranks save the same step or none does. `report(step, decision, saved)` records
    the notice and `on_saved(state)` its checkpoint (MLflow, train/worker.py)."""

    def __init__(self, poll: Callable[[], Notice | None], times: SaveTimes, grace_s: float, margin_s: float,
                 agree: Callable[[bool], bool] = lambda fits: fits,
                 report: Callable[[int, Notice, Decision, bool], None] | None = None,
                 on_saved: Callable[[TrainerState], None] | None = None,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 log: Callable[[str], None] = lambda line: print(line, flush=True)):
        self.poll, self.times, self.grace_s, self.margin_s = poll, times, grace_s, margin_s
        self.agree, self.report, self.on_saved = agree, report, on_saved
        self.clock, self.sleep, self.log = clock, sleep, log
        self._handled: Notice | None = None
        self._saving: tuple[Notice, float] | None = None  # the notice saved for and when it was seen

    def save_now(self, state: TrainerState) -> bool:
        """Collective, at each step boundary: True when a notice arrived and a checkpoint of this step fits before
        the deadline on every rank (the caller saves, then calls `saved`). A notice is judged once."""
        notice = self.poll()
        if notice is None or notice == self._handled:
            return False
        self._handled = notice
        now = self.clock()
        decision = decide(notice, now, now, self.times.estimate(), self.margin_s, self.grace_s)
        save = self.agree(decision.fits)
        where = f"nodes {', '.join(n[:12] for n in notice.nodes) or '?'} (ranks {list(notice.ranks)})"
        if save:
            self.log(f"termination notice for {where} at step {state.step}: {decision.left_s:.1f} s left, a "
                     f"checkpoint takes ~{decision.needed_s - self.margin_s:.1f} s (+{self.margin_s:g} s margin): "
                     "saving now")
            self._saving = (notice, now)
        else:
            self.log(f"termination notice for {where} at step {state.step}: {decision.left_s:.1f} s left, too little "
                     f"for a checkpoint (~{decision.needed_s - self.margin_s:.1f} s + {self.margin_s:g} s margin on "
                     "the slowest rank): not saving; the run resumes from its last checkpoint")
        if self.report is not None:
            self.report(state.step, notice, decision, save)
        return save

    def saved(self, state: TrainerState) -> None:
        """After the notice's checkpoint: hold this rank until Ray Train restarts the group (it kills this process),
        at the latest until the deadline and RESTART_SLACK_S after it; then raise NotDrained."""
        if self._saving is None:
            return
        if self.on_saved is not None:
            self.on_saved(state)
        notice, seen_at = self._saving
        deadline = notice.deadline_s if notice.deadline_s is not None else seen_at + max(self.grace_s,
                                                                                          RAY_UNKNOWN_DEADLINE_S)
        self.log(f"checkpoint of step {state.step} saved on the termination notice; waiting for the node to go "
                 f"({max(0.0, deadline - self.clock()):.0f} s) and Ray Train to restart the run from it")
        give_up = deadline + RESTART_SLACK_S
        while self.clock() < give_up:
            self.sleep(min(1.0, max(0.01, give_up - self.clock())))
        raise NotDrained(f"step {state.step}: saved on a termination notice, but the run was not restarted within "
                         f"{RESTART_SLACK_S:g} s of the node's deadline; Ray Train retries the group from that "
                         "checkpoint as after any failure")
