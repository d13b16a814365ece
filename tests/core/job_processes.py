"""What a Ray job's worker processes used, read from outside the job: the check on core/usage.py's self-reported
figures. Every `interval_s` it lists the job's workers through Ray's state API and reads each one's CPU time
(its own, its live children's, those it waited for) with psutil; a worker that ended keeps its last reading. All of
the stack's nodes run on this machine, so every worker's /proc is readable here."""

from __future__ import annotations

import os
import threading

import psutil


def _cpu_s(pid: int) -> float | None:
    try:
        proc = psutil.Process(pid)
        total = 0.0
        for p in (proc, *proc.children(recursive=True)):
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        return total
    except psutil.Error:
        return None


class JobProcesses:
    """Samples the workers of the Ray job whose driver is process `driver_pid` until `stop()`."""

    def __init__(self, driver_pid: int, interval_s: float = 0.2):
        self.driver_pid, self.interval_s = driver_pid, interval_s
        self.job_id: str | None = None
        self.last: dict[int, float] = {}
        self.error: str | None = None  # the state API's last failure, for a test's message
        from core.ray_cluster import reload_auth_config

        reload_auth_config()  # the stack's token, even when nothing in this process has joined Ray yet
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        from ray.util.state import list_actors, list_jobs, list_tasks

        address = os.environ["RAY_ADDRESS"]
        while not self._stop.is_set():
            try:
                if self.job_id is None:
                    mine = [j.job_id for j in list_jobs(address=address, timeout=5)
                            if j.driver_info and str(j.driver_info.pid) == str(self.driver_pid)]
                    self.job_id = mine[0] if mine else None
                if self.job_id is not None:
                    # The job's workers: its live actors' processes and those running its tasks now (Ray's state
                    # API lists workers without their job).
                    job = [("job_id", "=", self.job_id)]
                    pids = {a.pid for a in list_actors(address=address, filters=[*job, ("state", "=", "ALIVE")],
                                                       limit=10_000, timeout=5, raise_on_missing_output=False)}
                    pids |= {t.worker_pid for t in list_tasks(address=address, filters=[*job, ("state", "=", "RUNNING")],
                                                              limit=10_000, timeout=5, raise_on_missing_output=False)}
                    for pid in pids - {0, None, self.driver_pid}:
                        if (cpu := _cpu_s(pid)) is not None:
                            self.last[pid] = cpu
            except Exception as e:  # the state API timed out under load: the next round reads again
                self.error = f"{type(e).__name__}: {e}"
            self._stop.wait(self.interval_s)

    def stop(self) -> float:
        """CPU seconds of all the job's worker processes seen."""
        self._stop.set()
        self._thread.join(timeout=30)
        return sum(self.last.values())

