"""`smg launch` with its keys read from stdin, one per line, rather than from its command line, where
every user of the machine could read them (`ps`). `batchserve router` runs it in smg's place.

The first line is the router's internal key, the others the clients' API keys (possibly none). What
smg does with each kind of key (model_gateway/src/server.rs and middleware/auth.rs in smg's source; the tests check it
against the pinned smg through a running gateway):

- `--api-key`: the key smg presents to its workers (registration probes such as `/v1/models`, and any
  request that comes without an Authorization header; a client's own header is passed through), a key
  its serving routes accept, and, unless control-plane keys are configured, the one key of its control
  plane (`/workers`, `/flush_cache`, `/v1/tokenizers`, ...).
- `--tenant-api-key`: serving routes only; refused on the control plane.
- `--control-plane-api-keys` (id, name, key, role): the control plane's keys (admin role), replacing
  `--api-key` there; serving routes do not accept them.

So every client key becomes a tenant key, and the internal key, which no client has, is smg's
control-plane key and, with client keys, its `--api-key` (the replicas accept it: procs/api/auth.py).
Without client keys the serving routes stay open, as the replicas are, and smg presents no key.
"""

from __future__ import annotations

import sys

from smg.launch_router import launch_router, parse_router_args  # type: ignore[import-untyped]  # smg ships no py.typed
from smg.router_args import RouterArgs  # type: ignore[import-untyped]  # smg ships no py.typed

CONTROL_KEY_ID = "batchserve-router"


def apply_keys(args: RouterArgs, internal: str, client_keys: list[str]) -> None:
    """Give smg the internal key as its control plane's key (and its workers' key), and every client key
    as a tenant key of the serving routes alone. Keys given in `router_args` are kept beside ours."""
    # (id, name, key, role)
    args.control_plane_api_keys = [
        *args.control_plane_api_keys,
        (CONTROL_KEY_ID, "batchserve router", internal, "admin"),
    ]
    if client_keys:
        args.api_key = internal
        # one tenant per key (smg refuses a key given twice), key1.. in the configured order
        args.tenant_api_keys = [
            *args.tenant_api_keys,
            *((f"key{i}", key) for i, key in enumerate(dict.fromkeys(client_keys), 1)),
        ]


def main(argv: list[str]) -> None:
    args = parse_router_args(argv)
    lines = [line.strip() for line in sys.stdin if line.strip()]
    if not lines:
        raise SystemExit("batchserve.procs.smg_launch: expected the router's internal key on stdin")
    apply_keys(args, lines[0], lines[1:])
    launch_router(args)


if __name__ == "__main__":
    main(sys.argv[1:])
