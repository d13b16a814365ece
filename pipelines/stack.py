"""The embedded local platform's command line (the platform itself is stack/lifecycle.py):

    python -m pipelines.stack up [--s3] [--nodes N] [key=value ...]
                                                          start what is not running, wait for health
    python -m pipelines.stack status                      one line per part
    python -m pipelines.stack env                         exports for a shell or a job (eval "$(...)")
    python -m pipelines.stack down                        stop what `up` started, by PID; data is kept
"""

from __future__ import annotations

import argparse
import sys

from stack.lifecycle import down, env_vars, load_stack_config, status, up, urls



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="rayline's embedded local platform (Ray head, MLflow, Prometheus, Swift S3)")
    p.add_argument("command", choices=["up", "down", "status", "env"])
    p.add_argument("--s3", action="store_true", help="also run the Swift S3-compatible object store")
    p.add_argument("--state-dir", default=None, help="state directory (default .rayline)")
    p.add_argument("--nodes", type=int, default=None, metavar="N",
                   help="also run N Ray worker nodes on this machine (a multi-node cluster; node_cpus=K each)")
    p.add_argument("overrides", nargs="*", help="StackConfig key=value, e.g. mlflow_port=5001")
    args = p.parse_args(argv)
    overrides = args.overrides + ([f"nodes={args.nodes}"] if args.nodes is not None else [])
    cfg = load_stack_config(args.state_dir, overrides, args.s3 or None)
    if args.command == "up":
        try:
            result = up(cfg)
        except RuntimeError as e:
            print(f"stack up failed: {e}", file=sys.stderr)
            return 1
        print(f"stack up ({', '.join(result['started']) or 'already running'}); state in {result['state_dir']}")
        for note in result["notes"]:
            print(f"  note: {note}")
        for name, url in urls(cfg).items():
            print(f"  {name:16} {url}")
        print(f"  shell setup      eval \"$(python -m pipelines.stack env --state-dir {cfg.state_dir})\"")
    elif args.command == "down":
        stopped = down(cfg)
        print(f"stopped: {', '.join(stopped) or 'nothing was running'} (data kept in {cfg.state})")
    elif args.command == "status":
        ok = True
        for part, st in status(cfg).items():
            ok &= st["healthy"]
            pids = ", ".join(f"{n}={p}" for n, p in st["pids"].items()) or "-"
            print(f"{part:8} {'healthy' if st['healthy'] else 'DOWN':8} pids: {pids}")
        return 0 if ok else 1
    else:
        for k, v in env_vars(cfg).items():
            print(f"export {k}={v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
