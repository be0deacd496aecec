"""`smg launch` with the server's API keys read from stdin, one per line, rather than from its command
line, where every user of the machine could read them (`ps`). `batchserve router` runs it in smg's place.

The first key becomes smg's `--api-key`: it gates the gateway's serving and control paths, and smg
sends it to the replicas (whose `/v1/*` need a key too); the others are tenant keys smg accepts from
clients as well. No key on stdin: smg runs as `smg launch` would with the same flags.
"""

from __future__ import annotations

import sys

from smg.launch_router import launch_router, parse_router_args


def main(argv: list[str]) -> None:
    args = parse_router_args(argv)
    keys = [line.strip() for line in sys.stdin if line.strip()]
    if keys:
        args.api_key = keys[0]
        args.tenant_api_keys = [(f"key{i}", key) for i, key in enumerate(keys[1:], 2)]  # (tenant id, key)
    launch_router(args)


if __name__ == "__main__":
    main(sys.argv[1:])
