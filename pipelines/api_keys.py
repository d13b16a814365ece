"""Add or rotate an API key of the OpenAI endpoint (the key file's format: core/api_keys.py).

    python -m pipelines.api_keys add --keys-file F --id ID [--role admin] [--rpm N] [--max-concurrent M]
        prints a new key once, and adds its hash to F (an entry with the same id is replaced: a rotation)
"""

from __future__ import annotations

import argparse

from core.api_keys import ROLES, ApiKey, add_key, new_key


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Add (or rotate) an API key of the OpenAI endpoint in a keys file")
    p.add_argument("command", choices=["add"])
    p.add_argument("--keys-file", required=True, help="the keys file (JSON of hashes), created when absent")
    p.add_argument("--id", required=True, help="the key's name in logs and metrics; an entry with it is replaced")
    p.add_argument("--role", choices=ROLES, default="client")
    p.add_argument("--rpm", type=int, default=600, help="requests per minute (per replica)")
    p.add_argument("--max-concurrent", type=int, default=64, help="requests in flight at once (per replica)")
    args = p.parse_args(argv)
    key = new_key()
    entry = ApiKey.of(args.id, key, args.role, requests_per_minute=args.rpm, max_concurrent=args.max_concurrent)
    add_key(args.keys_file, entry)
    print(key)  # the only time it is shown: give it to the client; the file holds its hash
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
