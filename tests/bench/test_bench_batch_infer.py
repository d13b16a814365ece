"""bench/bench_batch_infer.py: the end-to-end comparison is only on its own terms on a job long enough."""

from __future__ import annotations

from bench.bench_batch_infer import MIN_GENERATION_S, short_job_note


def part(generated_s: float, startup_s: float, tokens: int = 139_432) -> dict:
    """A part's pooled figures: `tokens` generated in `generated_s` of engine time after `startup_s` of start-up."""
    e2e_s = startup_s + generated_s
    return {"tokens_per_s": tokens / generated_s, "e2e_tokens_per_s": tokens / e2e_s, "e2e_s": e2e_s}


def test_a_job_of_three_minutes_or_more_needs_no_note():
    assert short_job_note(part(MIN_GENERATION_S, 12.0), 2048) is None
    assert short_job_note(part(300.0, 12.0), 2048) is None


def test_a_short_job_is_named_with_the_prompts_that_would_be_enough():
    # 2026-12-06: 1,024 prompts, (b) generating ~122 s of its 134 s end to end.
    note = short_job_note(part(121.6, 12.2), 1024)
    assert note.startswith("note: (b) generated for 122 s, under the 180 s"), note
    # 1,024 x 180 / 121.6 x 1.1 = 1,667, rounded up to a multiple of 256.
    assert note.endswith("--prompts 1792 for a job long enough on this machine"), note
    # Start-up does not count as generation: a job 200 s end to end with 60 s of start-up is still short.
    assert "generated for 140 s" in short_job_note(part(140.0, 60.0), 1024)
