"""`batchserve install-systemd`: write the systemd units and the env file for this virtualenv.

The unit templates live in `systemd/` next to the packages (a source checkout, installed with
`pip install -e .`); `@VENV@`, `@SOURCE@`, `@PROTECT_HOME@` and `@PRIVATE_TMP@` are filled in here, and
the units' names with those of this machine's layout (`Layout.names`; which units each layout runs,
one server's or replicas' and the router's, is `procs.systemd_layout`). With a router also
`internal-key.env` (0600, made once, kept on reinstall): the router's internal key, which
the router's unit and the replicas' api units read (EnvironmentFile=, read by systemd as root) and no
client is given (procs/router.py). The layout comes from the env file the units will read (when kept)
and the layout flags. The example env file `systemd/batchserve.env` is generated from `ServerConfig` by
`render_env_file()`, and a test keeps the two equal, so every setting is documented there.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import msgspec

from batchserve.procs.api.auth import INTERNAL_KEY_ENV, new_internal_key
from batchserve.procs.cli import CliError
from batchserve.procs.systemd_layout import (  # noqa: F401 (tests read the unit names here)
    ENV_DIR,
    INSTALLED_NAMES,
    INTERNAL_KEY_FILE_NAME,
    REPLICA_TARGET_TEMPLATE,
    REPLICA_TEMPLATES,
    ROUTER_UNIT,
    SERVER_PROCESSES,
    SERVER_UNITS,
    SINGLE_WORKER,
    TARGET,
    TEMPLATE_NAMES,
    WORKER_TEMPLATE,
    Layout,
    ReplicaUnits,
    machine_units,
    replica_target,
    replica_unit,
    worker_unit,
)
from batchserve.shared.config import (
    ServerConfig,
    add_config_arguments,
    config_from_args,
    env_var,
    field_default,
    field_description,
    flag_name,
)

SOURCE_DIR = Path(__file__).resolve().parents[1]
TEMPLATE_DIR = SOURCE_DIR / "systemd"
ENV_FILE_NAME = "batchserve.env"
UNIT_DIR = Path("etc/systemd/system")
SERVICE_USER = "batchserve"
# Written by installs before the worker became a template; it would run a second rank 0 next to
# batchserve-worker@0.service (both are part of batchserve.target).
FORMER_UNITS = ("batchserve-worker.service",)

# The settings that decide which units a machine runs; install-systemd takes them as flags too.
LAYOUT_FIELDS = ("tensor_parallel_size", "nnodes", "node_rank", "dist_init_addr", "data_parallel_size", "router")

# ProtectHome=yes hides these; code or a venv under them needs ProtectHome=read-only.
HOME_DIRS = (Path("/home"), Path("/root"), Path("/run/user"))
# PrivateTmp=yes gives each unit an empty /tmp; code under these needs PrivateTmp=no.
TMP_DIRS = (Path("/tmp"), Path("/var/tmp"))
_PLACEHOLDER = re.compile(r"@[A-Z_]+@")
_UNIT_UNSAFE = re.compile(r"[\s\"'%$\\]")  # would be split, expanded or unquoted in ExecStart=

# Settings the example env file sets instead of leaving at the default (journald reads JSON well).
ENV_FILE_OVERRIDES: dict[str, str] = {"log_format": "json"}

ENV_FILE_WIDTH = 100
ENV_FILE_HEADER = """\
# batchserve settings for the systemd units: /etc/batchserve/batchserve.env
# Read by every batchserve-*.service (EnvironmentFile=). Each line sets one ServerConfig field;
# a commented-out line shows the default. After an edit: systemctl restart batchserve.target
# (after changing tensor_parallel_size, nnodes, node_rank, data_parallel_size or router, first
# `batchserve install-systemd` again: it decides which worker ranks, replicas and other processes
# run on this machine).
#
# Set by the units themselves (override here if needed): BATCHSERVE_CACHE=/var/cache/batchserve
# (converted models, compiled kernels), HOME=/var/lib/batchserve.
# It may hold API keys: keep it 0640 root:batchserve. Read JSON logs with
# `journalctl -u 'batchserve-*' -o cat`.
"""


def _env_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def render_env_file(settings: dict[str, object] | None = None) -> str:
    """The example env file: every ServerConfig field, documented, with its default; `settings`
    (field -> value, e.g. the layout flags) are set rather than left at their defaults."""
    overrides = {**ENV_FILE_OVERRIDES, **{name: _env_value(value) for name, value in (settings or {}).items()}}
    parts = [ENV_FILE_HEADER]
    for field in msgspec.structs.fields(ServerConfig):
        doc = "\n".join(f"# {line}" for line in textwrap.wrap(field_description(field.name), ENV_FILE_WIDTH))
        default = _env_value(field_default(field))
        if field.name in overrides:
            line = f"{env_var(field.name)}={overrides[field.name]}"
            doc += f" (default: {default})"
        else:
            line = f"#{env_var(field.name)}={default}"
        parts.append(f"{doc}\n{line}\n")
    return "\n".join(parts)


def read_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """A unit file as {section: [(key, value), ...]}, repeated keys kept in order (DeviceAllow=)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
        elif "=" in line and current is not None:
            key, value = line.split("=", 1)
            current.append((key.strip(), value.strip()))
        else:
            raise ValueError(f"line {number}: not a [section] or key=value: {raw!r}")
    return sections


