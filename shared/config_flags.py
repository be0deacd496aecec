"""A settings struct's fields outside the code: each field of a `msgspec.Struct` one command-line flag
(`--page-size`) and one environment variable (`BATCHSERVE_PAGE_SIZE`), read with a flag given on the
command line winning over the environment, which wins over the default; each field's help its
`msgspec.Meta` description, which `--help`, the systemd env file and the docs' settings table show.

The mechanism only, for any such struct: which settings there are, and their help, is `ServerConfig`
(`shared.config`, whose `add_config_arguments`, `config_from_args` and `config_table_markdown` apply
this module to it).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any, TypeVar, get_type_hints

import msgspec

ENV_PREFIX = "BATCHSERVE_"
Settings = TypeVar("Settings", bound=msgspec.Struct)


def flag_name(name: str) -> str:
    """The command-line flag of the field `name`."""
    return "--" + name.replace("_", "-")


def env_var(field_name: str) -> str:
    """The environment variable of the field `field_name`."""
    return f"{ENV_PREFIX}{field_name.upper()}"


def field_default(field: msgspec.structs.FieldInfo) -> Any:
    return field.default_factory() if field.default is msgspec.NODEFAULT else field.default


def field_descriptions(struct: type[msgspec.Struct]) -> dict[str, str]:
    """Each field's help text (its `msgspec.Meta` description), by name; TypeError for a field without one."""
    found = {}
    for name, hint in get_type_hints(struct, include_extras=True).items():
        metas = [
            m.description for m in getattr(hint, "__metadata__", ()) if isinstance(m, msgspec.Meta) and m.description
        ]
        if not metas:
            raise TypeError(f"{struct.__name__}.{name} has no help text: declare it Annotated[type, _doc(...)]")
        found[name] = metas[0]
    return found


def add_struct_arguments(
    parser: argparse._ActionsContainer,
    struct: type[msgspec.Struct],
    descriptions: Mapping[str, str],
    aliases: Mapping[str, tuple[str, ...]],
    only: tuple[str, ...] | None = None,
) -> None:
    """Add one flag per field of `struct` (or per field in `only`), with its `aliases` too; defaults stay
    unset. A boolean field's flag has its --no- form; a list field's is repeatable."""
    for field in msgspec.structs.fields(struct):
        if only is not None and field.name not in only:
            continue
        default = field_default(field)
        help_text = f"{descriptions[field.name].replace('%', '%%')} (default: {default!r}; env {env_var(field.name)})"
        flags = (flag_name(field.name), *aliases.get(field.name, ()))
        if isinstance(default, bool):
            parser.add_argument(
                *flags, dest=field.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif isinstance(default, list):
            parser.add_argument(
                *flags,
                dest=field.name,
                action="extend",
                nargs="+",
                default=None,
                help=f"one or more values, repeatable: {help_text}, comma-separated",
            )
        else:
            parser.add_argument(*flags, dest=field.name, type=type(default), default=None, help=help_text)


def settings_table(struct: type[msgspec.Struct], descriptions: Mapping[str, str]) -> str:
    """A markdown table of `struct`'s fields: each one's flag, environment variable, default and help."""
    rows = ["| flag | environment | default | what |", "|---|---|---|---|"]
    for field in msgspec.structs.fields(struct):
        default = field_default(field)
        shown = (
            ",".join(map(str, default))
            if isinstance(default, list)
            else str(default).lower()
            if isinstance(default, bool)
            else str(default)
        )
        what = descriptions[field.name].replace("|", "\\|")
        rows.append(f"| `{flag_name(field.name)}` | `{env_var(field.name)}` | `{shown}` | {what} |")
    return "\n".join(rows) + "\n"


def struct_from_args(
    struct: type[Settings], args: argparse.Namespace, env: Mapping[str, str], overrides: Mapping[str, Any]
) -> Settings:
    """Defaults < `env` (the fields' variables) < `args` (flags given) < `overrides`. Bad values raise
    ValueError."""
    values: dict[str, Any] = {}
    for field in msgspec.structs.fields(struct):
        raw = env.get(env_var(field.name))
        if raw is not None and raw != "":
            values[field.name] = _parse_env(field.name, raw, field_default(field))
        cli = getattr(args, field.name, None)
        if cli is not None:
            values[field.name] = cli
    values.update(overrides)
    try:
        return msgspec.convert(values, struct)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad configuration: {exc}") from None


def _parse_env(name: str, raw: str, default: Any) -> Any:
    """A field's value from its environment variable's text, of its default's type."""
    if isinstance(default, bool):
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{env_var(name)}: expected a boolean, got {raw!r}")
    if isinstance(default, list):
        return [item.strip() for item in raw.split(",") if item.strip()]
    try:
        return type(default)(raw)
    except ValueError:
        raise ValueError(f"{env_var(name)}: expected {type(default).__name__}, got {raw!r}") from None
