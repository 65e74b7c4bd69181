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
