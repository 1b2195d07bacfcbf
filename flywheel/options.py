"""A settings class as command-line flags, and back: every field of a process's settings class
(`ProxySettings`, `TrainerSettings`, `JudgeSettings`, `DatabaseSettings`) becomes a flag named after
it, whose help says its `FLYWHEEL_*` variable, its default and the field's own description. The
help is generated from the class, so a new field is on `--help` without a word written twice.

A flag takes the text its variable takes (`--upstream a,b` as `FLYWHEEL_UPSTREAM=a,b`; list flags
may also be repeated) and is validated by the same class: flags over variables over defaults.
"""

from __future__ import annotations

import argparse
import logging
import sys
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ByteSize, SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from core.settings import split_commas

S = TypeVar("S", bound=BaseSettings)

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_settings(
    parser: argparse.ArgumentParser, kind: type[BaseSettings], *, only: tuple[str, ...] = ()
) -> None:
    """One flag per field of `kind` (or of the fields named in `only`), in a group of their own."""
    group = parser.add_argument_group(
        "settings",
        f"{kind.__name__}: every flag is also the environment variable shown with it; "
        "a flag wins over its variable, a variable over the default.",
    )
    for name, field in kind.model_fields.items():
        if only and name not in only:
            continue
        flag = "--" + name.replace("_", "-")
        help_text = _help(field, env_name(kind, name))
        if _is(field, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        elif _is(field, list):
            group.add_argument(flag, action="append", help=help_text)
        elif _is(field, typing.Literal):
            choices = typing.get_args(_unoptional(field.annotation))
            group.add_argument(flag, choices=choices, help=help_text)
        else:
            group.add_argument(flag, help=help_text)


def reference(kind: type[BaseSettings]) -> list[str]:
    """`kind`'s own settings (not those of the class it extends) as a Markdown table: variable
    and flag, default, and the same description `--help` gives (the documentation site's
    settings reference, docs/hooks.py)."""
    inherited = {
        name
        for base in kind.__mro__[1:]
        if issubclass(base, BaseSettings)
        for name in base.model_fields
    }
    rows = ["| variable / flag | default | what it sets |", "|---|---|---|"]
    for name, field in kind.model_fields.items():
        if name in inherited:
            continue
        cell = _description(field).replace("|", "\\|").replace("\n", " ")
        flag = "--" + name.replace("_", "-")
        rows.append(f"| `{env_name(kind, name)}`<br>`{flag}` | `{_default(field)}` | {cell} |")
    return rows


def env_name(kind: type[BaseSettings], field: str) -> str:
    return f"{kind.model_config.get('env_prefix', '')}{field}".upper()


def build(kind: type[S], args: argparse.Namespace) -> S:
    """`kind` from the flags given, the environment and the defaults; bad values exit naming
    the setting and what is wrong with it."""
    values: dict[str, Any] = {}
    for name, value in vars(args).items():
        if name in kind.model_fields and value is not None:
            values[name] = split_commas(",".join(value)) if isinstance(value, list) else value
    try:
        return kind(**values)
    except ValidationError as e:
        lines = [
            f"  {'.'.join(map(str, err['loc'])) or 'settings'}: {err['msg']}" for err in e.errors()
        ]
        sys.exit("flywheel: bad settings (flags or FLYWHEEL_* variables):\n" + "\n".join(lines))


def configure_logging(level: str) -> None:
    """A process's log: its level, one line a record, openai's and httpx's per-request lines off."""
    logging.basicConfig(level=level.upper(), format=FORMAT)
    quiet_http_clients()


def quiet_http_clients() -> None:
    # A line per request is noise here: httpx (LangChain, our own calls) and httpx2 (openai 3).
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _help(field: FieldInfo, env: str) -> str:
    description = _description(field).replace("%", "%%")  # argparse %-formats help texts
    return " ".join(filter(None, [description, f"[{env}; default: {_default(field)}]"]))


def _description(field: FieldInfo) -> str:
    """The field's description and how its value is given (`--help` and the reference)."""
    notes = [field.description or ""]
    if _is(field, list):
        notes.append("Repeat it, or separate by commas.")
    if SecretStr in (_unoptional(field.annotation), *typing.get_args(field.annotation)):
        notes.append("(A flag shows in `ps`: prefer the variable.)")
    return " ".join(filter(None, notes))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "none, required"
    if field.default_factory is not None:
        made = field.default_factory()  # type: ignore[call-arg]
        return "none" if made in ([], {}) else "computed at start"
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, ByteSize):
        return value.human_readable()
    if isinstance(value, Path | str) and not str(value):
        return '""'
    return str(value)


def _is(field: FieldInfo, kind: Any) -> bool:
    """Whether the field's type is `kind` (or `kind | None`, or a `kind[...]`)."""
    annotation = _unoptional(field.annotation)
    return annotation is kind or typing.get_origin(annotation) is kind


def _unoptional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation
