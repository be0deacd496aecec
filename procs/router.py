"""`batchserve router`: the gateway in front of the replicas (`--router smg`), as `batchserve serve`
and the `batchserve-router.service` unit start it.

It runs the Shepherd Model Gateway (`smg launch`, the `smg` package: `pip install -e '.[router]'`) on
`--port`, with every replica's api (`shared.parallel.replica_urls`) as its workers, `--router-policy`
as its policy and our `/health` as its health check. smg takes a replica whose `/health` fails out of
rotation and sends its requests to the others. `smg_args` is the one place its command line is built.

Readiness (sd_notify READY=1): once smg lists every replica as a healthy worker, or, when some do not
come, `REST_WAIT_S` after the first one is (the lines name those that are not yet): one broken replica
must not keep the router from serving with the others (under systemd its unit's start would time out,
be restarted, and finally given up: an outage although a replica serves).

Keys (procs/smg_launch.py): the clients' API keys are smg's tenant keys, for the serving routes only.
Its control plane (`/workers`: adding or removing a worker) and the key it presents to the replicas are
the internal key (`INTERNAL_KEY_ENV`), which `serve` and install-systemd give the router and the
replicas' apis alike and no client ever has; run by hand without one, the router makes its own for
this start. Every key reaches smg on its stdin, never on a command line.

SIGTERM/SIGINT is passed on to smg, which stops taking requests and lets running ones finish for
up to `drain_timeout_s`; `batchserve router` exits with smg's status (0 once asked to stop).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from batchserve.procs.api.auth import INTERNAL_KEY_ENV, internal_key, load_api_keys, new_internal_key
from batchserve.procs.launch import load_config
from batchserve.procs.runtime import die_with_parent
from batchserve.shared.commands import module_command
from batchserve.shared.config import ServerConfig, add_config_arguments
from batchserve.shared.logs import setup_logging
from batchserve.shared.parallel import check_parallel_config, local_url, replica_urls, router_metrics_port
from batchserve.shared.readiness import notify_ready, notify_stopping

# smg's checks of each replica's /health: a replica whose api is gone (or answers 503: a dead backend
# process, a drain) is out of rotation within about interval x failures.
HEALTH_CHECK_INTERVAL_S = 1
HEALTH_FAILURE_THRESHOLD = 2
HEALTH_CHECK_TIMEOUT_S = 5
# smg waits this long for the replicas at its start (they are ready before it starts: the unit's After=
# and `serve` order it so), polling every second rather than its default 30.
WORKER_STARTUP_TIMEOUT_S = 300
READY_POLL_S = 0.2
# Ready with some replicas healthy, this long after the first one is, when the others have not come (a
# replica that is up registers within a second or two; smg keeps trying the others).
REST_WAIT_S = 5.0
STOP_GRACE_S = 10.0  # after its drain, how long smg may take to exit before it is killed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="ServerConfig JSON (as written by `batchserve serve`); env and flags override it",
    )
    add_config_arguments(parser)


def check_router(config: ServerConfig) -> None:
    """ValueError (one line, before anything starts) when the configured router cannot run here."""
    if config.router == "smg" and importlib.util.find_spec("smg") is None:
        raise ValueError(
            "router smg: the smg package is not installed in this environment (pip install -e '.[router]')"
        )
    router_flags(config)


def router_flags(config: ServerConfig) -> list[str]:
    """`router_args`, split as a shell would (ValueError naming it when it does not split)."""
    try:
        return shlex.split(config.router_args)
    except ValueError as exc:
        raise ValueError(f"router_args {config.router_args!r}: {exc}") from None


# `smg launch`, taking its keys on stdin (procs/smg_launch.py), from this interpreter's environment.
SMG_LAUNCH = tuple(module_command("batchserve.procs.smg_launch"))


def smg_args(config: ServerConfig) -> list[str]:
    """`smg launch`'s flags for the gateway in front of the replicas."""
    return [
        "--host",
        config.host,
        "--port",
        str(config.port),
        "--worker-urls",
        *replica_urls(config),
        "--policy",
        config.router_policy,
        "--health-check-endpoint",
        "/health",
        "--health-check-interval-secs",
        str(HEALTH_CHECK_INTERVAL_S),
        "--health-failure-threshold",
        str(HEALTH_FAILURE_THRESHOLD),
        "--health-success-threshold",
        "1",
        "--health-check-timeout-secs",
        str(HEALTH_CHECK_TIMEOUT_S),
        "--worker-startup-timeout-secs",
        str(WORKER_STARTUP_TIMEOUT_S),
        "--worker-startup-check-interval",
        "1",
        "--shutdown-grace-period-secs",
        str(math.ceil(config.drain_timeout_s)),
        # its own metrics on the port after the last replica's, on our host only
        "--prometheus-host",
        config.host,
        "--prometheus-port",
        str(router_metrics_port(config)),
        # routing needs no tokenizer over HTTP; loading one would fetch the model's from the Hub
        "--disable-tokenizer-autoload",
        # its per-request lines and start-up chatter at info would double ours
        "--log-level",
        "warn",
        *(["--log-json"] if config.log_format == "json" else []),
        *router_flags(config),
    ]  # last: they override ours


