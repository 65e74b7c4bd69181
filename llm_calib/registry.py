"""Name registries: the one :class:`Registry` type, and the four registries of llm_calib.

A registry maps names to entries of one kind: :data:`OBJECTIVES` (training objectives),
:data:`SOLVERS` (CALM's bilevel solvers), :data:`TASK_FORMATS` (task formats; a multiple-choice
format's name is a ``scorer``) and :data:`LOADERS` (data loaders of the spec grammar). Every
registry follows the same rules:

* one way to register: :meth:`Registry.register` (the packages' decorators,
  :func:`~llm_calib.objectives.registry.register_objective`,
  :func:`~llm_calib.formats.registry.register_format`, :func:`~llm_calib.data.spec.register_loader`,
  call it); a name is a Python identifier, and a name held by one entry is refused to another
  (registering the same entry again is allowed, so a re-imported module is harmless);
* one way to load the built-ins: a registry knows each built-in name and the module that
  registers it, and imports that module the first time the name is looked up. Names are known
  (listed, checked) without importing any of the code behind them, so the configuration checks
  its names here without loading an objective, a format or a loader;
* one error type per misuse, each a :class:`RegistryError` (a ``ValueError``):
  :class:`InvalidNameError`, :class:`NameTakenError`, :class:`BuiltinEntryError`,
  :class:`UnknownNameError`.

This module imports no other module of the project: the built-in tables name their modules as
text, and the modules are imported on first lookup.

Example:
    >>> widgets = Registry("widget", field="widget.name")
    >>> widgets.register("a", int)
    >>> widgets.get("a"), "a" in widgets, widgets.names()
    (<class 'int'>, True, ('a',))
    >>> widgets.register("a", str)
    Traceback (most recent call last):
    ...
    llm_calib.registry.NameTakenError: widget 'a' is already registered (by int); unregister it first or choose another name
    >>> widgets.get("b")
    Traceback (most recent call last):
    ...
    llm_calib.registry.UnknownNameError: widget.name must be one of ('a',), got 'b'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar, overload

__all__ = [
    "LOADERS", "OBJECTIVES", "SOLVERS", "TASK_FORMATS", "BuiltinEntryError", "InvalidNameError", "NameTakenError",
    "NamesView", "Registry", "RegistryError", "RegistryView", "UnknownNameError",
]

E = TypeVar("E")


class RegistryError(ValueError):
    """A misuse of a registry (the base of the four kinds below; a ``ValueError``)."""


class InvalidNameError(RegistryError):
    """A name that is not a Python identifier."""


class NameTakenError(RegistryError):
    """A name another entry holds."""


class BuiltinEntryError(RegistryError):
    """An attempt to remove a built-in entry."""


class UnknownNameError(RegistryError):
    """A name no entry holds (the message lists the names that are)."""


def _identity(entry: Any) -> Any:
    return entry


class Registry(Generic[E]):
    """Names -> entries of one kind, with lazily loaded built-ins.

    Args:
        kind: what the registry holds, for messages (``"objective"``, ``"loader"``, ...).
        builtins: built-in name -> the module whose import registers it, in the order names are listed.
        field: how a lookup error names the setting (``"objective.name"``); default ``kind``.
        role: why a name must be an identifier, for the message.
        owner: the object that identifies an entry (default: the entry itself; a loader record's
            function for loaders): the same owner may register its name again.
        group: the group of a registered entry (task formats: their ``family``), for :meth:`names`
            of one group.
        builtin_groups: group -> the built-in names in it, so a group's names are known before the
            built-ins load.

    Example:
        >>> r = Registry("gadget", {"sum": "builtins"}, builtin_groups={"math": ("sum",)}, group=lambda e: "math")
        >>> r.names(), r.names("math"), "sum" in r
        (('sum',), ('sum',), True)
        >>> r.unregister("sum")
        Traceback (most recent call last):
        ...
        llm_calib.registry.BuiltinEntryError: the built-in gadget 'sum' cannot be unregistered
    """

    def __init__(self, kind: str, builtins: Mapping[str, str] | None = None, *, field: str | None = None,
                 role: str = "it is a config value and a flag value", owner: Callable[[E], Any] = _identity,
                 group: Callable[[E], str] | None = None,
                 builtin_groups: Mapping[str, Sequence[str]] | None = None) -> None:
        self.kind = kind
        self.builtins: dict[str, str] = dict(builtins or {})
        self.field = field or kind
        self.role = role
        self.owner = owner
        self.group = group
        self.builtin_groups = {g: tuple(names) for g, names in (builtin_groups or {}).items()}
        self._entries: dict[str, E] = {}

    def check_name(self, name: object) -> None:
        """:class:`InvalidNameError` unless ``name`` is a Python identifier.

        Example:
            >>> Registry("loader", role="it starts a data spec").check_name("my-data")
            Traceback (most recent call last):
            ...
            llm_calib.registry.InvalidNameError: loader name must be a Python identifier (it starts a data spec), got 'my-data'
        """
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidNameError(f"{self.kind} name must be a Python identifier ({self.role}), got {name!r}")

    def register(self, name: str, entry: E) -> None:
        """Put ``entry`` under ``name``.

        Raises:
            InvalidNameError: ``name`` is not an identifier.
            NameTakenError: another entry (another owner) holds ``name``.
        """
        self.check_name(name)
        if name in self._entries and self.owner(self._entries[name]) is not self.owner(entry):
            held = self.owner(self._entries[name])
            raise NameTakenError(f"{self.kind} {name!r} is already registered (by {getattr(held, '__qualname__', held)}); "
                                 "unregister it first or choose another name")
        self._entries[name] = entry

    def unregister(self, name: str) -> None:
        """Remove the entry registered as ``name``.

        Raises:
            BuiltinEntryError: a built-in name.
            UnknownNameError: no entry holds ``name``.
        """
        if name in self.builtins:
            raise BuiltinEntryError(f"the built-in {self.kind} {name!r} cannot be unregistered")
        if name not in self._entries:
            raise UnknownNameError(f"no {self.kind} {name!r} is registered")
        del self._entries[name]

    def names(self, group: str | None = None) -> tuple[str, ...]:
        """The built-in names, then the others in registration order (of one ``group`` when given);
        nothing is imported.

        Example:
            >>> OBJECTIVES.names()[:2], TASK_FORMATS.names("open")
            (('calm', 'lora_ce'), ('open_ended',))
        """
        if group is None:
            return tuple(dict.fromkeys([*self.builtins, *self._entries]))
        builtin = [n for n in self.builtins if n in self.builtin_groups.get(group, ())]
        assert self.group is not None, f"the {self.kind} registry has no groups"
        return tuple(dict.fromkeys([*builtin, *(n for n, e in self._entries.items()
                                                if n not in self.builtins and self.group(e) == group)]))

    def __contains__(self, name: object) -> bool:
        return name in self.builtins or name in self._entries

    def get(self, name: str) -> E:
        """The entry of ``name``, importing the module of a built-in on its first lookup.

        Raises:
            UnknownNameError: no entry holds ``name`` (lists the names).

        Example:
            >>> OBJECTIVES.get("label_smoothing").__name__
            'LabelSmoothing'
        """
        if name not in self._entries and name in self.builtins:
            importlib.import_module(self.builtins[name])  # registers the built-in
        if name not in self._entries:
            raise UnknownNameError(f"{self.field} must be one of {self.names()}, got {name!r}")
        return self._entries[name]

    def entries(self, group: str | None = None) -> dict[str, E]:
        """Name -> entry of every name (of one ``group``), built-ins loaded."""
        return {name: self.get(name) for name in self.names(group)}

    def names_view(self, group: str | None = None) -> NamesView:
        """A live view of :meth:`names`: a setting's allowed values that include names registered later."""
        return NamesView(self, group)

    def view(self, group: str | None = None) -> RegistryView[E]:
        """A live read-only mapping name -> entry (of one ``group``), not a second table."""
        return RegistryView(self, group)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()!r})"


