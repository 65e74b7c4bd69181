"""Exceptions and warnings raised by :mod:`hypergrad`, and how repeated warnings are folded.

A solver that stops short of its tolerance at every outer step would otherwise print one
warning per step, each with different numbers (so Python's own once-per-message filter never
folds them). Methods hand their messages to :func:`report`: a single ``method.hypergrad(...)``
call warns once per kind of message; inside :func:`hypergrad.solve` (which runs the loop under
:func:`collect_warnings`) each kind is counted instead and warned once when the solve ends, with
the number of outer steps it occurred at and its worst value.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = [
    "ConvergenceWarning",
    "NonFiniteError",
    "SolverMessage",
    "WarningLog",
    "check_compile_options",
    "check_inner_optimizer",
    "check_not_class",
    "collect_warnings",
    "report",
]


class NonFiniteError(FloatingPointError):
    """A loss, gradient or hypergradient estimate contains NaN or inf.

    Example:
        >>> import hypergrad as hg
        >>> issubclass(hg.NonFiniteError, FloatingPointError)
        True
    """


class ConvergenceWarning(UserWarning):
    """An iterative solver stopped before reaching its tolerance.

    The same message is also recorded in the ``warnings`` list of the result's ``info``.

    Example:
        >>> import warnings, torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * (lam["s"] * w["x"] ** 2).sum()   # Hessian diag(s)
        >>> f = lambda w, lam, b: w["x"].sum()
        >>> lam = {"s": torch.tensor([1.0, 100.0], dtype=torch.float64)}
        >>> w = {"x": torch.zeros(2, dtype=torch.float64)}
        >>> with warnings.catch_warnings(record=True) as caught:   # 3 terms, condition number 100
        ...     warnings.simplefilter("always")
        ...     r = hg.Implicit(hg.linear.Neumann(steps=3)).hypergrad(hg.BilevelProblem(g, f), w, lam)
        >>> r.info.converged, caught[0].category is hg.ConvergenceWarning
        (False, True)
    """


class SolverMessage(str):
    """A warning message (a ``str``) that also carries its kind and the value it reports.

    Messages of the same ``kind`` differ only in their numbers; :func:`report` folds them.

    Args:
        text: the message.
        kind: what went wrong, without numbers (e.g. ``"CG: not converged"``); default ``text``.
        value: the number that measures it (a relative residual, a curvature), or None.
        larger_is_worse: whether a larger ``value`` is worse (False for a curvature, where the
            most negative is the worst).

    Example:
        >>> from hypergrad.errors import SolverMessage
        >>> m = SolverMessage("CG: not converged (relative residual 1e-3)", kind="CG: not converged", value=1e-3)
        >>> m.kind, m.value, m.startswith("CG")
        ('CG: not converged', 0.001, True)
    """

    kind: str
    value: float | None
    larger_is_worse: bool

    def __new__(cls, text: str, kind: str | None = None, value: float | None = None,
                larger_is_worse: bool = True) -> SolverMessage:
        message = super().__new__(cls, text)
        message.kind = text if kind is None else kind
        message.value = value
        message.larger_is_worse = larger_is_worse
        return message


def _kind(message: str) -> str:
    return message.kind if isinstance(message, SolverMessage) else message


def _value(message: str) -> float | None:
    return message.value if isinstance(message, SolverMessage) else None


@dataclass
class _Folded:
    """The occurrences of one kind of warning in a solve."""

    category: type[Warning]
    steps: set[int]
    worst: str
    worst_step: int


class WarningLog:
    """The warnings of one solve, folded by kind (see :func:`collect_warnings`).

    Example:
        >>> from hypergrad.errors import ConvergenceWarning, SolverMessage, WarningLog
        >>> log = WarningLog()
        >>> for step, residual in enumerate([1e-3, 5e-2, 2e-4]):
        ...     log.step = step
        ...     log.add(SolverMessage(f"CG: not converged ({residual:.0e})", kind="CG: not converged",
        ...                           value=residual), ConvergenceWarning)
        >>> log.summaries(steps=10)
        ['CG: not converged at 3 of 10 outer steps; the worst, at step 1: CG: not converged (5e-02)']
    """

    def __init__(self) -> None:
        self.step = 0
        self._kinds: dict[tuple[type[Warning], str], _Folded] = {}

    def add(self, message: str, category: type[Warning]) -> None:
        """Count one occurrence of ``message`` at the current ``step``."""
        key = (category, _kind(message))
        folded = self._kinds.get(key)
        if folded is None:
            self._kinds[key] = _Folded(category, {self.step}, message, self.step)
            return
        folded.steps.add(self.step)
        if _worse(message, folded.worst):
            folded.worst, folded.worst_step = message, self.step

    def summaries(self, steps: int) -> list[str]:
        """One line per kind: at how many of ``steps`` outer steps it occurred, and the worst."""
        return [self._summary(folded, steps) for folded in self._kinds.values()]

    def emit(self, steps: int, stacklevel: int = 2) -> list[str]:
        """Warn once per kind (see :meth:`summaries`); return the messages warned."""
        lines = []
        for folded in self._kinds.values():
            line = self._summary(folded, steps)
            warnings.warn(line, folded.category, stacklevel=stacklevel + 1)
            lines.append(line)
        return lines

    @staticmethod
    def _summary(folded: _Folded, steps: int) -> str:
        if _kind(folded.worst) == folded.worst:  # a message without numbers: all occurrences alike
            return f"{folded.worst} (at {len(folded.steps)} of {steps} outer steps)"
        if len(folded.steps) == 1:
            return f"{folded.worst} (at outer step {folded.worst_step})"
        return (f"{_kind(folded.worst)} at {len(folded.steps)} of {steps} outer steps; the worst, "
                f"at step {folded.worst_step}: {folded.worst}")


def _worse(message: str, than: str) -> bool:
    value, reference = _value(message), _value(than)
    if value is None or reference is None:
        return False
    if value != value:  # NaN: nothing is worse
        return reference == reference
    larger = message.larger_is_worse if isinstance(message, SolverMessage) else True
    return value > reference if larger else value < reference


_ACTIVE_LOG: ContextVar[WarningLog | None] = ContextVar("hypergrad_warning_log", default=None)


@contextlib.contextmanager
def collect_warnings(log: WarningLog | None = None) -> Iterator[WarningLog]:
    """Collect the warnings :func:`report` would raise into a :class:`WarningLog` instead.

    :func:`hypergrad.solve` runs each step's calls under it, into one log (pass ``log`` to go on
    filling an existing one), and warns each kind once at the end.

    Example:
        >>> import warnings
        >>> from hypergrad.errors import SolverMessage, collect_warnings, report
        >>> with warnings.catch_warnings(record=True) as caught, collect_warnings() as log:
        ...     warnings.simplefilter("always")
        ...     for step in range(3):
        ...         log.step = step
        ...         report([SolverMessage(f"slow {step}", kind="slow", value=step)])
        >>> len(caught), log.summaries(steps=3)
        (0, ['slow at 3 of 3 outer steps; the worst, at step 2: slow 2'])
    """
    log = WarningLog() if log is None else log
    token = _ACTIVE_LOG.set(log)
    try:
        yield log
    finally:
        _ACTIVE_LOG.reset(token)


def report(messages: Iterable[str], category: type[Warning] = ConvergenceWarning, *,
           repeated: bool = False, stacklevel: int = 2) -> None:
    """Warn about ``messages``, once per kind; inside :func:`collect_warnings`, log them instead.

    Args:
        messages: the messages (plain strings or :class:`SolverMessage`).
        category: the warning class.
        repeated: the messages were already warned about by an earlier call (e.g.
            ``LinearSolveResult.repeated_warnings``): only logged, not warned again.
        stacklevel: as for :func:`warnings.warn`, counted from the caller of :func:`report`.

    Example:
        >>> import warnings
        >>> from hypergrad.errors import report
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     report(["CG: not converged (1e-3)", "CG: not converged (1e-3)"])
        >>> [str(w.message) for w in caught]
        ['CG: not converged (1e-3)']
    """
    log = _ACTIVE_LOG.get()
    seen: set[str] = set()
    for message in messages:
        if log is not None:
            log.add(message, category)
        elif not repeated and _kind(message) not in seen:
            warnings.warn(message, category, stacklevel=stacklevel + 1)
        seen.add(_kind(message))


def check_not_class(value: object, name: str) -> None:
    """Raise a one-line :class:`TypeError` when ``value`` is a class where an instance is expected.

    A class is callable, so passing ``hg.linear.CG`` instead of ``hg.linear.CG()`` would
    otherwise fail later with a message about its first option.

    Args:
        value: the argument.
        name: the parameter's name, for the message.

    Example:
        >>> import hypergrad as hg
        >>> from hypergrad.errors import check_not_class
        >>> check_not_class(hg.linear.CG, "solver")
        Traceback (most recent call last):
        ...
        TypeError: solver must be an instance, e.g. CG() with its options, not the class CG itself
    """
    if isinstance(value, type):
        raise TypeError(f"{name} must be an instance, e.g. {value.__name__}() with its options, not the class "
                        f"{value.__name__} itself")


def check_compile_options(compile: object, device_scalars: object) -> None:
    """Check the ``compile`` and ``device_scalars`` flags of a first-order method (BOME, Penalty): both
    bools, and not both set (the compiled call reads its scalars back once per call).

    Example:
        >>> check_compile_options(True, False)
        >>> check_compile_options(True, True)
        Traceback (most recent call last):
        ...
        ValueError: device_scalars is an option of the eager call; the compiled one (compile=True) reads its scalars back once per call
    """
    for name, value in (("compile", compile), ("device_scalars", device_scalars)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if compile and device_scalars:
        raise ValueError("device_scalars is an option of the eager call; the compiled one (compile=True) "
                         "reads its scalars back once per call")


def check_inner_optimizer(value: object, name: str, *, objective: bool = False) -> None:
    """Raise a one-line :class:`TypeError` unless ``value`` is a hypergrad inner optimizer.

    Inner optimizers (:mod:`hypergrad.inner`) update a dict of tensors functionally
    (``init(w)``, ``update(w, grad, state)``); a :mod:`torch.optim` optimizer, its class, or the
    class of an inner optimizer gets a message saying which to use. An optimizer that needs the
    loss itself (``needs_objective``, e.g. :class:`hypergrad.inner.Newton`) is refused unless the
    caller hands it one (``objective``).

    Args:
        value: the argument.
        name: the parameter's name, for the message.
        objective: whether the caller steps with ``update_with_objective`` (``inner_solve``,
            ``solve``'s inner steps).

    Example:
        >>> import torch
        >>> from hypergrad.errors import check_inner_optimizer
        >>> check_inner_optimizer(torch.optim.SGD, "inner_optimizer")
        Traceback (most recent call last):
        ...
        TypeError: inner_optimizer must be a hypergrad inner optimizer such as hypergrad.inner.SGD(lr=0.1) (or inner.Momentum, inner.Adam), not torch.optim.SGD: the inner steps update w functionally; torch.optim optimizers go in solve's outer_optimizer factory
    """
    import torch

    optim = value if isinstance(value, type) else type(value)
    if issubclass(optim, torch.optim.Optimizer):
        raise TypeError(
            f"{name} must be a hypergrad inner optimizer such as hypergrad.inner.SGD(lr=0.1) (or inner.Momentum, "
            f"inner.Adam), not torch.optim.{optim.__name__}: the inner steps update w functionally; torch.optim "
            "optimizers go in solve's outer_optimizer factory"
        )
    check_not_class(value, name)
    if not (callable(getattr(value, "init", None)) and callable(getattr(value, "update", None))):
        raise TypeError(
            f"{name} must be an inner optimizer with init(w) and update(w, grad, state) "
            f"(e.g. hypergrad.inner.SGD(lr=0.1)), got {type(value).__name__}"
        )
    if getattr(value, "needs_objective", False) and not objective:
        raise TypeError(
            f"{name} steps with update(w, grad, state), which {type(value).__name__} cannot take (it needs the loss "
            "itself): use it in hypergrad.inner_solve or as solve's inner_optimizer; here use SGD, Momentum, Adam or "
            "LBFGS")
