"""Command-line flags of dataclass fields: an argparse type and metavar per type hint
(:func:`flag_type`), help text from the class's ``Attributes:`` docstring (:func:`field_help`,
:func:`plain_help`). ``calibrate``'s configuration flags (:mod:`llm_calib.cli.config_flags`) and
the benchmarks' settings flags are generated with them.
"""

from __future__ import annotations

import argparse
import math
import re
import typing
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["field_help", "finite_float", "flag_type", "optional", "parse_bool", "parse_csv", "parse_json_pairs", "plain_help"]

T = TypeVar("T")


def field_help(cls: type) -> dict[str, str]:
    """One line of help per field of a config dataclass, read from its ``Attributes:`` docstring.

    Fields documented together (``max_log_scale, max_bias: ...``) share their text.

    Example:
        >>> from llm_calib.config.calibration import LoraSettings
        >>> field_help(LoraSettings)["rank"]
        'adapter rank ``r``.'
    """
    out: dict[str, str] = {}
    lines = (cls.__doc__ or "").splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return out
    indent, names = None, []
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        if depth < indent:
            break
        if depth == indent and ":" in line:
            head, text = line.strip().split(":", 1)
            names = [n.strip() for n in head.split(",")]
            for n in names:
                out[n] = text.strip()
        else:
            for n in names:
                out[n] += " " + line.strip()
    return out


def plain_help(text: str) -> str:
    """Docstring text for ``--help``: no reST roles or literals, ``%`` escaped for argparse.

    Example:
        >>> plain_help("rank ``r`` of :class:`~llm_calib.config.calibration.LoraSettings` (100%)")
        'rank r of llm_calib.config.calibration.LoraSettings (100%%)'
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
    """``true/yes/1`` or ``false/no/0`` (any case); else ``argparse.ArgumentTypeError``.

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
    """A JSON list of lists as a tuple of tuples (``--open-examples '[["2 + 2?", "4"]]'``).

    Example:
        >>> parse_json_pairs('[["2 + 2?", "4"]]')
        (('2 + 2?', '4'),)
    """
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"expected a JSON list of lists, got {text!r} ({err})") from None
    if not isinstance(value, list) or not all(isinstance(v, list) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of lists, got {text!r}")
    return tuple(tuple(v) for v in value)


def finite_float(text: str) -> float:
    """An argparse type: a finite number (``inf`` and ``nan`` are refused, naming the text).

    Example:
        >>> finite_float("1e-3")
        0.001
        >>> finite_float("inf")
        Traceback (most recent call last):
        argparse.ArgumentTypeError: expected a finite number, got 'inf'
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def flag_type(hint: Any) -> tuple[Callable[[str], Any], str]:
    """An argparse ``type`` and ``metavar`` for a type hint: ``bool``, ``int``, ``float``, ``str``,
    ``tuple[int | str | None, ...]`` (comma-separated), ``tuple[tuple[...], ...]`` (JSON), each
    optionally ``| None`` (``null`` gives None).

    Example:
        >>> parse, metavar = flag_type(int | None)
        >>> parse("3"), parse("null"), metavar
        (3, None, 'INT|null')
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
    elif base is float:  # inf and nan are never a usable learning rate, step size or weight
        parse, metavar = finite_float, "FLOAT"
    elif base is int:
        parse, metavar = int, "INT"
    else:
        parse, metavar = str, "VALUE"
    return (optional(parse), metavar + "|null") if is_optional else (parse, metavar)
