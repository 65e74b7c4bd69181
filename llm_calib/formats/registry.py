"""Task formats by name: the decorator and look-ups over :data:`~llm_calib.registry.TASK_FORMATS`;
a multiple-choice format's name is a ``scorer``.

A format is a :class:`~llm_calib.formats.base.TaskFormat` subclass decorated with
:func:`register_format`; its properties (``family``, ``layout``, ``default_prompt``,
``configured_prompt``, ...) are attributes of the class. Every place that takes a scorer name
reads the registry when it is used, so a format registered after import is accepted by
``CalibrationConfig(prompt=dict(scorer=...))``, :func:`~llm_calib.evaluation.evaluate.evaluate`,
``llm_calib.calibrate`` and the command line's ``--scorer``. The shipped formats
(:data:`BUILTIN_FORMATS`) load the first time one of their names is looked up.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from llm_calib.data.records import RECORD_KINDS
from llm_calib.formats.base import TaskFormat
from llm_calib.registry import TASK_FORMATS, NamesView, Registry, RegistryView, UnknownNameError

__all__ = [
    "BUILTIN_FORMATS", "MULTIPLE_CHOICE_FORMATS", "SCORER_NAMES", "family_format", "format_class", "format_names",
    "register_format", "scorer_class", "unregister_format",
]

BUILTIN_FORMATS: tuple[str, ...] = tuple(TASK_FORMATS.builtins)
"""The formats shipped with llm_calib: two multiple-choice scorers and the open-ended format."""

F = TypeVar("F", bound=type[TaskFormat])


def register_format(name: str) -> Callable[[F], F]:
    """Class decorator: register a :class:`~llm_calib.formats.base.TaskFormat` subclass as ``name``
    (also its ``name`` attribute). A multiple-choice format (``family = "multiple_choice"``) is then
    a scorer: it is built as ``cls(normalize=..., prompt=...)``.

    Raises:
        ~llm_calib.registry.InvalidNameError: ``name`` is not an identifier.
        ~llm_calib.registry.NameTakenError: another class holds it.
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
    TASK_FORMATS.check_name(name)

    def decorate(cls: F) -> F:
        if not (isinstance(cls, type) and issubclass(cls, TaskFormat)):
            raise TypeError(f"register_format({name!r}) takes a TaskFormat subclass, got {cls!r}")
        TASK_FORMATS.register(name, cls)
        cls.name = name  # type: ignore[attr-defined]
        return cls

    return decorate


unregister_format = partial(Registry.unregister, TASK_FORMATS)
"""Remove a registered format (:meth:`~llm_calib.registry.Registry.unregister`; a built-in one cannot be)."""

format_names = partial(Registry.names, TASK_FORMATS)
"""The registered formats (of one family, e.g. ``format_names("open")``): the built-in ones, then the others
in registration order (:meth:`~llm_calib.registry.Registry.names`)."""

format_class = partial(Registry.get, TASK_FORMATS)
"""The format class registered as a name (:meth:`~llm_calib.registry.Registry.get`)."""

SCORER_NAMES: NamesView = TASK_FORMATS.names_view("multiple_choice")
"""The scorer names: the registered multiple-choice formats, read at every use (the allowed values
of the ``scorer`` setting and of ``--scorer``)."""

MULTIPLE_CHOICE_FORMATS: RegistryView[type[Any]] = TASK_FORMATS.view("multiple_choice")
"""The multiple-choice formats by scorer name (a live view of the registry)."""


def scorer_class(scorer: str) -> type[Any]:
    """The multiple-choice format class of a scorer name (the ``scorer`` setting).

    Raises:
        ~llm_calib.registry.UnknownNameError: a name that is not a registered multiple-choice format
            (names the scorers).

    Example:
        >>> scorer_class("letter").layout
        'letter'
        >>> scorer_class("open_ended")
        Traceback (most recent call last):
        ...
        llm_calib.registry.UnknownNameError: scorer must be one of ('option_likelihood', 'letter'), got 'open_ended'
    """
    if scorer not in SCORER_NAMES:
        raise UnknownNameError(f"scorer must be one of {SCORER_NAMES}, got {scorer!r}")
    return TASK_FORMATS.get(scorer)


def family_format(family: str) -> type[TaskFormat]:
    """The class that declares a record kind's ``family`` (as result files store the kind): the
    base of its formats, whose ``description``, ``training_notes`` and ``domain_notes`` reports read.

    Raises:
        ValueError: a kind no registered format takes.

    Example:
        >>> family_format("open").description, family_format("multiple_choice").__name__
        ('open-ended (exact match)', 'MultipleChoiceFormat')
    """
    for cls in TASK_FORMATS.entries().values():
        if cls.family == family:
            return next(c for c in cls.__mro__ if "family" in vars(c))
    raise ValueError(f"kind must be one of {RECORD_KINDS}, got {family!r}")