class NamesView(Sequence[str]):
    """The names of a registry (of one group), read from it at every use: compares equal to the
    tuple of those names and prints as it (error messages list the names).

    Example:
        >>> scorers = TASK_FORMATS.names_view("multiple_choice")
        >>> scorers[:2], "letter" in scorers, scorers == ("option_likelihood", "letter")
        (('option_likelihood', 'letter'), True, True)
    """

    def __init__(self, registry: Registry[Any], group: str | None = None) -> None:
        self.registry, self.group = registry, group

    def _names(self) -> tuple[str, ...]:
        return self.registry.names(self.group)

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
        if isinstance(other, NamesView):
            other = other._names()
        return self._names() == other

    __hash__ = None  # type: ignore[assignment]  # equal to a tuple that changes: not hashable

    def __repr__(self) -> str:
        return repr(self._names())


class RegistryView(Mapping[str, E]):
    """A read-only mapping name -> entry of a registry (of one group), as registered now.

    Example:
        >>> view = TASK_FORMATS.view("open")
        >>> list(view), view["open_ended"].__name__
        (['open_ended'], 'OpenEnded')
    """

    def __init__(self, registry: Registry[E], group: str | None = None) -> None:
        self.registry, self.group = registry, group

    def __getitem__(self, name: str) -> E:
        if name not in self.registry.names(self.group):
            raise KeyError(name)
        return self.registry.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.registry.names(self.group))

    def __len__(self) -> int:
        return len(self.registry.names(self.group))

    def __repr__(self) -> str:
        return f"RegistryView({dict(self)!r})"