def unit_values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [value for k, value in unit.get(section, []) if k == key]


def read_env_file(text: str) -> dict[str, str]:
    """An EnvironmentFile= as systemd reads the simple KEY=VALUE lines this project writes."""
    env: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if line and line[0] not in "#;":
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def needs_home_access(*paths: Path) -> bool:
    return any(path.resolve().is_relative_to(home) for path in paths for home in HOME_DIRS)


def code_paths(venv: Path) -> list[Path]:
    """What the units execute or import: the venv, its interpreter (a venv's python is a symlink,
    e.g. into ~/.pyenv), and this source checkout (an editable install imports from it)."""
    paths = [venv, SOURCE_DIR]
    for name in ("python3", "python"):
        interpreter = venv / "bin" / name
        if interpreter.exists():
            paths.append(interpreter.resolve())
            break
    return paths


def protect_home_for(venv: Path) -> str:
    return "read-only" if needs_home_access(*code_paths(venv)) else "yes"


def needs_host_tmp(*paths: Path) -> bool:
    return any(path.resolve().is_relative_to(tmp) for path in paths for tmp in TMP_DIRS)


def private_tmp_for(venv: Path) -> str:
    """PrivateTmp=yes would hide code that lives under /tmp (a CI clone, a throwaway venv)."""
    return "no" if needs_host_tmp(*code_paths(venv)) else "yes"


def render_unit(
    template: str,
    venv: Path,
    source: Path = SOURCE_DIR,
    protect_home: str = "yes",
    private_tmp: str = "yes",
    units: Layout = SINGLE_WORKER,
) -> str:
    text = (
        template.replace("@VENV@", str(venv))
        .replace("@SOURCE@", str(source))
        .replace("@PROTECT_HOME@", protect_home)
        .replace("@PRIVATE_TMP@", private_tmp)
    )
    for placeholder, value in units.names.items():
        text = text.replace(placeholder, value)
    left = _PLACEHOLDER.search(text)
    if left:
        raise ValueError(f"unit template has an unknown placeholder {left.group()}")
    return text


@dataclass(frozen=True)
class PlannedFile:
    path: Path
    text: str
    mode: int
    keep_existing: bool  # an existing file is left alone (the env file, without --force)
    secret: bool = False  # never printed, kept even with --force (a new key needs every unit restarted)


def render_internal_key_file() -> str:
    """The router's internal key file: a fresh key (`INTERNAL_KEY_ENV`) for the router's and the replicas'
    api units."""
    return (
        "# The router's internal key: smg's control-plane key and the key it presents to the replicas'\n"
        "# apis. Made by `batchserve install-systemd`; no client is given it. Read by\n"
        "# batchserve-router.service and batchserve-api@.service. For a new one: delete this file, run\n"
        "# install-systemd again, restart batchserve.target.\n"
        f"{INTERNAL_KEY_ENV}={new_internal_key()}\n"
    )


