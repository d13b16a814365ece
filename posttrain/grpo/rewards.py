"""Verifier rewards, named in the config (`reward.name`): pure Python functions of a completion and the prompt's
reference answer, scored in Ray tasks.

`exact_answer` is the batch eval's exact match (serve/batch/metrics.exact_match: case- and whitespace-insensitive)
plus a format term: an answer that ends where it should (EOS, not cut at max_tokens) on one line. So a policy is
rewarded for what the eval scores, and a little for the shape of an answer while it has none right yet.
"""

from __future__ import annotations

from typing import Callable

from serve.batch.metrics import exact_match

FORMAT_WEIGHT = 0.1
"""The format term's share: small beside a right answer, so format alone never outranks correctness."""


def well_formed(text: str, finished: bool) -> bool:
    """One non-empty line that the model ended itself (EOS), not one cut off at max_tokens."""
    return finished and bool(text.strip()) and "\n" not in text.strip()


def exact_answer(text: str, finished: bool, reference: str) -> float:
    """1 for the exact answer (as the eval scores it), plus FORMAT_WEIGHT for a well-formed one."""
    return float(exact_match(text, reference)) + FORMAT_WEIGHT * well_formed(text, finished)


def format_only(text: str, finished: bool, reference: str) -> float:
    """The format term alone (a check that a policy can learn the answer's shape)."""
    return float(well_formed(text, finished))


REWARDS: dict[str, Callable[[str, bool, str], float]] = {"exact_answer": exact_answer, "format_only": format_only}


def reward_fn(name: str) -> Callable[[str, bool, str], float]:
    """The reward named `name`; a clear error naming the known ones otherwise."""
    if name not in REWARDS:
        raise ValueError(f"reward.name: {name!r} is not a known reward (known: {', '.join(sorted(REWARDS))})")
    return REWARDS[name]


def score(name: str, items: list[tuple[str, bool, str]], delay_s: float = 0.0) -> list[float]:
    """Score (text, finished, reference) items with the reward `name`. `delay_s` stands in for a slow verifier
    (a sandbox, a reward model) so its backpressure can be seen and tested."""
    import time

    fn = reward_fn(name)
    if delay_s:
        time.sleep(delay_s)
    return [fn(text, finished, ref) for text, finished, ref in items]
