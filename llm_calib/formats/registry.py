"""The registry of task formats by name: a multiple-choice format's name is a ``scorer``.

A format is a :class:`~llm_calib.formats.base.TaskFormat` subclass decorated with
:func:`register_format`; its properties (``family``, ``layout``, ``default_prompt``,
``configured_prompt``, ...) are attributes of the class. Every place that takes a scorer name
reads this registry when it is used, so a format registered after import is accepted by
``CalibrationConfig(prompt=dict(scorer=...))``, :func:`~llm_calib.evaluation.evaluate.evaluate`,
``llm_calib.calibrate`` and the command line's ``--scorer``. The shipped formats register
themselves when :mod:`llm_calib.formats` is imported (:data:`BUILTIN_FORMATS`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, overload

from llm_calib.data.records import RECORD_KINDS
from llm_calib.formats.base import TaskFormat
from llm_calib.registry import check_registry_name, register_entry, unregister_entry

__all__ = [
    "BUILTIN_FORMATS", "MULTIPLE_CHOICE_FORMATS", "SCORER_NAMES", "RegisteredFormats", "RegisteredNames", "family_format", "format_class", "format_names",
    "register_format", "scorer_class", "unregister_format",
]

BUILTIN_FORMATS = ("option_likelihood", "letter", "open_ended")
"""The formats shipped with llm_calib: two multiple-choice scorers and the open-ended format."""

_FORMATS: dict[str, type[TaskFormat]] = {}

F = TypeVar("F", bound=type[TaskFormat])


def register_format(name: str) -> Callable[[F], F]:
    """Class decorator: register a :class:`~llm_calib.formats.base.TaskFormat` subclass as ``name``
    (also its ``name`` attribute). A multiple-choice format (``family = "multiple_choice"``) is then
    a scorer: it is built as ``cls(normalize=..., prompt=...)``.

    Raises:
        ValueError: ``name`` is not an identifier, or another class holds it.
        TypeError: the class is not a ``TaskFormat`` subclass.

    Example:
        >>> from dataclasses import dataclass
        >>> from llm_calib.formats import OptionLikelihood
        >>> @register_format("doc_scorer")
        ... @dataclass(frozen=True)
        ... class DocScorer(OptionLikelihood):
        ...     pass
        >>> scorer_class("doc_scorer") is DocScorer, "doc_scorer" in SCORER_NAMES
        (True, True)
        >>> unregister_format("doc_scorer")
        >>> "doc_scorer" in SCORER_NAMES
        False
    """
    check_registry_name("format", name)

    def decorate(cls: F) -> F:
        if not (isinstance(cls, type) and issubclass(cls, TaskFormat)):
            raise TypeError(f"register_format({name!r}) takes a TaskFormat subclass, got {cls!r}")
        register_entry(_FORMATS, "format", name, cls)
        cls.name = name  # type: ignore[attr-defined]
        return cls

    return decorate


def unregister_format(name: str) -> None:
    """Remove a registered format.

    Raises:
        ValueError: a built-in format or an unknown name.

    Example:
        >>> unregister_format("letter")
        Traceback (most recent call last):
        ...
        ValueError: the built-in format 'letter' cannot be unregistered
    """
    unregister_entry(_FORMATS, BUILTIN_FORMATS, "format", name)


def format_names(family: str | None = None) -> tuple[str, ...]:
    """The registered formats (of one ``family`` when given), in registration order.

    Example:
        >>> format_names("multiple_choice")[:2], format_names("open")
        (('option_likelihood', 'letter'), ('open_ended',))
    """
    return tuple(n for n, cls in _FORMATS.items() if family is None or cls.family == family)


def format_class(name: str) -> type[TaskFormat]:
    """The format class registered as ``name``.

    Raises:
        ValueError: an unknown name (names the registered ones).

    Example:
        >>> format_class("open_ended").__name__
        'OpenEnded'
    """
    if name not in _FORMATS:
        raise ValueError(f"format must be one of {format_names()}, got {name!r}")
    return _FORMATS[name]


def scorer_class(scorer: str) -> type[Any]:
    """The multiple-choice format class of a scorer name (the ``scorer`` setting).

    Raises:
        ValueError: a name that is not a registered multiple-choice format (names the scorers).

    Example:
        >>> scorer_class("letter").layout
        'letter'
        >>> scorer_class("open_ended")
        Traceback (most recent call last):
        ...
        ValueError: scorer must be one of ('option_likelihood', 'letter'), got 'open_ended'
    """
    if scorer not in SCORER_NAMES:
        raise ValueError(f"scorer must be one of {SCORER_NAMES}, got {scorer!r}")
    return _FORMATS[scorer]


def family_format(family: str) -> type[TaskFormat]:
    """The class that declares a record kind's ``family`` (as result files store the kind): the
    base of its formats, whose ``description``, ``training_notes`` and ``domain_notes`` reports read.

    Raises:
        ValueError: a kind no registered format takes.

    Example:
        >>> family_format("open").description, family_format("multiple_choice").__name__
        ('open-ended (exact match)', 'MultipleChoiceFormat')
    """
    for cls in _FORMATS.values():
        if cls.family == family:
            return next(c for c in cls.__mro__ if "family" in vars(c))
    raise ValueError(f"kind must be one of {RECORD_KINDS}, got {family!r}")


class RegisteredNames(Sequence[str]):
    """The names of the registered formats of one family, read from the registry at every use:
    a setting's allowed values that include formats registered later. It compares equal to the
    tuple of those names and prints as it (error messages list the names).

    Example:
        >>> names = RegisteredNames("multiple_choice")
        >>> names[:2], "letter" in names, names == ("option_likelihood", "letter")
        (('option_likelihood', 'letter'), True, True)
    """

    def __init__(self, family: str) -> None:
        self.family = family

    def _names(self) -> tuple[str, ...]:
        return format_names(self.family)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...

    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RegisteredNames):
            other = other._names()
        return self._names() == other

    __hash__ = None  # type: ignore[assignment]  # equal to a tuple that changes: not hashable

    def __repr__(self) -> str:
        return repr(self._names())


SCORER_NAMES = RegisteredNames("multiple_choice")
"""The scorer names: the registered multiple-choice formats, read at every use (the allowed values
of the ``scorer`` setting and of ``--scorer``)."""


class RegisteredFormats(Mapping[str, type[Any]]):
    """A read-only view of the registry: name -> class of the formats of one family, as registered
    now (not a second table: registering or unregistering shows here at once).

    Example:
        >>> view = RegisteredFormats("open")
        >>> list(view), view["open_ended"].__name__
        (['open_ended'], 'OpenEnded')
    """

    def __init__(self, family: str) -> None:
        self.family = family

    def __getitem__(self, name: str) -> type[Any]:
        if name not in format_names(self.family):
            raise KeyError(name)
        return _FORMATS[name]

    def __iter__(self) -> Iterator[str]:
        return iter(format_names(self.family))

    def __len__(self) -> int:
        return len(format_names(self.family))

    def __repr__(self) -> str:
        return f"RegisteredFormats({dict(self)!r})"


MULTIPLE_CHOICE_FORMATS = RegisteredFormats("multiple_choice")
"""The multiple-choice formats by scorer name (a live view of the registry)."""
