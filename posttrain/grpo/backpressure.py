"""Reward scoring in Ray tasks with a bound on the tasks in flight: when the verifier is slower than generation,
submitting waits (and the wait is measured) instead of samples piling up in the object store."""

from __future__ import annotations

import time

import ray

from posttrain.grpo.rewards import score


class BoundedScorer:
    """Submit reward chunks as Ray tasks, at most `max_in_flight` pending; `results()` gives them in order."""

    def __init__(self, reward: str, max_in_flight: int, delay_s: float = 0.0):
        self.reward, self.max_in_flight, self.delay_s = reward, max_in_flight, delay_s
        # DEFAULT: never inside a placement group the caller runs in (a Tune trial's 0.01-CPU bundle,
        # posttrain/grpo_tune.py), whose CPU a reward task would not fit.
        self.task = ray.remote(num_cpus=0.1, scheduling_strategy="DEFAULT")(score)
        self.pending: list[ray.ObjectRef] = []
        self.order: list[ray.ObjectRef] = []
        self.waited_s = 0.0
        self.peak_in_flight = 0

    def submit(self, items: list[tuple[str, bool, str]], pool=None) -> None:
        """Queue one chunk of (text, finished, reference) for the verifier, or with `pool` (a RewardPool) one chunk of
        texts for the reward model; blocks while `max_in_flight` chunks are pending."""
        while len(self.pending) >= self.max_in_flight:
            start = time.perf_counter()
            _, self.pending = ray.wait(self.pending, num_returns=1)
            self.waited_s += time.perf_counter() - start
        ref = pool.score(items) if pool is not None else self.task.remote(self.reward, items, self.delay_s)
        self.pending.append(ref)
        self.order.append(ref)
        self.peak_in_flight = max(self.peak_in_flight, len(self.pending))

    def results(self) -> list[float]:
        """Every submitted chunk's scores, in submission order (waits for the rest); resets the queue."""
        scores = [s for chunk in ray.get(self.order) for s in chunk]
        self.pending, self.order = [], []
        return scores
