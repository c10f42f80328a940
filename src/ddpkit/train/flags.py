"""Command-line flags and TOML keys generated from the config dataclasses, so neither restates them.

Each field becomes ``--field-name`` with its type, its docstring line as help and its default
shown; a bool becomes ``--name`` / ``--no-name``; a tuple takes names separated by commas
(``--trackers tensorboard,mlflow``, a list in TOML); ``none`` gives None to a field that allows it.
Flags default to "not given", so the layers beneath them (the workload, the TOML file) show
through. ``--config run.toml`` holds the same fields under one table per section (``[data]``,
``[engine]``, ...) or at the top level; ``[launch]`` holds the launcher's flags by name.
"""

from __future__ import annotations

import argparse
import inspect
import math
import re
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import tomllib

from ddpkit.errors import ConfigError
from ddpkit.train.job import CLI_DEFAULTS, OWNER, SECTIONS


def add_config_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of every section, in a help group per section."""
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section} ({cls.__name__})")
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        for f in fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            kind, optional = _base(hints[f.name])
            shown = "runs/TASK" if f.name == "out" else CLI_DEFAULTS.get(f.name, f.default)
            default = "" if shown is MISSING else f" (default: {shown})"
            help_text = (docs.get(f.name, "") + default).replace("%", "%%")  # argparse formats help with %
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            else:
                meta = {int: "N", float: "X", tuple: "A,B"}.get(kind, "TEXT")
                group.add_argument(
                    flag, type=_converter(flag, kind, optional), default=None, metavar=meta, help=help_text
                )


def flag_values(ns: argparse.Namespace) -> dict[str, Any]:
    """The config fields given on the command line (flags not given are left out)."""
    return {name: value for name, value in vars(ns).items() if name in OWNER and value is not None}


def field_docs(cls: type) -> dict[str, str]:
    """Each field's description from the class docstring's ``Args:`` section, on one line, reST removed."""
    doc = inspect.cleandoc(cls.__doc__ or "").split("Args:", 1)
    if len(doc) < 2:
        return {}
    docs: dict[str, str] = {}
    name = None
    for line in doc[1].splitlines():
        match = re.match(r"^ {4}(\w+): (.*)$", line)
        if match:
            name, docs[match[1]] = match[1], match[2]
        elif name and line.strip():
            docs[name] += " " + line.strip()
    return {k: v.replace("``", "") for k, v in docs.items()}


def read_toml(path: str, launch_flags: set[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config fields, launcher flags) from ``path``; an unknown key is an error naming it."""
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--config {path!r} does not exist; give a TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {path!r} is not valid TOML: {exc}") from None
    values: dict[str, Any] = {}
    launch = raw.pop("launch", {})
    for key in sorted(set(launch) - launch_flags):
        raise ConfigError(f"{path}: unknown key {key!r} in [launch]; known keys: {sorted(launch_flags)}")
    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, dict):
            for name, item in value.items():
                if OWNER.get(name) != key:
                    known = [f.name for f in fields(SECTIONS[key])]
                    raise ConfigError(f"{path}: unknown key {name!r} in [{key}]; known keys there: {known}")
                values[name] = _checked(path, name, item)
        elif key in OWNER:
            values[key] = _checked(path, key, value)
        else:
            raise ConfigError(
                f"{path}: unknown key {key!r}; use the tables {sorted(SECTIONS)} and [launch], "
                "or a known key at the top level"
            )
    return values, launch


def _checked(path: str, name: str, value: Any) -> Any:
    """A TOML value of the field's type (an int may stand for a float)."""
    cls = SECTIONS[OWNER[name]]
    kind, optional = _base(typing.get_type_hints(cls)[name])
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is tuple and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    if optional and value == "none":
        return None
    raise ConfigError(f"{path}: {name} = {value!r} must be {'a list' if kind is tuple else kind.__name__}")


def _base(hint: Any) -> tuple[type, bool]:
    """(the type, whether None is allowed) of a field annotated ``T`` or ``T | None``."""
    if isinstance(hint, types.UnionType):
        kinds = [k for k in typing.get_args(hint) if k is not type(None)]
        return kinds[0], True
    return typing.get_origin(hint) or hint, False  # tuple[str, ...] is a tuple


def _converter(flag: str, kind: type, optional: bool):
    def convert(text: str) -> Any:
        if optional and text.lower() == "none":
            return None
        if kind is tuple:
            return tuple(part.strip() for part in text.split(",") if part.strip())
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r} is not {kind.__name__}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{flag} {text} is not finite; give a number")
        return value

    convert.__name__ = kind.__name__
    return convert
