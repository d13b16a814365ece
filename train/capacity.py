"""How many training runs of one shape fit on the cluster, with the arithmetic spelled out for messages.

A run needs `num_workers x resources_per_worker`, and `data_cpus` CPUs must stay free for Ray Data's
ingest tasks (the Train controller and the split coordinator ask for 0 CPUs, a Tune trial's driver
for `TRIAL_DRIVER_CPUS`). The train stage checks that one run fits; the tune stage sizes
`max_concurrent_trials` with the same sum and refuses a search that cannot run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

TRIAL_DRIVER_CPUS = 0.01
"""CPU a Tune trial's driver process holds: it only waits on the trainer, but Tune needs a non-empty bundle."""


def _g(x: float) -> str:
    return f"{x:g}"


@dataclass
class Fit:
    resource: str
    num_workers: int
    per_worker: float
    have: float
    reserved: float
    per_run_extra: float = 0.0

    @property
    def per_run(self) -> float:
        return self.num_workers * self.per_worker + self.per_run_extra

    @property
    def usable(self) -> float:
        return self.have - self.reserved

    @property
    def runs(self) -> int:
        """Concurrent runs that fit (0 = not even one)."""
        return max(0, math.floor(self.usable / self.per_run + 1e-9)) if self.per_run > 0 else 10**6

    def explain(self, runs: int | None = None) -> str:
        """`runs` runs (default: the most that fit) x workers x resources against what the cluster has."""
        n = self.runs if runs is None else runs
        r = self.resource
        extra = f" + {_g(self.per_run_extra)} {r} trial driver" if self.per_run_extra else ""
        keep = f" - {_g(self.reserved)} kept for Ray Data ingest (scaling.data_cpus)" if self.reserved else ""
        verdict = "fits" if n * self.per_run <= self.usable + 1e-9 else "does not fit"
        return (f"{n} run(s) x ({self.num_workers} workers x {_g(self.per_worker)} {r}{extra}) = "
                f"{_g(n * self.per_run)} {r} needed; cluster has {_g(self.have)} {r}{keep} = {_g(self.usable)} {r} "
                f"usable: {verdict}")


def runs_that_fit(cluster: dict[str, float], num_workers: int, per_worker: dict[str, float], data_cpus: float,
                  per_run_cpus: float = 0.0) -> Fit:
    """The tightest resource: how many runs of `num_workers x per_worker` (+ `per_run_cpus`) fit in `cluster`."""
    fits = []
    for resource, need in sorted(per_worker.items()):
        if need <= 0 and not (resource == "CPU" and per_run_cpus):
            continue
        cpu = resource == "CPU"
        fits.append(Fit(resource, num_workers, need, float(cluster.get(resource, 0.0)),
                        data_cpus if cpu else 0.0, per_run_cpus if cpu else 0.0))
    if not fits:
        return Fit("CPU", num_workers, 0.0, float(cluster.get("CPU", 0.0)), data_cpus)
    return min(fits, key=lambda f: f.runs)
