"""Exceptions and warnings raised by :mod:`hypergrad`."""

from __future__ import annotations

__all__ = ["ConvergenceWarning", "NonFiniteError"]


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
    """
