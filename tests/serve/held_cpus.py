"""A Serve app that holds CPUs, as the demo's apps hold 1 of the stack's 2: tests/serve/echo_app.py's replica asking
for all of the cluster's CPUs but `left`, for tests of jobs that must say why they wait."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

APP = "hold-cpus"


@contextmanager
def serve_app_holding_cpus(left: float = 0.5) -> Iterator[float]:
    """Within the block, the Serve app `hold-cpus` holds all the cluster's CPUs but `left`; yields what it holds.
    Needs a Ray driver connected (init_ray) and the stack's env (RAYLINE_SERVE_URL). Serve, if this starts it, listens
    where the stack's own apps do: a Serve started with the library's default port (8000) would stay on it for every
    later test and rollout of the session."""
    import os
    from urllib.parse import urlparse

    import ray
    from ray import serve

    from tests.serve.echo_app import Echo

    url = urlparse(os.environ["RAYLINE_SERVE_URL"])
    serve.start(http_options={"host": url.hostname, "port": url.port})
    held = float(ray.cluster_resources()["CPU"]) - left
    serve.run(Echo.options(ray_actor_options={"num_cpus": held}).bind("held", False), name=APP, route_prefix=f"/{APP}")
    try:
        yield held
    finally:
        serve.delete(APP)
