"""Each stack's own Serve fallback proxy ports (stack/config.py `serve_fallback_ports`), no stack started.

While Serve rebuilds an app (every rollout and canary promotion that pins a new version), each node's HAProxy sends
the app's requests to Serve's fallback proxy on the head. Ray gives that proxy fixed ports bound with SO_REUSEPORT,
so two stacks on one machine shared it and one stack's promotion got 404s from the other's proxy (issue 51).
"""

from __future__ import annotations

import inspect

import pytest

from stack import lifecycle as stack, parts as stack_parts
from core.config import ConfigError, from_dict
from tests.conftest import TEST_STACK


def test_each_stack_gets_its_own_fallback_proxy_ports_and_up_checks_them():
    default, tests = stack.StackConfig(), from_dict(stack.StackConfig, TEST_STACK)
    assert default.serve_fallback_ports == (8500, 9500)  # Ray's own, for the one stack a machine usually runs
    assert tests.serve_fallback_ports == (TEST_STACK["serve_port"] + 500, TEST_STACK["serve_port"] + 1500)
    assert tests.serve_fallback_ports in ((8510, 9510), (8610, 9610))  # gw0's stack, gw1's
    for cfg in (default, tests):
        http, grpc = cfg.serve_fallback_ports
        (head,) = stack_parts.specs(cfg)["ray"][:1]
        assert head[2]["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"] == str(http)
        assert head[2]["RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"] == str(grpc)
        # `up` refuses to start where another process (another stack's proxy) holds one of them.
        assert {http, grpc} <= set(stack_parts.ports(cfg)["ray"])


@pytest.mark.parametrize("overrides", [{"serve_port": 7690},  # its fallback 8190 = the test's metrics_export_port
                                       {"serve_port": 64100}])
def test_a_serve_port_whose_fallback_ports_clash_is_named(overrides):
    with pytest.raises(ConfigError, match="serve_port"):
        from_dict(stack.StackConfig, {"metrics_export_port": 8190, **overrides}, "stack.json")


def test_the_fallback_proxy_port_switches_are_rays():
    """P19: ray.serve._private.constants reads RAY_SERVE_FALLBACK_PROXY_HTTP/GRPC_PORT from the environment, and the
    controller's proxy state starts the head's fallback proxy on them."""
    from ray.serve._private import constants, proxy_state

    source = inspect.getsource(constants)
    for name in ("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"):
        assert f'"{name}"' in source and hasattr(constants, name), name
        assert f"port = {name}" in inspect.getsource(proxy_state.ProxyStateManager._start_fallback_proxy_if_needed)
