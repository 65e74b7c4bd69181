"""Command-line flags of a benchmark's settings dataclass: one ``--field-name`` per field, typed by
its annotation (:func:`llm_calib.cli.flags.flag_type`) and documented by the class's ``Attributes:``
docstring; :func:`dataclass_overrides` reads the ones given back, so a new field gets its flag
without another line of parsing.

Benchmark-only tooling (not installed with ``llm_calib``): the benchmark scripts beside this
package import it as ``harness.flags``.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Iterable
from typing import Any

from llm_calib.cli.flags import field_help, flag_type, plain_help

__all__ = ["add_dataclass_flags", "dataclass_overrides"]


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
        >>> from llm_calib.config.calibration import LoraSettings
        >>> p = argparse.ArgumentParser()
        >>> add_dataclass_flags(p, LoraSettings, exclude=("target_modules",))
        ['rank', 'alpha', 'dropout', 'layers', 'top_layers', 'output_scale', 'output_scale_lr']
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
        >>> from llm_calib.config.calibration import LoraSettings
        >>> dataclass_overrides(argparse.Namespace(**{"field:alpha": 8.0, "other": 1}), LoraSettings)
        {'alpha': 8.0}
    """
    names = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for key, value in vars(args).items():
        if key.startswith(dest_prefix) and key[len(dest_prefix):] in names:
            out[key[len(dest_prefix):]] = value
    return out