def healthy_workers(base_url: str, api_key: str | None = None) -> set[str]:
    """The worker URLs smg lists as healthy (`GET /workers`, a control route: with the internal key); empty
    while it does not answer."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{base_url}/workers", headers=headers), timeout=2) as resp:
            listing = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return set()
    return {worker["url"] for worker in listing.get("workers", []) if worker.get("is_healthy")}


class Gateway:
    """smg as a child of this process (it dies with us), and its readiness."""

    def __init__(self, config: ServerConfig, keys: list[str], internal: str) -> None:
        self.config = config
        self.keys = keys  # the clients' API keys: smg's tenant keys
        self.internal = internal  # its control plane's key, which it presents to the replicas
        self.stopping = False  # asked to stop
        self.passed_on = False  # smg was told
        self.proc: subprocess.Popen[bytes] | None = None

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stopping = True
        self._pass_on()

    def _pass_on(self) -> None:
        """SIGTERM to smg, once: it drains (a second one would cut its drain short)."""
        if self.proc is not None and self.proc.poll() is None and not self.passed_on:
            self.passed_on = True
            self.proc.send_signal(signal.SIGTERM)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self._start_smg()
        self._wait_ready()
        status = self._wait()
        notify_stopping()
        return 0 if self.stopping and status in (0, -signal.SIGTERM) else status

    def _start_smg(self) -> None:
        """smg, its keys on its stdin (the internal key first); its environment without the internal key,
        which it has from there. NO_COLOR: plain log lines for a file or the journal."""
        parent = os.getpid()
        env = {name: value for name, value in os.environ.items() if name != INTERNAL_KEY_ENV}
        self.proc = subprocess.Popen(
            [*SMG_LAUNCH, *smg_args(self.config)],
            stdin=subprocess.PIPE,
            env=dict(env, NO_COLOR="1"),
            preexec_fn=lambda: die_with_parent(parent),
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write("".join(f"{key}\n" for key in (self.internal, *self.keys)).encode())
        self.proc.stdin.close()

    def _wait_ready(self) -> None:
        """READY=1 once smg routes to every replica, or `REST_WAIT_S` after it routes to the first (naming
        those it does not yet); nothing while none is healthy, or once asked to stop or smg ended."""
        assert self.proc is not None
        url, expected = local_url(self.config.host, self.config.port), set(replica_urls(self.config))
        first_healthy: float | None = None
        while self.proc.poll() is None and not self.stopping:
            healthy = expected & healthy_workers(url, self.internal)
            if healthy and first_healthy is None:
                first_healthy = time.monotonic()
            if healthy == expected or (  # (first_healthy is set once any is healthy)
                healthy and first_healthy is not None and time.monotonic() - first_healthy >= REST_WAIT_S
            ):
                self._say_ready(url, healthy, expected - healthy)
                notify_ready()
                return
            time.sleep(READY_POLL_S)

    def _say_ready(self, url: str, healthy: set[str], missing: set[str]) -> None:
        line = f"batchserve router: smg ({self.config.router_policy}) at {url} routes to {' '.join(sorted(healthy))}"
        if missing:
            line += (
                f"; not yet healthy: {' '.join(sorted(missing))} (smg keeps checking: it registers a replica "
                f"that answers within {WORKER_STARTUP_TIMEOUT_S}s of its start, and routes to it once healthy)"
            )
        print(line, file=sys.stderr, flush=True)

    def _wait(self) -> int:
        """smg's exit status; once asked to stop, it gets its drain and a grace, then it is killed."""
        assert self.proc is not None
        deadline: float | None = None
        while self.proc.poll() is None:
            if self.stopping and deadline is None:
                self._pass_on()  # asked before smg had started
                deadline = time.monotonic() + self.config.drain_timeout_s + STOP_GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                self.proc.kill()
            time.sleep(READY_POLL_S)
        return self.proc.returncode


def main(args: argparse.Namespace) -> int:
    config = load_config(args)
    setup_logging(config.log_format)
    check_parallel_config(config)
    if config.router == "none":
        raise ValueError("router is none: nothing to run (--router smg)")
    check_router(config)
    keys = [key.decode() for key in load_api_keys(config)]
    return Gateway(config, keys, gateway_key(keys)).run()


def gateway_key(keys: list[str]) -> str:
    """The internal key: the one `serve` or the units set (the replicas accept it too), else a fresh one for
    this start, so that smg's control plane is never open."""
    key = internal_key()
    if key is None:
        key = new_internal_key()
        if keys:  # smg presents it to the replicas, whose /v1/models would refuse it
            print(
                f"batchserve router: {INTERNAL_KEY_ENV} is not set: smg's control plane takes a key made for "
                f"this start, which the replicas do not know (give the router and the replicas' apis the same "
                f"{INTERNAL_KEY_ENV})",
                file=sys.stderr,
                flush=True,
            )
    return key
