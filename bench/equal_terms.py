"""Equal terms for the benchmarks: print what each side really ran with, and give a ratio only when both
sides agree on everything that must match (issue 17: "benchmarks compare equal work").

Shared by bench_serve.py, bench_data.py and bench_train.py; bench_batch_infer.py is welcome to use it. A
set-up is a flat dict of what one side ran with, read back from its running processes or engine where
possible (not the config passed in): executor class, processes, OMP/torch/tokenizer threads, niceness,
max_num_batched_tokens, stats logging, ... The whole API:

    print_setups({"rayline": ours, "vllm server": theirs})     # one table, a column per side
    print(ratio_line("vllm server", ratio, ours, theirs, MUST_MATCH))
        # "rayline vs vllm server: 1.02x", or, when a MUST_MATCH key differs or was not read back on a side,
        # "rayline vs vllm server: no ratio, set-ups differ: OMP_NUM_THREADS (rayline 1, vllm server 2)"
        # A key whose value is a placeholder (PLACEHOLDERS: "not logged", "unset", ...) counts as not read back,
        # on either side: two placeholders agree on nothing about what ran.
    process_tree(pid)       # processes, niceness and the thread env of a running process and its children
    before = thread_times(pid); ...; busy_threads(before, thread_times(pid))   # threads that computed meanwhile
    round_order(["a", "b"], rounds)   # A-B-B-A: every other round runs the sides in reverse order

A process that sets its title (vLLM's EngineCore and API server, every Ray worker) overwrites what /proc shows
of its environment; process_tree leaves such environments out, and busy_threads is the read-back of how many
threads really compute.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

OURS = "rayline"
# Environment that decides how many compute threads a process runs and how vLLM lays out its processes.
THREAD_ENV = ("OMP_NUM_THREADS", "RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM", "VLLM_ENABLE_V1_MULTIPROCESSING",
              "VLLM_CPU_OMP_THREADS_BIND")
# What a set-up shows where it could not read a value back. Two of them are not two equal values: a must-match
# key that holds one on either side refuses the ratio, as a missing key does.
PLACEHOLDERS = frozenset({"not logged", "unset", "not read back", "-", ""})


def placeholder(value: Any) -> bool:
    """Whether a set-up value says that nothing was read back: None, a PLACEHOLDERS string, or a sentence that
    starts so ("not logged (...)", "no EngineCore process found")."""
    if value is None:
        return True
    if not isinstance(value, str):
        return False
    text = value.strip().lower()
    return text in PLACEHOLDERS or text.startswith(("not logged", "not read back", "unset", "no "))


def differences(ours: dict[str, Any], theirs: dict[str, Any], must_match: Iterable[str], baseline: str) -> list[str]:
    """The `must_match` keys whose values differ between the two set-ups, or that a side lacks or holds only a
    placeholder for (a value that was not read back cannot be shown to be equal), each as
    `key (rayline X, baseline Y)`."""
    missing = object()
    out = []
    for key in must_match:
        a, b = ours.get(key, missing), theirs.get(key, missing)
        if a is missing or b is missing or placeholder(a) or placeholder(b) or a != b:
            shown = ["not read back" if v is missing else _text(v) for v in (a, b)]
            out.append(f"{key} ({OURS} {shown[0]}, {baseline} {shown[1]})")
    return out


def ratio_line(baseline: str, ratio: float, ours: dict[str, Any], theirs: dict[str, Any],
               must_match: Iterable[str]) -> str:
    """`rayline vs <baseline>: <ratio>x` when the set-ups agree on `must_match`; otherwise the same head
    followed by why no ratio is given, so a reader never takes unequal work for a figure."""
    unequal = differences(ours, theirs, must_match, baseline)
    if unequal:
        return f"{OURS} vs {baseline}: no ratio, set-ups differ: " + "; ".join(unequal)
    return f"{OURS} vs {baseline}: {ratio:.2f}x"


def print_setups(setups: dict[str, dict[str, Any]], title: str = "effective set-up") -> None:
    """Print the set-ups as one table: a row per key (in first-seen order), a column per side."""
    keys = list(dict.fromkeys(k for s in setups.values() for k in s))
    names = list(setups)
    width = max([len(k) for k in keys] + [len(title)])
    cols = [max([len(n)] + [len(_text(s.get(k, "-"))) for k in keys]) for n, s in setups.items()]
    print(f"{title:{width}}  " + "  ".join(f"{n:{w}}" for n, w in zip(names, cols)))
    for k in keys:
        print(f"{k:{width}}  " + "  ".join(f"{_text(setups[n].get(k, '-')):{w}}" for n, w in zip(names, cols)))


def process_tree(pid: int) -> dict[str, Any]:
    """Read back from a running process and all its descendants: how many there are, their niceness, their
    names, and THREAD_ENV as their environments hold it (a value all share, else the values as `a/b`). The
    THREAD_ENV keys are left out when no process's environment can be read (all retitled)."""
    import psutil

    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    out: dict[str, Any] = {"processes": len(procs), "niceness": one_value_or_all(p.nice() for p in procs),
                           "process names": ",".join(p.name() for p in procs)}
    envs = [e for e in map(_environ, procs) if e is not None]
    if envs:
        out.update({var: one_value_or_all(e.get(var, "unset") for e in envs) for var in THREAD_ENV})
    return out


def thread_times(pid: int) -> dict[tuple[int, int], float]:
    """CPU seconds so far of every thread of a process and its descendants, by (pid, thread id)."""
    import psutil

    root = psutil.Process(pid)
    out = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            out.update({(proc.pid, t.id): t.user_time + t.system_time for t in proc.threads()})
        except psutil.Error:
            continue
    return out


def busy_threads(before: dict[tuple[int, int], float], after: dict[tuple[int, int], float],
                 of_busiest: float = 1 / 3) -> int:
    """How many threads computed between two `thread_times` snapshots: those whose CPU time grew by at least
    `of_busiest` of the busiest thread's. Compute threads (torch/OpenMP, Rust) share the work about evenly,
    and the rest (I/O, heartbeats, queues) use a small part of it."""
    grown = [after[k] - before.get(k, 0.0) for k in after]
    top = max(grown, default=0.0)
    return sum(1 for g in grown if top > 0 and g >= of_busiest * top)


def own_niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)


def round_order(sides: Sequence[str], rounds: int) -> list[list[str]]:
    """The sides' order in each round: as given, then reversed, and so on (A-B, B-A: a drifting machine
    hits every side alike once the rounds are pooled)."""
    return [list(sides) if i % 2 == 0 else list(reversed(sides)) for i in range(rounds)]


def pooled_setup(runs: list[dict]) -> dict:
    """One set-up for all rounds of a side (each run a dict with a "setup" dict): a key that changed between
    rounds shows every value."""
    keys = dict.fromkeys(k for r in runs for k in r["setup"])
    out = {}
    for k in keys:
        values = list(dict.fromkeys(json.dumps(r["setup"].get(k)) for r in runs))
        out[k] = runs[0]["setup"].get(k) if len(values) == 1 else " / ".join(values)
    return out


def _environ(proc) -> dict[str, str] | None:
    """The process's environment as /proc shows it; None when it cannot be read, or when it is empty: what a
    process that set its title (setproctitle) leaves there, having used that memory for the title."""
    try:
        return proc.environ() or None
    except Exception:  # a process that has exited, or one we may not read
        return None


def one_value_or_all(values: Iterable[Any]) -> Any:
    """The one value all processes share, else the distinct values as `a/b`."""
    distinct = sorted(set(values), key=str)
    return distinct[0] if len(distinct) == 1 else "/".join(map(str, distinct)) or "not read back"


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
