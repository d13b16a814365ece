"""Entry point of the data stage: `python -m pipelines.prepare_data --config configs/data/<name>.yaml [key=value ...]`.

Loads the config into `data.config.Config`, joins the Ray cluster (the local stack, or the job's own
cluster under a RayJob), runs `data.prepare.main` and prints the summary table. Exit status 1 when the
run fails (for example more rejects than max_reject_fraction allows), with the reason on stderr.
"""

from __future__ import annotations

import sys

from data.config import Config
from data.manifest import RejectFractionError, summary_table
from data.prepare import main as prepare
from core.config import parse_stage_args
from core.ray_cluster import init_ray
from core.resource_wait import ResourceWaitTimeout


def main(argv: list[str] | None = None) -> int:
    cfg = parse_stage_args(Config, __doc__.splitlines()[0], argv)
    init_ray()
    try:
        result = prepare(cfg)
    except (RejectFractionError, FileNotFoundError, ValueError, ResourceWaitTimeout) as e:
        print(f"prepare_data failed: {e}", file=sys.stderr)
        return 1
    print(summary_table(result.manifest, result.manifest_uri, result.wall_s, result.skipped))
    if result.usage:
        print(f"usage: {result.usage.cpu_s:.1f} CPU-seconds, {result.usage.gpu_s:.1f} GPU-seconds "
              f"({result.usage.processes} processes)")
    print(f"manifest: {result.manifest_uri}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
