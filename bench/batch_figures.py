"""What bench/bench_batch_infer.py prints at its end: its parts' rounds pooled, their set-ups, figures and ratios."""

from __future__ import annotations

import os
import time

from bench.equal_terms import print_setups, ratio_line


def pool(results: list[dict]) -> dict:
    """One part's rounds as one result: rates (keys ending in per_s) by harmonic mean, other numbers by mean,
    the set-up of the first round (and `setup changed` when a later round's differs)."""
    out = {k: (len(results) / sum(1 / r[k] for r in results) if k.endswith("per_s") else
               sum(r[k] for r in results) / len(results))
           for k, v in results[0].items() if isinstance(v, (int, float))}
    if "setup" in results[0]:
        stable = {"front end pid"}
        strip = lambda s: {k: v for k, v in s.items() if k not in stable}  # noqa: E731
        out["setup"] = results[0]["setup"]
        if any(strip(r["setup"]) != strip(results[0]["setup"]) for r in results[1:]):
            out["setup"] = {**out["setup"], "setup changed": "between rounds"}
    return out


MIN_GENERATION_S = 180.0
"""The end-to-end comparison is defined on a job where plain vLLM (b) generates for at least 3 minutes (issue 17): on a
shorter one a few seconds of start-up decide the ratio, and real batch jobs run for minutes to hours."""


def short_job_note(vllm: dict, prompts: int, min_s: float = MIN_GENERATION_S) -> str | None:
    """A line saying the job is too short for the end-to-end comparison's definition, with the --prompts that would
    make it long enough on this machine; None when (b) generated for min_s or more. (b)'s generation time is its
    output tokens over its steady-state rate: its engine's busy time, first request queued to last token."""
    generated_s = vllm["e2e_tokens_per_s"] * vllm["e2e_s"] / vllm["tokens_per_s"]
    if generated_s >= min_s:
        return None
    enough = -(-int(prompts * min_s / generated_s * 1.1) // 256) * 256  # 10% to spare, in steps of 256
    return (f"note: (b) generated for {generated_s:.0f} s, under the {min_s:.0f} s the end-to-end comparison is defined "
            f"on; start-up weighs more here than on a real job: --prompts {enough} for a job long enough on this machine")


def report(args, w: dict, res: dict, dtype: str, must_match: list[str]) -> None:
    """The set-ups of the parts that ran, each part's figures, and the ratios (the (b)-(c) ones only on equal terms)."""
    hf, vllm, rl, rl_running, defaults = (res.get(p) for p in ("hf", "vllm", "rayline", "rayline-running-ray",
                                                                "vllm-defaults"))
    print(f"\nworkload: {args.prompts} prompts, {sum(w['lengths']):,} output tokens (16-256 each), small model, "
          f"dtype {dtype}, {os.cpu_count()} CPUs; {args.rounds} round(s) per part, pooled; "
          f"finished {time.strftime('%Y-%m-%d %H:%M %Z')}")
    setups = {name: res[part]["setup"] for name, part in
              [("rayline (c)", "rayline"), ("rayline (c')", "rayline-running-ray"), ("vllm same layout (b)", "vllm"),
               ("vllm defaults (d)", "vllm-defaults")] if part in res}
    if setups:
        print_setups(setups)

    def engine_line(label: str, r: dict, note: str = "") -> None:
        steady = f"{r['tokens_per_s']:8.1f} tok/s steady state, " if "tokens_per_s" in r else ""
        first = f", first request in the engine at {r['first_request_s']:.1f} s" if "first_request_s" in r else ""
        print(f"{label:34}{steady}{r['e2e_tokens_per_s']:.1f} tok/s end to end ({r['e2e_s']:.1f} s{first}){note}")

    if hf:
        print(f"{'(a) hf generate, static batches:':34}{hf['tokens_per_s']:8.1f} tok/s (batch 32: {hf['batch_32']:.1f}, "
              f"batch 64: {hf['batch_64']:.1f}; first {int(hf['prompts'])} prompts; {int(hf['threads'])} thread)")
    if vllm:
        engine_line("(b) vllm, rayline's layout:", vllm)
    if rl:
        engine_line("(c) rayline batch stage:", rl, ", Ray started in the clock")
    if rl_running:
        engine_line("(c') rayline on a running Ray:", rl_running, ", the driver a fresh process")
    if defaults:
        engine_line("(d) vllm LLM, its own defaults:", defaults, "; steady state = the LLM.chat call")
    if rl and hf:
        print(f"rayline vs hf generate: {rl['tokens_per_s'] / hf['tokens_per_s']:.1f}x")
    if vllm and (rl or rl_running) and (note := short_job_note(vllm, args.prompts)):
        print(note)
    for name, r in [("vllm, same layout", rl), ("vllm, same layout (on a running Ray)", rl_running)]:
        if r and vllm:
            print(ratio_line(f"{name} (steady state)", r["tokens_per_s"] / vllm["tokens_per_s"], r["setup"],
                             vllm["setup"], must_match))
            print(ratio_line(f"{name} (end to end)", r["e2e_tokens_per_s"] / vllm["e2e_tokens_per_s"], r["setup"],
                             vllm["setup"], must_match))
    if rl and defaults:  # the comparison a user makes: each side as it comes
        print(f"rayline vs vllm with its own defaults (end to end): "
              f"{rl['e2e_tokens_per_s'] / defaults['e2e_tokens_per_s']:.2f}x")
        print(f"rayline vs vllm with its own defaults (steady state against its LLM.chat call): "
              f"{rl['tokens_per_s'] / defaults['tokens_per_s']:.2f}x")
