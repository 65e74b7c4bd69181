"""The registry of training objectives and of CALM's solvers, by name.

A new objective is one module: an :class:`~llm_calib.objectives.base.Objective` subclass decorated
with :func:`register_objective`; config files, ``CalibrationConfig`` and the command line then
reach it. The built-in names are known before their modules load (:data:`BUILTIN_OBJECTIVES`),
which :mod:`llm_calib.objectives.builtin` registers. This module imports only
:mod:`llm_calib.registry` (the rules every registry shares).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from llm_calib.registry import check_registry_name, register_entry, unregister_entry

__all__ = [
    "BUILTIN_OBJECTIVES", "BUILTIN_SOLVERS", "objective_class", "objective_from_dict",
    "objective_names", "register_objective", "register_solver", "solver_class", "solver_names",
    "unregister_objective", "unregister_solver",
]

BUILTIN_OBJECTIVES = ("calm", "lora_ce", "label_smoothing", "confidence_penalty")
"""The objectives shipped with llm_calib: CALM (bilevel) and the one-level baselines."""

BUILTIN_SOLVERS = ("bome", "f2sa", "implicit")
"""CALM's shipped solvers (see :mod:`llm_calib.objectives.calm`)."""

_OBJECTIVES: dict[str, type] = {}
_SOLVERS: dict[str, type] = {}

T = TypeVar("T", bound=type)


def _register(table: dict[str, type], kind: str, name: str) -> Callable[[T], T]:
    check_registry_name(kind, name)

    def decorate(cls: T) -> T:
        register_entry(table, kind, name, cls)
        cls.name = name
        return cls

    return decorate


def register_objective(name: str) -> Callable[[T], T]:
    """Class decorator: register an :class:`~llm_calib.objectives.base.Objective` as ``name`` (also its ``name``).

    Raises:
        ValueError: ``name`` is not an identifier, or another class holds it.

    Example:
        >>> from llm_calib.objectives.base import Objective
        >>> @register_objective("doc_example")
        ... class DocExample(Objective):
        ...     pass
        >>> objective_class("doc_example") is DocExample, "doc_example" in objective_names()
        (True, True)
        >>> unregister_objective("doc_example")
    """
    return _register(_OBJECTIVES, "objective", name)


def register_solver(name: str) -> Callable[[T], T]:
    """Class decorator: register a solver config of :class:`~llm_calib.objectives.calm.Calm` as ``name``.

    Example:
        >>> @register_solver("doc_solver")
        ... class DocSolver:
        ...     pass
        >>> solver_class("doc_solver").name
        'doc_solver'
        >>> unregister_solver("doc_solver")
    """
    return _register(_SOLVERS, "solver", name)


def unregister_objective(name: str) -> None:
    """Remove a registered objective.

    Raises:
        ValueError: a built-in objective or an unknown name.
    """
    unregister_entry(_OBJECTIVES, BUILTIN_OBJECTIVES, "objective", name)


def unregister_solver(name: str) -> None:
    """Remove a registered solver (see :func:`unregister_objective`)."""
    unregister_entry(_SOLVERS, BUILTIN_SOLVERS, "solver", name)


def objective_names() -> tuple[str, ...]:
    """The built-in objectives, then the registered others in registration order.

    Example:
        >>> objective_names()[:2]
        ('calm', 'lora_ce')
    """
    return tuple(dict.fromkeys(BUILTIN_OBJECTIVES + tuple(_OBJECTIVES)))


def solver_names() -> tuple[str, ...]:
    """The built-in solvers, then the registered others.

    Example:
        >>> solver_names()[:3]
        ('bome', 'f2sa', 'implicit')
    """
    return tuple(dict.fromkeys(BUILTIN_SOLVERS + tuple(_SOLVERS)))


def _lookup(table: dict[str, type], names: tuple[str, ...], field: str, name: str) -> type:
    if name in table:
        return table[name]
    if name in names:  # a built-in whose module is not imported yet
        raise ValueError(f"{field} {name!r} is built in but not loaded: import llm_calib.objectives.builtin first")
    raise ValueError(f"{field} must be one of {names}, got {name!r}")


def objective_class(name: str) -> type:
    """The objective class registered as ``name``.

    Raises:
        ValueError: an unknown name (names the registered ones).

    Example:
        >>> import llm_calib.objectives.builtin
        >>> objective_class("label_smoothing").__name__
        'LabelSmoothing'
    """
    return _lookup(_OBJECTIVES, objective_names(), "objective.name", name)


def solver_class(name: str) -> type:
    """The solver config class registered as ``name``.

    Raises:
        ValueError: an unknown name (names the registered ones).

    Example:
        >>> import llm_calib.objectives.builtin
        >>> solver_class("f2sa").__name__
        'F2SA'
    """
    return _lookup(_SOLVERS, solver_names(), "objective.solver.name", name)


def objective_from_dict(data: Any) -> Any:
    """The objective of a config's ``objective`` entry: a mapping with a ``name`` (default ``"calm"``) and
    settings, or a bare name.

    Raises:
        ValueError: an unknown name, or a key that is not one of the objective's settings.

    Example:
        >>> import llm_calib.objectives.builtin
        >>> objective_from_dict({"name": "confidence_penalty", "beta": 0.3})
        ConfidencePenalty(beta=0.3)
    """
    if isinstance(data, str):
        data = {"name": data}
    if not isinstance(data, dict):
        raise ValueError(f"objective must be a mapping with a name (or a name), got {data!r}")
    return objective_class(data.get("name", BUILTIN_OBJECTIVES[0])).from_dict(data)