def machine_config(prefix: Path, layout: dict[str, object], force: bool = False) -> ServerConfig:
    """The configuration the installed units will run with: the env file under `prefix` (unless
    --force replaces it), with the layout flags in `layout`. A kept env file that disagrees with a
    flag is an error: the units read the file, so they would run another layout than installed."""
    env_path = prefix / ENV_DIR / ENV_FILE_NAME
    kept = env_path.is_file() and not force
    try:
        from_file = config_from_args(argparse.Namespace(), env=read_env_file(env_path.read_text()) if kept else {})
    except ValueError as exc:
        raise CliError(f"{env_path}: {exc}") from None
    conflicts = [
        f"{env_var(name)}={_env_value(getattr(from_file, name))} there, {flag_name(name)} {value}"
        for name, value in layout.items()
        if kept and getattr(from_file, name) != value
    ]
    if conflicts:
        raise CliError(
            f"{env_path} is kept and disagrees with the flags ({'; '.join(conflicts)}): "
            "edit it, or --force to replace it"
        )
    return msgspec.structs.replace(from_file, **layout)


def plan_files(
    prefix: Path, venv: Path, force: bool = False, layout: dict[str, object] | None = None
) -> list[PlannedFile]:
    """Every file install-systemd writes, rendered for `venv` and this machine's layout (the env file
    under `prefix` and the `layout` flags, field -> value), under `prefix`."""
    if not TEMPLATE_DIR.is_dir():
        raise CliError(
            f"unit templates not found in {TEMPLATE_DIR}: install batchserve from a source checkout (pip install -e .)"
        )
    layout = layout or {}
    units = machine_units(machine_config(prefix, layout, force))
    protect_home = protect_home_for(venv)
    private_tmp = private_tmp_for(venv)
    files = [
        PlannedFile(
            prefix / UNIT_DIR / name,
            render_unit((TEMPLATE_DIR / template).read_text(), venv, SOURCE_DIR, protect_home, private_tmp, units),
            0o644,
            keep_existing=False,
        )
        for name, template in units.templates.items()
    ]
    files.append(PlannedFile(prefix / ENV_DIR / ENV_FILE_NAME, render_env_file(layout), 0o644, keep_existing=not force))
    if isinstance(units, ReplicaUnits) and units.router:
        files.append(
            PlannedFile(
                prefix / ENV_DIR / INTERNAL_KEY_FILE_NAME,
                render_internal_key_file(),
                0o600,
                keep_existing=True,
                secret=True,
            )
        )
    return files


def write_file(planned: PlannedFile) -> None:
    """Write `planned` with its mode from the start (a key file must never be readable by others, not even
    for a moment)."""
    fd = os.open(planned.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, planned.mode)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), planned.mode)  # a replaced file keeps its old mode through open()
        f.write(planned.text)


def stale_units(prefix: Path, units: Layout) -> list[Path]:
    """Unit files of an earlier install that this machine no longer runs: the former worker unit, the
    server's units on a machine that now has node_rank > 0, one layout's units after a switch to the
    other (replicas or not), the router's once there is none."""
    names = [*FORMER_UNITS, *(name for name in INSTALLED_NAMES if name not in units.templates)]
    return [path for path in (prefix / UNIT_DIR / name for name in names) if path.exists()]


def stop_hint(unit: Path) -> str:
    """How to stop what still runs of a removed unit file: a template's instances by a quoted glob
    (`systemctl stop batchserve-api@.service` would stop none of them)."""
    name = unit.name
    if "@." in name:
        name = f"'{name.replace('@.', '@*.')}'"
    return f"systemctl stop {name}"


def check_router_in_venv(config: ServerConfig, venv: Path) -> None:
    """The router's unit runs `batchserve router` from `venv`: smg must be installed there."""
    if config.router == "smg" and not (venv / "bin" / "smg").is_file():
        raise CliError(
            f"router smg: smg is not installed in {venv} (install batchserve with its router extra: "
            f"{venv}/bin/pip install -e '.[router]' in the checkout)"
        )


def next_steps(prefix: Path) -> str:
    root = "" if prefix == Path("/") else f"  # (files written under {prefix}; copy them to / first)\n"
    return (
        f"Next, as root:\n{root}"
        "  getent group render >/dev/null || groupadd --system render\n"
        f"  id -u {SERVICE_USER} >/dev/null 2>&1 || useradd --system --user-group "
        f"--home-dir /var/lib/{SERVICE_USER} --shell /usr/sbin/nologin {SERVICE_USER}\n"
        "  systemctl daemon-reload && systemctl enable --now batchserve.target\n"
        "Then: systemctl status 'batchserve-*'   journalctl -u 'batchserve-*' -f\n"
    )


