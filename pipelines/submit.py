"""Submit a stage to a Ray cluster through the Jobs API, as `ray job submit --working-dir .` does.

    python -m pipelines.submit --stage data --config configs/data/sample.yaml [--address URL] [--env NAME=VALUE]
                               [key=value ...]

Same entrypoint and runtime env as the stage's RayJob (rayjobs/stages.py); the working_dir is a snapshot of
the project's code and configs (core/job_package.py), never logs or data left in the
checkout. The config is validated locally first, so a bad field fails before anything is uploaded.
The job's env carries its role (RAYLINE_ROLE), the caller's non-secret pointers (stages.FORWARDED_ENV) and
`--env`; never a secret: every holder of the cluster's token can read a job's runtime_env back, so a variable
named like one (..._TOKEN, ..._SECRET..., ..._PASSWORD, ..._KEY) is refused, and credentials come from the cluster.
Logs stream to stdout; the exit code is 0 only when the job SUCCEEDED; a job still running
after `--timeout` seconds (default 3600) is stopped. The raw equivalent:

    ray job submit --working-dir . -- python -m pipelines.prepare_data --config configs/data/sample.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time
from dataclasses import dataclass

from core.config import ConfigError, load_config
from core.job_package import PackageError, build_job_package
from rayjobs import stages

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


@dataclass
class SubmitResult:
    """A submitted job's id, its status when `submit_stage` returned, and the seconds it waited. The job's log is
    not kept here: it went to `stream` as it was written, and `ray job logs <job_id>` reads it again."""

    job_id: str
    status: str
    seconds: float


def dashboard_address(address: str | None) -> str:
    addr = address or os.environ.get("RAY_ADDRESS") or "http://127.0.0.1:8265"
    if not addr.startswith("http"):
        raise ValueError(f"--address {addr}: the Jobs API wants the dashboard URL, e.g. http://127.0.0.1:8265")
    return addr


async def _tail(client, job_id: str, out) -> None:
    async for lines in client.tail_job_logs(job_id):
        out.write(lines)
        out.flush()


def _follow_logs(client, job_id: str, out, seconds: float) -> None:
    """Stream the job's logs to `out` until it ends or `seconds` pass, whichever comes first."""

    async def follow() -> None:
        try:
            await asyncio.wait_for(_tail(client, job_id, out), timeout=max(seconds, 0.0))
        except asyncio.TimeoutError:
            pass  # the caller finds the job still running and stops it

    asyncio.run(follow())


def submit_stage(
    stage: str, config: str, overrides: list[str] | None = None, address: str | None = None,
    wait: bool = True, stream=None, timeout_s: float = 3600, submission_id: str | None = None,
    env: dict[str, str] | None = None,
) -> SubmitResult:
    """Validate the config, submit the stage as a Ray job, optionally stream its logs until it ends.

    `env`: more env vars for the job; one named like a secret raises stages.SecretInRuntimeEnv before anything
    is sent. A job still running `timeout_s` after submission is stopped and TimeoutError raised (logs streaming
    or not).
    """
    from ray.job_submission import JobSubmissionClient

    st = stages.get_stage(stage)
    try:
        load_config(stages.config_class(st), config, overrides)
    except ConfigError as e:
        raise ConfigError(f"not submitted: {e}") from None
    job_env = stages.submission_env(st, env)
    from core.ray_cluster import reload_auth_config

    reload_auth_config()  # this process may have read Ray's config before the stack's env was set
    client = JobSubmissionClient(dashboard_address(address))
    package = build_job_package(stages.PROJECT_ROOT)  # a snapshot: files the user writes meanwhile stay out
    try:
        job_id = client.submit_job(
            entrypoint=stages.entrypoint(st, config, overrides),
            runtime_env=stages.job_runtime_env(str(package), job_env),
            submission_id=submission_id,
            metadata={"rayline.stage": stage},
        )
    finally:
        shutil.rmtree(package, ignore_errors=True)  # uploaded to the GCS by now (or never will be)
    start = time.time()
    if not wait:
        return SubmitResult(job_id, str(client.get_job_status(job_id)), 0.0)
    deadline = start + timeout_s
    if stream is not None:
        # The log stream only ends with the job, so the timeout bounds it too.
        _follow_logs(client, job_id, stream, deadline - time.time())
    while (status := str(client.get_job_status(job_id).value)) not in TERMINAL:
        if time.time() > deadline:
            client.stop_job(job_id)
            raise TimeoutError(f"job {job_id} ({stage}) still {status} after the {timeout_s:g}s timeout "
                               f"(timeout_s); stopped it. Raise the timeout, or follow the job with "
                               f"`ray job logs -f {job_id}`")
        time.sleep(1)
    return SubmitResult(job_id, status, time.time() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Submit a rayline stage to a Ray cluster (Jobs API)")
    p.add_argument("--stage", required=True, choices=sorted(stages.STAGES))
    p.add_argument("--config", "-c", required=True)
    p.add_argument("--address", default=None, help="Ray dashboard URL (default $RAY_ADDRESS)")
    p.add_argument("--no-wait", action="store_true", help="submit and return the job id")
    p.add_argument("--timeout", type=float, default=3600, help="seconds to wait before stopping the job")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="an env var for the job (repeatable); secrets are refused: the cluster must hold them")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    env = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            print("error: an --env argument is not NAME=VALUE (not shown: it may hold a secret)", file=sys.stderr)
            return 2
        env[name] = value
    try:
        result = submit_stage(args.stage, args.config, args.overrides, args.address, wait=not args.no_wait,
                              stream=sys.stdout, timeout_s=args.timeout, env=env)
    except (ConfigError, ValueError, PackageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TimeoutError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    print(f"\njob {result.job_id}: {result.status} ({result.seconds:.0f}s)")
    return 0 if result.status in ("SUCCEEDED", "PENDING", "RUNNING") else 1


if __name__ == "__main__":
    sys.exit(main())
