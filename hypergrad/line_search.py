r"""A line search for the strong Wolfe conditions, usable to machine precision.

Along a descent direction :math:`d` from :math:`w`, with :math:`\varphi(t) = g(w + t d)`, a step
:math:`t` satisfies the strong Wolfe conditions when

.. math::
    \varphi(t) \le \varphi(0) + c_1 t \varphi'(0) \quad\text{(sufficient decrease)}, \qquad
    |\varphi'(t)| \le c_2 |\varphi'(0)| \quad\text{(curvature)}.

:func:`strong_wolfe` brackets such a step (extrapolating by cubic interpolation) and zooms into the
bracket (Nocedal and Wright, *Numerical Optimization*, Algorithms 3.5 and 3.6), as SciPy's and
PyTorch's searches do. Near a minimum the decrease :math:`c_1 t \varphi'(0)` falls below the
rounding error of :math:`\varphi` itself, and a test on values can no longer tell a good step from
a bad one: searches that rely on it stall there (SciPy's L-BFGS-B stops on it, at gradient norms
around 1e-9 on the wine problem of ``tests/test_newton.py``). Where :math:`\varphi(t)` is within
rounding of :math:`\varphi(0)`, this search accepts the *approximate* sufficient decrease of Hager
and Zhang (2005), :math:`\varphi'(t) \le (2 c_1 - 1)\varphi'(0)`, which is a test on the slope,
and zooms by the slope's sign, so L-BFGS reaches gradient norms of 1e-10 and below.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["LineSearchResult", "strong_wolfe"]


@dataclass
class LineSearchResult:
    """The step a line search took.

    Attributes:
        step: the step :math:`t` (0 when no step decreased the loss).
        value: :math:`\\varphi(t)`.
        slope: :math:`\\varphi'(t)`.
        aux: what ``phi`` returned besides the value and slope at ``t`` (e.g. the point and its
            gradient), None at ``t = 0``.
        evaluations: evaluations of ``phi``.
        satisfied: whether ``t`` satisfies the strong Wolfe conditions (in their approximate
            form near rounding); False: the best step with sufficient decrease found within the
            evaluation budget, or 0.

    Example:
        >>> LineSearchResult(1.0, 0.5, 0.0, None, 1, True).satisfied
        True
    """

    step: float
    value: float
    slope: float
    aux: Any
    evaluations: int
    satisfied: bool


def _cubic_minimizer(t1: float, v1: float, s1: float, t2: float, v2: float, s2: float,
                     low: float, high: float) -> float:
    """The minimiser of the cubic through two points with their slopes, clipped to ``[low, high]``."""
    if t1 == t2:
        return 0.5 * (low + high)
    d1 = s1 + s2 - 3.0 * (v1 - v2) / (t1 - t2)
    square = d1 * d1 - s1 * s2
    if not square >= 0.0 or not math.isfinite(square):
        return 0.5 * (low + high)
    d2 = math.sqrt(square)
    if t1 <= t2:
        denominator = s2 - s1 + 2.0 * d2
        t = t2 - (t2 - t1) * ((s2 + d2 - d1) / denominator) if denominator else 0.5 * (t1 + t2)
    else:
        denominator = s1 - s2 + 2.0 * d2
        t = t1 - (t1 - t2) * ((s1 + d2 - d1) / denominator) if denominator else 0.5 * (t1 + t2)
    if not math.isfinite(t):
        return 0.5 * (low + high)
    return min(max(t, low), high)


def strong_wolfe(
    phi: Callable[[float], tuple[float, float, Any]],
    value0: float,
    slope0: float,
    step: float,
    *,
    c1: float = 1e-4,
    c2: float = 0.9,
    max_evaluations: int = 25,
    rounding: float = 0.0,
    extrapolation: float = 10.0,
) -> LineSearchResult:
    r"""A step satisfying the strong Wolfe conditions along a descent direction.

    Args:
        phi: ``t -> (value, slope, aux)``: :math:`\varphi(t)`, :math:`\varphi'(t)` and anything the
            caller wants back for the accepted step (the point and its gradient). A non-finite
            value makes the search back off.
        value0: :math:`\varphi(0)`.
        slope0: :math:`\varphi'(0)` (< 0).
        step: the first step tried (> 0).
        c1: the sufficient-decrease constant, in ``(0, c2)``.
        c2: the curvature constant, in ``(c1, 1)`` (0.9 for quasi-Newton methods).
        max_evaluations: the evaluation budget.
        rounding: the rounding error of the values, e.g. ``16 * eps * |value0|``: values within it
            of :math:`\varphi(0)` count as no change, and the slope decides (see the module
            docstring).
        extrapolation: how far beyond the last step the bracketing phase may go, as a factor.

    Returns:
        A :class:`LineSearchResult`.

    Raises:
        ValueError: ``slope0`` is not negative (not a descent direction) or ``step`` is not > 0.

    Example:
        >>> phi = lambda t: ((t - 3.0) ** 2, 2.0 * (t - 3.0), None)   # minimum at t = 3
        >>> result = strong_wolfe(phi, 9.0, -6.0, 1.0)
        >>> result.satisfied, abs(result.slope) <= 0.9 * 6.0, result.value < 9.0
        (True, True, True)
    """
    if not slope0 < 0.0:
        raise ValueError(f"slope0 must be < 0 (a descent direction), got {slope0!r}")
    if not step > 0.0 or not math.isfinite(step):
        raise ValueError(f"step must be a finite number > 0, got {step!r}")
    evaluations = 0
    best = LineSearchResult(0.0, value0, slope0, None, 0, False)

    def decreases(t: float, value: float, slope: float) -> bool:
        if value <= value0 + c1 * t * slope0:
            return True
        return value <= value0 + rounding and slope <= (2.0 * c1 - 1.0) * slope0  # approximate (at rounding)

    def curvature(slope: float) -> bool:
        return abs(slope) <= -c2 * slope0

    def evaluate(t: float) -> tuple[float, float, Any]:
        nonlocal evaluations, best
        evaluations += 1
        value, slope, aux = phi(t)
        if math.isfinite(value) and math.isfinite(slope) and decreases(t, value, slope) and value <= best.value + rounding:
            best = LineSearchResult(t, value, slope, aux, evaluations, False)
        return value, slope, aux

    def done(t: float, value: float, slope: float, aux: Any) -> LineSearchResult:
        return LineSearchResult(t, value, slope, aux, evaluations, True)

    def finish() -> LineSearchResult:  # out of budget (or the bracket collapsed): the best step found, or 0
        best.evaluations = evaluations
        return best

    def zoom(lo: tuple[float, float, float, Any], hi: tuple[float, float, float, Any]) -> LineSearchResult:
        # lo: the best step with sufficient decrease so far; the minimum lies between lo and hi
        while evaluations < max_evaluations:
            low, high = min(lo[0], hi[0]), max(lo[0], hi[0])
            width = high - low
            if width <= 1e-14 * max(high, 1e-300):
                break
            if abs(lo[1] - hi[1]) <= rounding and (lo[2] < 0.0 < hi[2] or hi[2] < 0.0 < lo[2]):
                # values at rounding: the secant of the slopes finds the slope's zero
                t = lo[0] - lo[2] * (hi[0] - lo[0]) / (hi[2] - lo[2])
            else:
                t = _cubic_minimizer(*lo[:3], *hi[:3], low, high)
            if not low + 0.1 * width <= t <= high - 0.1 * width:
                t = 0.5 * (low + high)  # the interpolant lands near an end: bisect
            value, slope, aux = evaluate(t)
            if not (math.isfinite(value) and math.isfinite(slope)):
                hi = (t, math.inf, math.inf, aux)
                continue
            if not decreases(t, value, slope) or value > lo[1] + rounding:
                hi = (t, value, slope, aux)
                continue
            if curvature(slope):
                return done(t, value, slope, aux)
            if slope * (hi[0] - lo[0]) >= 0.0:
                hi = lo
            lo = (t, value, slope, aux)
        return finish()

    previous = (0.0, value0, slope0, None)
    t = step
    while evaluations < max_evaluations:
        value, slope, aux = evaluate(t)
        if not (math.isfinite(value) and math.isfinite(slope)):
            # too far (an overflow, a log of a negative number): back off towards the last good step
            t = previous[0] + 0.5 * (t - previous[0])
            continue
        current = (t, value, slope, aux)
        if not decreases(t, value, slope) or (evaluations > 1 and value > previous[1] + rounding):
            return zoom(previous, current)
        if curvature(slope):
            return done(t, value, slope, aux)
        if slope >= 0.0:
            return zoom(current, previous)
        low, high = t + 0.01 * (t - previous[0]), extrapolation * t
        previous, t = current, _cubic_minimizer(*previous[:3], t, value, slope, low, high)
    return finish()
