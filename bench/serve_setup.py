"""What a running vLLM server computes with, read back for bench_serve.py: its EngineCore process (a vLLM
server's, or the one a Serve replica forked), the process tree, the engine settings vLLM logged,
and how HTTP reaches a Serve replica (HAProxy or Ray's proxy).

    python bench/serve_setup.py '{"name": {non-default args}}'   # prints SCHEDULER {...}: see resolve_scheduler
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script too

from bench.equal_terms import process_tree  # noqa: E402


def engine_core_pid(root_pid: int) -> int | None:
    """The EngineCore process under `root_pid`: the one titled VLLM::EngineCore, else the root's child that
    has computed most. An EngineCore forked from a Serve replica (serve/online/engine.py: fork on CPU) keeps the
    title the replica had when it forked (vLLM's setproctitle does nothing in a child of a Ray worker), and
    the replica may have other children (helpers Ray or Python start), which compute next to nothing."""
    import psutil

    root = psutil.Process(root_pid)
    for proc in root.children(recursive=True):
        try:
            if "VLLM::EngineCore" in " ".join(proc.cmdline()):
                return proc.pid
        except psutil.Error:
            continue
    children = []
    for proc in root.children():
        try:
            t = proc.cpu_times()
            children.append((t.user + t.system, proc.pid))
        except psutil.Error:
            continue
    return max(children)[1] if children else None


def title(proc) -> str:
    """A process's command line as one string ("" when it has exited or cannot be read)."""
    import psutil

    try:
        return " ".join(proc.cmdline()) if proc else ""
    except psutil.Error:
        return ""


def serve_ingress(replica: int) -> str:
    """How HTTP reaches the engine replica, read back: HAProxy in front of the replica's own HTTP server (Serve's
    HAProxy mode, core/ray_env.py) when a haproxy process runs on the replica's node, else Ray's
    Python proxy actor."""
    import psutil

    def raylet(proc):  # the node a process runs on: its raylet ancestor
        while proc is not None and proc.name() != "raylet":
            proc = proc.parent()
        return proc.pid if proc else None

    node = raylet(psutil.Process(replica))
    for proc in psutil.process_iter(["name"]):
        try:
            if proc.info["name"] == "haproxy" and raylet(proc) == node:
                return f"HAProxy (niceness {proc.nice()}) -> the replica's own HTTP server"
        except psutil.Error:
            continue
    return "Ray Serve's proxy actor -> the replica"


def engine_setup(root_pid: int, logs: list[Path]) -> dict:
    """A server's effective set-up, read back: its process tree under `root_pid` (the vLLM server, or the
    Serve replica that runs the engine) and what vLLM logged to `logs`. The engine is the tree's
    EngineCore process (engine_core_pid) and its children; the executor is `mp` when a VLLM::Worker process
    runs the model, else `uni` (the model runs in EngineCore)."""
    import psutil

    root = psutil.Process(root_pid)
    titles = {p.pid: " ".join(p.cmdline()) for p in [root, *root.children(recursive=True)]}
    core_pid = engine_core_pid(root_pid)
    core = psutil.Process(core_pid) if core_pid else None
    front = process_tree(root_pid)
    out: dict = {"processes (server tree)": front["processes"]}
    if core is None:
        out["engine processes"] = "no EngineCore process found"
    else:
        engine = process_tree(core.pid)
        out["executor"] = "mp" if any("VLLM::Worker" in titles.get(p.pid, "") for p in core.children(True)) else "uni"
        out["engine processes"] = engine["processes"]
        out["engine niceness"] = engine["niceness"]
        out["engine OS threads"] = sum(p.num_threads() for p in [core, *core.children(recursive=True)])
    out.update(logged_engine_config("".join(p.read_text(errors="replace") for p in logs)))
    return out


def resolve_scheduler(logs: dict[str, Path]) -> dict[str, dict]:
    """max_num_batched_tokens and max_num_seqs as vLLM resolves them from the args each API server logged
    (`non-default args: {...}`), for servers whose log lacks the first: vLLM's API server does not log it.
    One fresh process for all, with vLLM's EngineArgs and the OpenAI server's usage context."""
    import ast

    given = {}
    for name, path in logs.items():
        found = re.search(r"non-default args: (\{.*\})", path.read_text(errors="replace"))
        if found:
            # Values that are not literals (`lora_modules=[LoRAModulePath(...)]`) are left out: none is a
            # scheduler argument.
            logged = ast.parse(found.group(1), mode="eval").body
            given[name] = {}
            for key, value in zip(logged.keys, logged.values):
                try:
                    given[name][ast.literal_eval(key)] = ast.literal_eval(value)
                except ValueError:
                    continue
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), json.dumps(given)],
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SCHEDULER ")]
    return json.loads(lines[-1][len("SCHEDULER "):]) if lines else {}


def _resolve_scheduler_main(given: dict[str, dict]) -> None:
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    out = {}
    for name, kwargs in given.items():
        args = AsyncEngineArgs(**{k: v for k, v in kwargs.items() if k in fields})
        sched = args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER).scheduler_config
        out[name] = {"max_num_batched_tokens": sched.max_num_batched_tokens, "max_num_seqs": sched.max_num_seqs}
    print("SCHEDULER " + json.dumps(out), flush=True)


def logged_engine_config(log: str) -> dict:
    """The engine settings vLLM logs as it starts (its config line, the scheduler's token budget, the KV
    cache size) and whether it logs stats (its throughput lines once requests ran)."""
    out: dict = {}
    config = re.search(r"Initializing a V1 LLM engine .*? with config: (.*)", log)
    fields = dict(re.findall(r"(\w+)=([^,]*)", config.group(1))) if config else {}
    for key in ("dtype", "max_seq_len", "enable_prefix_caching", "enable_chunked_prefill", "enforce_eager"):
        out[key] = fields.get(key, "not logged")
    budget = re.findall(r"max_num_batched_tokens=(\d+)", log)
    out["max_num_batched_tokens"] = int(budget[-1]) if budget else "not logged"
    out["max_num_batched_tokens from"] = "engine log" if budget else "-"
    kv = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    out["KV cache tokens"] = int(kv[-1].replace(",", "")) if kv else "not logged"
    out["stats logging"] = "on" if "Avg prompt throughput" in log else "off (no throughput lines)"
    return out


if __name__ == "__main__":
    _resolve_scheduler_main(json.loads(sys.argv[1]))
