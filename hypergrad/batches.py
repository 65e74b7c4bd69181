"""Batches for methods that take several steps per call: one fresh batch per step.

A method that runs several inner steps (or several stochastic products) inside one
``hypergrad(...)`` call reads its batches through :func:`per_step`: a :class:`StepBatches`
passed as ``inner_batch`` (or ``outer_batch``) yields a fresh batch for every step; any other
value is one batch reused for all of them.

A method that reads both its ``inner_batch`` and its ``outer_batch`` this way says so with the
class attribute ``takes_step_batches: ClassVar[bool] = True``; :func:`hypergrad.solve` then
hands it a :class:`StepBatches` over each stream of batches, so every step draws a fresh
batch. Without the attribute (``Implicit``, ``FiniteDifference``, a user's own method) the
driver passes one batch per call.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["StepBatches", "per_step"]


@dataclass(frozen=True)
class StepBatches:
    """Per-step batches: step ``i`` of a call uses the ``i``-th batch drawn.

    Wrap a sequence or an iterator (e.g. ``iter(loader)``) of batches and pass it as
    ``inner_batch`` (or ``outer_batch``) to a method that takes several steps per call
    (:class:`~hypergrad.unrolled.Unrolled`, and every method that reads its batches through
    :func:`per_step`). Each call draws exactly as many batches as it takes steps from
    ``iter(batches)``: a list is read from its start on every call (extra entries are ignored),
    an iterator is consumed, so consecutive calls see fresh batches. Fewer batches than steps
    raises :class:`ValueError`. Any batch that is not a ``StepBatches`` (a tensor, a tuple
    ``(x, y)``, ``None``, ...) is one batch reused for all steps.

    Args:
        batches: a sequence or an iterator of batches.

    Example:
        >>> from hypergrad.batches import StepBatches
        >>> StepBatches([0, 1, 2]).take(2)
        [0, 1]
        >>> stream = StepBatches(iter(range(10)))
        >>> stream.take(2), stream.take(3)      # an iterator is consumed: fresh batches each call
        ([0, 1], [2, 3, 4])
    """

    batches: Iterable[Any]

    def take(self, n: int) -> list[Any]:
        """Return the next ``n`` batches of ``iter(batches)``.

        Raises:
            ValueError: fewer than ``n`` batches are left.
        """
        iterator = iter(self.batches)
        out: list[Any] = []
        for _ in range(n):
            try:
                out.append(next(iterator))
            except StopIteration:
                break
        if len(out) < n:
            raise ValueError(
                f"inner_batch=StepBatches(...) yielded {len(out)} batch(es), "
                f"but steps={n} are needed"
            )
        return out


def per_step(batch: Any, n: int) -> list[Any]:
    """The ``n`` batches of ``n`` steps: fresh ones from a :class:`StepBatches`, else ``batch`` n times.

    Args:
        batch: a :class:`StepBatches`, or any single batch (reused for every step).
        n: the number of steps (>= 0).

    Returns:
        A list of ``n`` batches.

    Raises:
        ValueError: a ``StepBatches`` holds fewer than ``n`` batches.

    Example:
        >>> from hypergrad.batches import StepBatches, per_step
        >>> per_step("b", 3), per_step(StepBatches(iter("xyz")), 2)
        (['b', 'b', 'b'], ['x', 'y'])
    """
    if isinstance(batch, StepBatches):
        return batch.take(n)
    return [batch] * n
