"""Submit a stage to a Ray cluster through the Jobs API, as `ray job submit --working-dir .` does.

    python -m pipelines.submit --stage data --config configs/data/sample.yaml [--address URL] [key=value ...]

Same entrypoint and runtime env as the stage's RayJob (rayjobs/stages.py); the project root is the
working_dir. The config is validated locally first, so a bad field fails before anything is uploaded.
Logs stream to stdout; the exit code is 0 only when the job SUCCEEDED. The raw equivalent:

    ray job submit --working-dir . -- python -m pipelines.prepare_data --config configs/data/sample.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass

from pipelines.config import ConfigError, load_config
from rayjobs import stages

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


@dataclass
class SubmitResult:
    job_id: str
    status: str
    seconds: float
    logs: str


def dashboard_address(address: str | None) -> str:
    addr = address or os.environ.get("RAY_ADDRESS") or "http://127.0.0.1:8265"
    if not addr.startswith("http"):
        raise ValueError(f"--address {addr}: the Jobs API wants the dashboard URL, e.g. http://127.0.0.1:8265")
    return addr


async def _tail(client, job_id: str, out) -> None:
    async for lines in client.tail_job_logs(job_id):
        out.write(lines)
        out.flush()


def submit_stage(
    stage: str, config: str, overrides: list[str] | None = None, address: str | None = None,
    wait: bool = True, stream=None, timeout_s: float = 3600, submission_id: str | None = None,
) -> SubmitResult:
    """Validate the config, submit the stage as a Ray job, optionally stream its logs until it ends."""
    from ray.job_submission import JobSubmissionClient

    st = stages.get_stage(stage)
    try:
        load_config(stages.config_class(st), config, overrides)
    except ConfigError as e:
        raise ConfigError(f"not submitted: {e}") from None
    from pipelines.ray_cluster import reload_auth_config

    reload_auth_config()  # this process may have read Ray's config before the stack's env was set
    client = JobSubmissionClient(dashboard_address(address))
    job_id = client.submit_job(
        entrypoint=stages.entrypoint(st, config, overrides),
        runtime_env=stages.job_runtime_env(str(stages.PROJECT_ROOT), stages.forwarded_env()),
        submission_id=submission_id,
        metadata={"rayline.stage": stage},
    )
    start = time.time()
    if not wait:
        return SubmitResult(job_id, str(client.get_job_status(job_id)), 0.0, "")
    if stream is not None:
        asyncio.run(_tail(client, job_id, stream))
    while (status := str(client.get_job_status(job_id).value)) not in TERMINAL:
        if time.time() - start > timeout_s:
            client.stop_job(job_id)
            raise TimeoutError(f"job {job_id} ({stage}) still {status} after {timeout_s:.0f}s; stopped it")
        time.sleep(1)
    return SubmitResult(job_id, status, time.time() - start, client.get_job_logs(job_id))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Submit a rayline stage to a Ray cluster (Jobs API)")
    p.add_argument("--stage", required=True, choices=sorted(stages.STAGES))
    p.add_argument("--config", "-c", required=True)
    p.add_argument("--address", default=None, help="Ray dashboard URL (default $RAY_ADDRESS)")
    p.add_argument("--no-wait", action="store_true", help="submit and return the job id")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    try:
        result = submit_stage(args.stage, args.config, args.overrides, args.address, wait=not args.no_wait,
                              stream=sys.stdout)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"\njob {result.job_id}: {result.status} ({result.seconds:.0f}s)")
    return 0 if result.status in ("SUCCEEDED", "PENDING", "RUNNING") else 1


if __name__ == "__main__":
    sys.exit(main())
