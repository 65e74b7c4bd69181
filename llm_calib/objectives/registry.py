"""Training objectives and CALM's solvers by name: the decorators and look-ups over
:data:`~llm_calib.registry.OBJECTIVES` and :data:`~llm_calib.registry.SOLVERS`.

A new objective is one module: an :class:`~llm_calib.objectives.base.Objective` subclass decorated
with :func:`register_objective`; config files, ``CalibrationConfig`` and the command line then
reach it. The built-in names are known before their modules load (:data:`BUILTIN_OBJECTIVES`);
a built-in's module is imported the first time its name is looked up. This module imports only
:mod:`llm_calib.registry`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from llm_calib.registry import OBJECTIVES, SOLVERS, Registry

__all__ = [
    "BUILTIN_OBJECTIVES", "BUILTIN_SOLVERS", "objective_class", "objective_from_dict",
    "objective_names", "register_objective", "register_solver", "solver_class", "solver_names",
    "unregister_objective", "unregister_solver",
]

BUILTIN_OBJECTIVES: tuple[str, ...] = tuple(OBJECTIVES.builtins)
"""The objectives shipped with llm_calib: CALM (bilevel) and the one-level baselines."""

BUILTIN_SOLVERS: tuple[str, ...] = tuple(SOLVERS.builtins)
"""CALM's shipped solvers (see :mod:`llm_calib.objectives.calm`)."""

T = TypeVar("T", bound=type)


def _registering(registry: Registry[type], name: str) -> Callable[[T], T]:
    registry.check_name(name)

    def decorate(cls: T) -> T:
        registry.register(name, cls)
        cls.name = name
        return cls

    return decorate


def register_objective(name: str) -> Callable[[T], T]:
    """Class decorator: register an :class:`~llm_calib.objectives.base.Objective` as ``name`` (also its ``name``).

    Raises:
        ~llm_calib.registry.InvalidNameError: ``name`` is not an identifier.
        ~llm_calib.registry.NameTakenError: another class holds it.

    Example:
        >>> from llm_calib.objectives.base import Objective
        >>> @register_objective("doc_example")
        ... class DocExample(Objective):
        ...     pass
        >>> objective_class("doc_example") is DocExample, "doc_example" in objective_names()
        (True, True)
        >>> unregister_objective("doc_example")
    """
    return _registering(OBJECTIVES, name)


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
    return _registering(SOLVERS, name)


unregister_objective = partial(Registry.unregister, OBJECTIVES)
"""Remove a registered objective (:meth:`~llm_calib.registry.Registry.unregister`; a built-in one cannot be)."""

unregister_solver = partial(Registry.unregister, SOLVERS)
"""Remove a registered solver (:meth:`~llm_calib.registry.Registry.unregister`)."""

objective_names = partial(Registry.names, OBJECTIVES)
"""The built-in objectives, then the registered others in registration order
(:meth:`~llm_calib.registry.Registry.names`)."""

solver_names = partial(Registry.names, SOLVERS)
"""The built-in solvers, then the registered others (:meth:`~llm_calib.registry.Registry.names`)."""

objective_class = partial(Registry.get, OBJECTIVES)
"""The objective class registered as a name, its module imported on first use
(:meth:`~llm_calib.registry.Registry.get`)."""

solver_class = partial(Registry.get, SOLVERS)
"""The solver config class registered as a name (:meth:`~llm_calib.registry.Registry.get`)."""


def objective_from_dict(data: Any) -> Any:
    """The objective of a config's ``objective`` entry: a mapping with a ``name`` (default ``"calm"``) and
    settings, or a bare name.

    Raises:
        ValueError: an unknown name, or a key that is not one of the objective's settings.

    Example:
        >>> objective_from_dict({"name": "confidence_penalty", "beta": 0.3})
        ConfidencePenalty(beta=0.3)
    """
    if isinstance(data, str):
        data = {"name": data}
    if not isinstance(data, dict):
        raise ValueError(f"objective must be a mapping with a name (or a name), got {data!r}")
    return objective_class(data.get("name", BUILTIN_OBJECTIVES[0])).from_dict(data)
