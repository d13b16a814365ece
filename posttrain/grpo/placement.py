"""Where the rollout engines and the policy's ranks run: one placement group per run, in one of two layouts.

`colocated`: one bundle holding every role's CPUs, packed on one node; the roles take turns (rollout, score, train,
sync), which is what a 2-core machine allows and what verl calls a hybrid engine. `separate`: a bundle per engine
and per rank, spread, so generation and training have resources of their own (the ratio between them is the config's
num_engines x engine.cpus_per_engine against policy.num_workers x policy.cpus_per_worker).
"""

from __future__ import annotations

from typing import Any


def role_placements(placement: str, engine_cpus: float, num_engines: int, policy_cpus: float, num_workers: int
                    ) -> tuple[Any, list[dict[str, Any]], list[dict[str, Any]]]:
    """Reserve the placement group and return it with each engine's and each rank's scheduling options."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if placement == "colocated":
        total = engine_cpus * num_engines + policy_cpus * num_workers
        pg = placement_group([{"CPU": total}], strategy="STRICT_PACK")
        index = [0] * (num_engines + num_workers)
    elif placement == "separate":
        pg = placement_group([{"CPU": engine_cpus}] * num_engines + [{"CPU": policy_cpus}] * num_workers,
                             strategy="SPREAD")
        index = list(range(num_engines + num_workers))
    else:
        raise ValueError(f"placement: {placement!r} is not one of ['colocated', 'separate']")
    ray.get(pg.ready(), timeout=300)
    options = [{"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)}
               for i in index]
    return pg, options[:num_engines], options[num_engines:]
