"""The cost of listening for termination notices: the train stage with `checkpoint.save_on_notice` on and off.

    python bench/bench_notice.py [--steps 30] [--warmup 5] [--micro-batch 4] [--rounds 2] [--work-dir out/bench]

With it on (the default), every rank asks `ray.train.get_preemption_info()` at every step boundary: a collective
through Ray Train's synchronization actor (train/notice.py). Both sides are bench/bench_train.py's rayline side (the
train stage's TorchTrainer, the `small` model, 2 CPU workers over gloo, checkpoints every `--warmup` steps), timed
the same way (the slowest rank's wall clock over the steps after warmup), differing only in that switch; no notice
comes. The sides run --rounds times in A-B-B-A order and are pooled. The last line is
`rayline vs rayline without notice checks: <ratio>x` (steps per second; 1.0x = the checks cost nothing).

It joins the Ray cluster the environment names (the local stack), or starts a local one.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_train import MUST_MATCH, join_ray, prepare_inputs, run_args, run_rayline, train_config  # noqa: E402
from bench.equal_terms import pooled_setup, print_setups, ratio_line, round_order  # noqa: E402

ON, OFF = "rayline", "rayline without notice checks"


def main() -> None:
    args = run_args(__doc__.splitlines()[0]).parse_args()

    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    join_ray()
    manifest = prepare_inputs(work)
    runs: dict[str, list[dict]] = {ON: [], OFF: []}
    for i, order in enumerate(round_order([ON, OFF], args.rounds)):
        for side in order:
            # A fresh run name each time: the same one would resume from the last run's checkpoints.
            cfg = train_config(work, manifest, args, f"bench-notice-{int(time.time())}-{i}")
            cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, save_on_notice=side == ON))
            r = run_rayline(cfg)
            r["setup"]["save_on_notice"] = cfg.checkpoint.save_on_notice
            runs[side].append(r)
            print(f"round {i + 1} {side}: {r['steps'] / r['seconds']:.3f} steps/s ({r['steps']} timed steps in "
                  f"{r['seconds']:.1f}s)", flush=True)
            shutil.rmtree(work / "runs" / cfg.run_name, ignore_errors=True)

    pooled = {side: {k: sum(r[k] for r in rs) for k in ("steps", "seconds")} for side, rs in runs.items()}
    setups = {side: pooled_setup(rs) for side, rs in runs.items()}
    print(f"\n{args.rounds} rounds per side, A-B-B-A, pooled; {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print_setups(setups)
    for side, r in pooled.items():
        print(f"{side}: {r['steps'] / r['seconds']:.3f} steps/s, {1000 * r['seconds'] / r['steps']:.1f} ms a step "
              f"({r['steps']} timed steps in {r['seconds']:.1f}s)")
    ours, base = pooled[ON], pooled[OFF]
    ratio = (ours["steps"] / ours["seconds"]) / (base["steps"] / base["seconds"])
    print(ratio_line("rayline without notice checks", ratio, setups[ON], setups[OFF], MUST_MATCH))


if __name__ == "__main__":
    main()
