"""`batchserve install-systemd`: write the systemd units and the env file for this virtualenv.

The unit templates live in `systemd/` next to the packages (a source checkout, installed with
`pip install -e .`); `@VENV@`, `@SOURCE@` and `@PROTECT_HOME@` are filled in here. The example env
file `systemd/batchserve.env` is generated from `ServerConfig` by `render_env_file()`, and a test
keeps the two equal, so every setting is documented there.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import msgspec

from procs.cli import CliError
from procs.launch import START_ORDER
from shared.config import ServerConfig, env_var, field_default, field_description

SOURCE_DIR = Path(__file__).resolve().parents[1]
TEMPLATE_DIR = SOURCE_DIR / "systemd"
ENV_FILE_NAME = "batchserve.env"
UNIT_DIR = Path("etc/systemd/system")
ENV_DIR = Path("etc/batchserve")
SERVICE_USER = "batchserve"

# In start order; systemd stops them in the reverse order (api first, worker last).
UNIT_NAMES = ("batchserve.target", *(f"batchserve-{name}.service" for name in START_ORDER))

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


def render_env_file() -> str:
    """The example env file: every ServerConfig field, documented, with its default."""
    parts = [ENV_FILE_HEADER]
    for field in msgspec.structs.fields(ServerConfig):
        doc = "\n".join(f"# {line}" for line in textwrap.wrap(field_description(field.name), ENV_FILE_WIDTH))
        default = _env_value(field_default(field))
        if field.name in ENV_FILE_OVERRIDES:
            line = f"{env_var(field.name)}={ENV_FILE_OVERRIDES[field.name]}"
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


def render_unit(template: str, venv: Path, source: Path = SOURCE_DIR, protect_home: str = "yes",
                private_tmp: str = "yes") -> str:
    text = (template.replace("@VENV@", str(venv)).replace("@SOURCE@", str(source))
            .replace("@PROTECT_HOME@", protect_home).replace("@PRIVATE_TMP@", private_tmp))
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


def plan_files(prefix: Path, venv: Path, force: bool = False) -> list[PlannedFile]:
    """Every file install-systemd writes, rendered for `venv`, under `prefix`."""
    if not TEMPLATE_DIR.is_dir():
        raise CliError(f"unit templates not found in {TEMPLATE_DIR}: install batchserve from a source "
                       "checkout (pip install -e .)")
    protect_home = protect_home_for(venv)
    private_tmp = private_tmp_for(venv)
    files = [PlannedFile(prefix / UNIT_DIR / name,
                         render_unit((TEMPLATE_DIR / name).read_text(), venv, SOURCE_DIR, protect_home, private_tmp),
                         0o644, keep_existing=False)
             for name in UNIT_NAMES]
    files.append(PlannedFile(prefix / ENV_DIR / ENV_FILE_NAME, render_env_file(), 0o644, keep_existing=not force))
    return files


def next_steps(prefix: Path) -> str:
    root = "" if prefix == Path("/") else f"  # (files written under {prefix}; copy them to / first)\n"
    return (f"Next, as root:\n{root}"
            "  getent group render >/dev/null || groupadd --system render\n"
            f"  id -u {SERVICE_USER} >/dev/null 2>&1 || useradd --system --user-group "
            f"--home-dir /var/lib/{SERVICE_USER} --shell /usr/sbin/nologin {SERVICE_USER}\n"
            "  systemctl daemon-reload && systemctl enable --now batchserve.target\n"
            "Then: systemctl status 'batchserve-*'   journalctl -u 'batchserve-*' -f\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix", type=Path, default=Path("/"),
                        help="root to install under (default: /): units in PREFIX/etc/systemd/system, "
                             "settings in PREFIX/etc/batchserve/batchserve.env")
    parser.add_argument("--venv", type=Path, default=Path(sys.prefix),
                        help="virtualenv whose bin/batchserve the units run (default: this one, %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="print what would be written, write nothing")
    parser.add_argument("--force", action="store_true", help="overwrite an existing batchserve.env")


def main(args: argparse.Namespace) -> int:
    venv = Path(args.venv).absolute()
    if _UNIT_UNSAFE.search(str(venv)):
        raise CliError(f"{venv}: a venv path with spaces, quotes, '%', '$' or '\\' would need escaping in "
                       "ExecStart=; use a plain path (e.g. /opt/batchserve/venv)")
    executable = venv / "bin" / "batchserve"
    if not executable.is_file():
        raise CliError(f"{executable} does not exist: --venv must be a virtualenv with batchserve installed")
    prefix = Path(args.prefix).absolute()
    for planned in plan_files(prefix, venv, force=args.force):
        exists = planned.path.exists()
        if planned.keep_existing and exists:
            print(f"keep     {planned.path} (exists; --force replaces it)")
            continue
        verb = "replace" if exists else "write"
        if args.dry_run:
            print(f"--- would {verb} {planned.path} (mode {planned.mode:o})\n{planned.text}")
            continue
        try:
            planned.path.parent.mkdir(parents=True, exist_ok=True)
            planned.path.write_text(planned.text)
            planned.path.chmod(planned.mode)
        except PermissionError as exc:
            raise CliError(f"cannot write {planned.path} ({exc.strerror}): run as root, or use --prefix") from None
        print(f"{verb:<8} {planned.path}")
    under_home = [str(path) for path in code_paths(venv) if needs_home_access(path)]
    if under_home:
        print(f"note: {', '.join(under_home)} under a home directory: the units use ProtectHome=read-only, "
              f"and the {SERVICE_USER} user needs read access there (better: a venv outside /home and /root)",
              file=sys.stderr)
    under_tmp = [str(path) for path in code_paths(venv) if needs_host_tmp(path)]
    if under_tmp:
        print(f"note: {', '.join(under_tmp)} under /tmp: the units use PrivateTmp=no so they can see it "
              "(better: a venv and checkout outside /tmp, e.g. /opt/batchserve)", file=sys.stderr)
    print(next_steps(prefix))
    return 0
