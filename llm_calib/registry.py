"""The rules every name registry of the project shares: objectives and solvers
(:mod:`llm_calib.objectives.registry`), task formats (:mod:`llm_calib.formats.registry`) and data
loaders (:func:`llm_calib.data.register_loader`).

A name is a Python identifier; a name held by one entry is refused to another (registering the
same entry again is allowed, so a re-imported module is harmless); a built-in name cannot be
removed. Each registry keeps its own table and says what it registers (``kind``) in its messages.
This module imports no other project module.

Example:
    >>> table: dict[str, type] = {}
    >>> class A: ...
    >>> register_entry(table, "widget", "a", A)
    >>> register_entry(table, "widget", "a", int)
    Traceback (most recent call last):
    ...
    ValueError: widget 'a' is already registered (by A); unregister it first or choose another name
    >>> unregister_entry(table, ("builtin_one",), "widget", "a"); table
    {}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any, TypeVar

__all__ = ["check_registry_name", "register_entry", "unregister_entry"]

E = TypeVar("E")


def check_registry_name(kind: str, name: object, role: str = "it is a config value and a flag value") -> None:
    """ValueError unless ``name`` is a Python identifier; ``role`` says why it must be one.

    Example:
        >>> check_registry_name("loader", "my-data", "it starts a data spec")
        Traceback (most recent call last):
        ...
        ValueError: loader name must be a Python identifier (it starts a data spec), got 'my-data'
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{kind} name must be a Python identifier ({role}), got {name!r}")


def register_entry(table: MutableMapping[str, E], kind: str, name: str, entry: E,
                   owner: Callable[[E], Any] = lambda entry: entry) -> None:
    """Put ``entry`` into ``table`` under ``name``; ValueError when another owner holds the name.

    Args:
        table: the registry's table.
        kind: what the registry holds, for the message (``"objective"``, ``"loader"``, ...).
        name: the name (checked by :func:`check_registry_name` beforehand).
        entry: what is registered.
        owner: the object that identifies an entry (default: the entry itself; a loader's
            function for a loader record): the same owner may register its name again.
    """
    if name in table and owner(table[name]) is not owner(entry):
        held = owner(table[name])
        raise ValueError(f"{kind} {name!r} is already registered (by {getattr(held, '__qualname__', held)}); "
                         "unregister it first or choose another name")
    table[name] = entry


def unregister_entry(table: MutableMapping[str, Any] | Mapping[str, Any], builtin: Sequence[str], kind: str,
                     name: str) -> None:
    """Remove ``name`` from ``table``; ValueError for a built-in or an unknown name.

    Example:
        >>> unregister_entry({"x": 1}, ("x",), "format", "x")
        Traceback (most recent call last):
        ...
        ValueError: the built-in format 'x' cannot be unregistered
    """
    if name in builtin:
        raise ValueError(f"the built-in {kind} {name!r} cannot be unregistered")
    if name not in table:
        raise ValueError(f"no {kind} {name!r} is registered")
    del table[name]  # type: ignore[attr-defined]
