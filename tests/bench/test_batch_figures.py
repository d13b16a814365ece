"""bench/batch_figures.py: rounds pooled, ratios only on equal set-ups, and a note when the job is too short."""

from __future__ import annotations

from types import SimpleNamespace

from bench.batch_figures import MIN_GENERATION_S, pool, report, short_job_note


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


def test_rounds_pool_rates_by_harmonic_mean_and_flag_a_changed_setup():
    rounds = [{"tokens_per_s": 100.0, "e2e_s": 10.0, "setup": {"executor": "uni", "front end pid": 1}},
              {"tokens_per_s": 300.0, "e2e_s": 20.0, "setup": {"executor": "uni", "front end pid": 2}}]
    pooled = pool(rounds)
    assert pooled["tokens_per_s"] == 150.0  # 2 / (1/100 + 1/300): the same tokens in each round's time
    assert pooled["e2e_s"] == 15.0
    assert pooled["setup"] == {"executor": "uni", "front end pid": 1}  # the front end's pid may differ
    rounds[1]["setup"]["executor"] = "mp"
    assert pool(rounds)["setup"]["setup changed"] == "between rounds"


def test_the_report_gives_ratios_on_equal_set_ups_only(capsys):
    args = SimpleNamespace(prompts=1024, rounds=2)
    w = {"lengths": [128] * 1024}
    vllm = {**part(121.6, 12.2), "setup": {"executor": "uni", "dtype": "float32"}}
    rayline = {**part(121.6 / 0.98, 20.0), "setup": {"executor": "uni", "dtype": "float32"}}
    report(args, w, {"vllm": vllm, "rayline": rayline}, "float32", ["executor", "dtype"])
    out = capsys.readouterr().out
    assert "rayline vs vllm, same layout (steady state): 0.98x" in out, out
    assert "note: (b) generated for 122 s" in out
    rayline["setup"]["executor"] = "mp"
    report(args, w, {"vllm": vllm, "rayline": rayline}, "float32", ["executor", "dtype"])
    out = capsys.readouterr().out
    assert "(steady state): no ratio, set-ups differ" in out and "0.98x" not in out, out