OBJECTIVES: Registry[type] = Registry("objective", {
    "calm": "llm_calib.objectives.calm",
    "lora_ce": "llm_calib.objectives.lora_ce",
    "label_smoothing": "llm_calib.objectives.label_smoothing",
    "confidence_penalty": "llm_calib.objectives.confidence_penalty",
}, field="objective.name")
"""Training objectives by name (:mod:`llm_calib.objectives`): CALM (bilevel) and the one-level baselines."""

SOLVERS: Registry[type] = Registry("solver", dict.fromkeys(("bome", "f2sa", "implicit"), "llm_calib.objectives.calm"),
                                   field="objective.solver.name")
"""CALM's bilevel solvers by name (:mod:`llm_calib.objectives.calm`)."""

TASK_FORMATS: Registry[type] = Registry("format", {
    "option_likelihood": "llm_calib.formats.multiple_choice",
    "letter": "llm_calib.formats.multiple_choice",
    "open_ended": "llm_calib.formats.open_ended",
}, field="format", group=lambda cls: cls.family,
    builtin_groups={"multiple_choice": ("option_likelihood", "letter"), "open": ("open_ended",)})
"""Task formats by name (:mod:`llm_calib.formats`), grouped by ``family``: a multiple-choice
format's name is a ``scorer``."""

LOADERS: Registry[Any] = Registry("loader", dict.fromkeys((
    "arc_easy", "arc_challenge", "openbookqa", "commonsenseqa", "qasc", "ai2", "mmlu", "mmlu_stem", "mmlu_humanities",
    "mmlu_social_sciences", "mmlu_other", "opentriviaqa", "nq_open", "webquestions", "selfaware", "jsonl", "hf",
    "builtin", "lm_eval",
), "llm_calib.data.spec_loaders"), field="loader", role="it starts a data spec", owner=lambda entry: entry.load)
"""Data loaders of the spec grammar by name (:mod:`llm_calib.data.spec`); an entry is a
:class:`~llm_calib.data.spec.SpecLoader`, identified by its function."""
