"""Command-line flags generated from dataclass fields: one ``--field-name`` per field, typed by
its annotation and documented by the class's ``Attributes:`` docstring.

``llm-calib calibrate`` builds its :class:`~llm_calib.calm.config.CalibrationConfig` flags with
:func:`flag_type` and :func:`plain_help`; scripts (the benchmarks) generate the flags of their own
settings dataclasses with :func:`add_dataclass_flags` and read the ones given back with
:func:`dataclass_overrides`, so a new field gets its flag without another line of parsing.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from llm_calib.calm.config import field_help

__all__ = [
    "add_dataclass_flags", "dataclass_overrides", "flag_type", "optional", "parse_bool", "parse_csv", "parse_json_pairs",
    "plain_help",
]

T = TypeVar("T")


def plain_help(text: str) -> str:
    """Docstring text for ``--help``: no reST roles or literals, ``%`` escaped for argparse.

    Example:
        >>> plain_help("rank ``r`` of :class:`~llm_calib.calm.config.LoraSettings` (100%)")
        'rank r of llm_calib.calm.config.LoraSettings (100%%)'
    """
    text = re.sub(r":\w+:`~?([^`<]*?)(?: <[^>]*>)?`", r"\1", text).replace("``", "")
    return text.replace("%", "%%")


def optional(parse: Callable[[str], T]) -> Callable[[str], T | None]:
    """A parser that reads ``null`` / ``none`` as None and anything else with ``parse``.

    Example:
        >>> optional(int)("7"), optional(int)("null")
        (7, None)
    """

    def parse_optional(text: str) -> T | None:
        return None if text.lower() in ("null", "none") else parse(text)

    parse_optional.__name__ = getattr(parse, "__name__", "value")
    return parse_optional


def parse_bool(text: str) -> bool:
    """``true/yes/1`` or ``false/no/0`` (any case).

    Raises:
        argparse.ArgumentTypeError: anything else.

    Example:
        >>> parse_bool("Yes"), parse_bool("0")
        (True, False)
    """
    if text.lower() in ("true", "yes", "1"):
        return True
    if text.lower() in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def parse_csv(item: Callable[[str], T]) -> Callable[[str], tuple[T, ...]]:
    """A parser of comma-separated lists whose items ``item`` parses.

    Example:
        >>> parse_csv(int)("1, 2,3")
        (1, 2, 3)
    """

    def parse(text: str) -> tuple[T, ...]:
        try:
            return tuple(item(t.strip()) for t in text.split(",") if t.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None

    return parse


def parse_json_pairs(text: str) -> tuple[tuple[Any, ...], ...]:
    """A JSON list of lists as a tuple of tuples (flags of ``tuple[tuple[...], ...]`` fields, e.g.
    ``--open-examples '[["2 + 2?", "4"]]'``); the field's own validation checks the items.

    Raises:
        argparse.ArgumentTypeError: not JSON, or not a list of lists.

    Example:
        >>> parse_json_pairs('[["2 + 2?", "4"], ["Capital of Italy?", "Rome"]]')
        (('2 + 2?', '4'), ('Capital of Italy?', 'Rome'))
    """
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"expected a JSON list of lists, got {text!r} ({err})") from None
    if not isinstance(value, list) or not all(isinstance(v, list) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of lists, got {text!r}")
    return tuple(tuple(v) for v in value)


def flag_type(hint: Any) -> tuple[Callable[[str], Any], str]:
    """An argparse ``type`` and ``metavar`` for a field's type hint: ``bool``, ``int``, ``float``,
    ``str``, ``tuple[int | str | None, ...]`` (comma-separated; ``none`` items are None),
    ``tuple[tuple[...], ...]`` (a JSON list of lists, :func:`parse_json_pairs`), each optionally
    ``| None`` (then ``null`` gives None).

    Example:
        >>> parse, metavar = flag_type(int | None)
        >>> parse("3"), parse("null"), metavar
        (3, None, 'INT|null')
        >>> flag_type(tuple[int, ...])[0]("1,2")
        (1, 2)
        >>> flag_type(tuple[tuple[str, str], ...])[1]
        'JSON'
    """
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    is_optional = type(None) in typing.get_args(hint)
    base = args[0] if is_optional and len(args) == 1 else hint
    if typing.get_origin(base) is tuple:
        items = [a for a in typing.get_args(base) if a is not Ellipsis]
        kinds = {k for a in items for k in (typing.get_args(a) or (a,))}
        if any(typing.get_origin(a) is tuple for a in items):
            parse, metavar = parse_json_pairs, "JSON"
        elif int in kinds:
            parse, metavar = parse_csv(optional(int) if type(None) in kinds else int), "A,B,..."
        else:
            parse, metavar = parse_csv(str), "A,B,..."
    elif base is bool:
        parse, metavar = parse_bool, "{true,false}"
    elif base in (int, float):
        parse, metavar = base, base.__name__.upper()
    else:
        parse, metavar = str, "VALUE"
    return (optional(parse), metavar + "|null") if is_optional else (parse, metavar)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_dataclass_flags(parser: Any, cls: type, *, exclude: Iterable[str] = (), dest_prefix: str = "field:",
                        defaults: Any = None) -> list[str]:
    """Add one flag per field of the dataclass ``cls`` (``--top-layers`` for ``top_layers``).

    A flag not given leaves no entry in the parsed namespace, so :func:`dataclass_overrides` returns
    the fields given only (``null`` included, for an optional field); the help names the default (of
    ``defaults``, an instance, else of the class).

    Args:
        parser: an :class:`argparse.ArgumentParser` or argument group.
        cls: the dataclass.
        exclude: fields without a flag.
        dest_prefix: prefix of the ``dest`` of each flag in the parsed namespace.
        defaults: an instance whose values the help shows.

    Returns:
        The fields that got a flag.

    Raises:
        TypeError: ``cls`` is not a dataclass.

    Example:
        >>> import argparse
        >>> from llm_calib.calm.config import LoraSettings
        >>> p = argparse.ArgumentParser()
        >>> add_dataclass_flags(p, LoraSettings, exclude=("target_modules",))
        ['rank', 'alpha', 'dropout', 'layers', 'top_layers']
        >>> dataclass_overrides(p.parse_args(["--rank", "4", "--layers", "2,3"]), LoraSettings)
        {'rank': 4, 'layers': (2, 3)}
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"cls must be a dataclass, got {cls!r}")
    hints, helps, skip = typing.get_type_hints(cls), field_help(cls), set(exclude)
    added = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        parse, metavar = flag_type(hints[f.name])
        if defaults is not None:
            default = getattr(defaults, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "required"
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else "null" if default is None else default
        text = plain_help(helps.get(f.name, f.name.replace("_", " ")))
        parser.add_argument(_flag(f.name), dest=dest_prefix + f.name, type=parse, metavar=metavar, default=argparse.SUPPRESS,
                            help=f"{text} (default: {plain_help(str(shown))})")
        added.append(f.name)
    return added


def dataclass_overrides(args: argparse.Namespace, cls: type, *, dest_prefix: str = "field:") -> dict[str, Any]:
    """The fields of ``cls`` given on the command line (flags of :func:`add_dataclass_flags`).

    Example:
        >>> import argparse
        >>> from llm_calib.calm.config import LoraSettings
        >>> dataclass_overrides(argparse.Namespace(**{"field:alpha": 8.0, "other": 1}), LoraSettings)
        {'alpha': 8.0}
    """
    names = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for key, value in vars(args).items():
        if key.startswith(dest_prefix) and key[len(dest_prefix):] in names:
            out[key[len(dest_prefix):]] = value
    return out
