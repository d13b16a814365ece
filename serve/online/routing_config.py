"""How Serve picks the engine replica for a request (the engine deployment's request router).

    routing:
      policy: prefix_cache_affinity   # or power_of_two (Serve's default)
      imbalanced_threshold: 8
      match_rate_threshold: 0.1

`power_of_two`: Serve's default: two replicas drawn at random, the one with the shorter queue. `prefix_cache_affinity`:
Ray Serve LLM's PrefixCacheAffinityRouter (`ray.serve.llm.request_router`, public in ray 2.60): a request goes to
the replica whose earlier requests share the longest prefix with it, so chat and agent traffic that repeats long
system prompts finds those tokens in that replica's prefix cache; while queue lengths differ by
`imbalanced_threshold` or more it balances load (power of two) instead, and below `match_rate_threshold` of the
prompt matched it picks the replica that has seen the least text. The router reads the prompt from the request
object a handle call carries, so it needs `ingress: deployment` (the OpenAI ingress calls the engine replicas
through handles); with `ingress: engine` HTTP reaches the replicas through Serve's proxy, which carries no prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from core.config import require

PREFIX_ROUTER = "ray.serve.llm.request_router.PrefixCacheAffinityRouter"


@dataclass
class RoutingConfig:
    policy: Literal["power_of_two", "prefix_cache_affinity"] = "power_of_two"
    imbalanced_threshold: float = 8.0
    """prefix_cache_affinity: queue-length difference between replicas at which it balances load instead."""
    match_rate_threshold: float = 0.1
    """prefix_cache_affinity: the share of the prompt that must match a replica's history to follow it."""

    def __post_init__(self) -> None:
        require(self.policy in ("power_of_two", "prefix_cache_affinity"), "routing.policy",
                f"must be power_of_two or prefix_cache_affinity, got {self.policy!r}")
        require(self.imbalanced_threshold > 0, "routing.imbalanced_threshold",
                f"must be > 0, got {self.imbalanced_threshold}")
        require(0 <= self.match_rate_threshold <= 1, "routing.match_rate_threshold",
                f"must be in [0, 1], got {self.match_rate_threshold}")

    def to_serve(self) -> dict[str, Any]:
        """The engine deployment's `request_router_config` entry for Serve ({} = Serve's default router)."""
        if self.policy == "power_of_two":
            return {}
        return {"request_router_config": {
            "request_router_class": PREFIX_ROUTER,
            "request_router_kwargs": {"imbalanced_threshold": self.imbalanced_threshold,
                                      "match_rate_threshold": self.match_rate_threshold}}}