DESCRIPTION_EPILOG = """\
Tensor parallelism: the worker unit is a template, batchserve-worker@.service, and batchserve.target
starts one instance per local rank (batchserve-worker@0.service .. @N-1, N = tensor_parallel_size /
nnodes). Replicas (data_parallel_size N > 1, or a router): every process's unit is a template whose
instance I is replica I's (batchserve-api@I.service, ...), batchserve.target starts batchserve@0.target
.. @N-1 (each a replica's five units) and, with a router, batchserve-router.service. The layout is what
PREFIX/etc/batchserve/batchserve.env says when that file is kept (the layout flags must then agree with
it), else the flags, which are written into the new env file. On the machine of node_rank 0 the target
also starts scheduler, tokenizer, detokenizer and api; on a machine with node_rank > 0 only its worker
ranks are installed (they join global rank 0 at dist_init_addr, required then). Run install-systemd
again after changing the layout, then `systemctl daemon-reload && systemctl restart batchserve.target`.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = DESCRIPTION_EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--prefix",
        type=Path,
        default=Path("/"),
        help="root to install under (default: /): units in PREFIX/etc/systemd/system, "
        "settings in PREFIX/etc/batchserve/batchserve.env",
    )
    parser.add_argument(
        "--venv",
        type=Path,
        default=Path(sys.prefix),
        help="virtualenv whose bin/batchserve the units run (default: this one, %(default)s)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print what would be written, write nothing")
    parser.add_argument("--force", action="store_true", help="overwrite an existing batchserve.env")
    add_config_arguments(
        parser.add_argument_group("layout (tensor and data parallelism, router; default: as batchserve.env says)"),
        only=LAYOUT_FIELDS,
    )


def main(args: argparse.Namespace) -> int:
    venv = Path(args.venv).absolute()
    if _UNIT_UNSAFE.search(str(venv)):
        raise CliError(
            f"{venv}: a venv path with spaces, quotes, '%', '$' or '\\' would need escaping in "
            "ExecStart=; use a plain path (e.g. /opt/batchserve/venv)"
        )
    executable = venv / "bin" / "batchserve"
    if not executable.is_file():
        raise CliError(f"{executable} does not exist: --venv must be a virtualenv with batchserve installed")
    prefix = Path(args.prefix).absolute()
    layout = {name: getattr(args, name) for name in LAYOUT_FIELDS if getattr(args, name, None) is not None}
    config = machine_config(prefix, layout, force=args.force)
    check_router_in_venv(config, venv)
    units = machine_units(config)
    for stale in stale_units(prefix, units):
        if args.dry_run:
            print(f"--- would remove {stale} (not run on this machine any more)")
            continue
        try:
            stale.unlink()
        except PermissionError as exc:
            raise CliError(f"cannot remove {stale} ({exc.strerror}): run as root, or use --prefix") from None
        print(f"remove   {stale} (not run on this machine any more; `{stop_hint(stale)}` if it runs)")
    for planned in plan_files(prefix, venv, force=args.force, layout=layout):
        exists = planned.path.exists()
        if planned.keep_existing and exists:
            why = "the router's key; delete it for a new one" if planned.secret else "--force replaces it"
            print(f"keep     {planned.path} (exists; {why})")
            continue
        verb = "replace" if exists else "write"
        if args.dry_run:
            text = "(a new key, not shown)\n" if planned.secret else planned.text
            print(f"--- would {verb} {planned.path} (mode {planned.mode:o})\n{text}")
            continue
        try:
            planned.path.parent.mkdir(parents=True, exist_ok=True)
            write_file(planned)
        except PermissionError as exc:
            raise CliError(f"cannot write {planned.path} ({exc.strerror}): run as root, or use --prefix") from None
        print(f"{verb:<8} {planned.path}")
    under_home = [str(path) for path in code_paths(venv) if needs_home_access(path)]
    if under_home:
        print(
            f"note: {', '.join(under_home)} under a home directory: the units use ProtectHome=read-only, "
            f"and the {SERVICE_USER} user needs read access there (better: a venv outside /home and /root)",
            file=sys.stderr,
        )
    under_tmp = [str(path) for path in code_paths(venv) if needs_host_tmp(path)]
    if under_tmp:
        print(
            f"note: {', '.join(under_tmp)} under /tmp: the units use PrivateTmp=no so they can see it "
            "(better: a venv and checkout outside /tmp, e.g. /opt/batchserve)",
            file=sys.stderr,
        )
    print(units.describe(config) + next_steps(prefix))
    return 0
