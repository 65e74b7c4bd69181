"""Validation of configuration values; every message names the field by its config path
(``objective.solver.eta``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

__all__ = ["check_int", "check_number", "is_int"]


def is_int(value: Any) -> bool:
    """True for an ``int`` that is not a ``bool``.

    Example:
        >>> is_int(3), is_int(True), is_int(3.0)
        (True, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool)


def check_number(name: str, value: Any, *, minimum: float | None = None, positive: bool = False,
                 below: float | None = None) -> float:
    """``value`` as a checked, finite float (numeric strings accepted: YAML 1.1 reads ``1e-3`` as
    one); ``minimum`` is inclusive, ``below`` exclusive.

    Example:
        >>> check_number("objective.beta", -1, minimum=0)
        Traceback (most recent call last):
        ...
        ValueError: objective.beta must be >= 0, got -1.0
    """
    number: float | None = None
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            number = float(value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    if number is None:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(number):  # inf/nan: accepted as a rate, it would blow up after model loading
        raise ValueError(f"{name} must be a finite number, got {number!r}")
    if positive and not number > 0:
        raise ValueError(f"{name} must be > 0, got {number!r}")
    if minimum is not None and not number >= minimum:
        raise ValueError(f"{name} must be >= {minimum:g}, got {number!r}")
    if below is not None and not number < below:
        raise ValueError(f"{name} must be in [{minimum or 0:g}, {below:g}), got {number!r}")
    return number


def check_int(name: str, value: Any, minimum: int | None = None) -> int:
    """``value`` checked to be an int (not a bool), at least ``minimum`` when given.

    Example:
        >>> check_int("training.steps", 3, minimum=1)
        3
    """
    if not is_int(value) or (minimum is not None and value < minimum):
        raise ValueError(f"{name} must be an int{'' if minimum is None else f' >= {minimum}'}, got {value!r}")
    return value
