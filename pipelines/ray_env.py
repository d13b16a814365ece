"""Environment for the Ray processes of a cluster that serves (controller, proxy, replicas): the local stack's
`ray start` and the RayService pods carry it. Serve reads these once, when each process imports it.

Ray Serve's request-path settings from its `RAY_SERVE_THROUGHPUT_OPTIMIZED` set, minus direct ingress (that
one moves the HTTP port to each replica): user code and the handle router on the replica's own event loop
instead of hopping threads for every streamed chunk, request-path logs buffered, and the proxy talking to
replicas over gRPC instead of Ray object refs per chunk.
"""

SERVE_PROCESS_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
    "RAY_SERVE_PROXY_USE_GRPC": "1",
}
