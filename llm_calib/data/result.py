"""What every loader returns: the records plus an account of the rows it skipped."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from llm_calib.data.records import MultipleChoice, OpenQA

__all__ = ["LoadResult", "subsample"]

R = TypeVar("R", MultipleChoice, OpenQA)
T = TypeVar("T")


@dataclass
class LoadResult(Generic[R]):
    """Records loaded from one ``source``, with the count and messages of ``skipped`` rows;
    ``len`` and iteration refer to ``records``.

    Example:
        >>> res = LoadResult([MultipleChoice("1 + 1 = ?", ("2", "3"), 0, "toy", "t0")])
        >>> len(res), res.kind
        (1, 'multiple_choice')
    """

    records: list[R]
    skipped: int = 0
    errors: list[str] = field(default_factory=list)
    source: str = ""

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[R]:
        return iter(self.records)

    def __getitem__(self, index: int) -> R:
        return self.records[index]

    @property
    def kind(self) -> str | None:
        """``"multiple_choice"``, ``"open"``, or None when there are no records."""
        if not self.records:
            return None
        return "multiple_choice" if isinstance(self.records[0], MultipleChoice) else "open"


def subsample(items: Sequence[T], limit: int | None, seed: int = 0) -> list[T]:
    """A seeded subsample of at most ``limit`` items (None keeps all), in their original order;
    a smaller limit picks a subset of a larger one.

    Example:
        >>> small, big = subsample(range(100), 5), subsample(range(100), 20)
        >>> set(small) <= set(big), small == sorted(small)
        (True, True)
    """
    if limit is None or limit >= len(items):
        return list(items)
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    order = np.random.default_rng(seed).permutation(len(items))[:limit]
    return [items[int(i)] for i in np.sort(order)]
