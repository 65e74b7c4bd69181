"""The error every loader raises on bad input, and the raise-or-skip policy around it."""

from __future__ import annotations

from typing import Literal

__all__ = ["MAX_ERRORS", "DataError", "ErrorLog", "OnError"]

OnError = Literal["raise", "skip"]
"""What a loader does with a bad row, ``"raise"`` a :class:`DataError` or ``"skip"`` it."""

MAX_ERRORS = 100
"""How many messages of skipped rows a :class:`ErrorLog` keeps (the count is never capped)."""


class DataError(ValueError):
    """A row of a data file that cannot become a record: ``"<source>:<line>: <field>: <reason>"``.

    ``line`` is 1-based (the row for hub datasets; 0 for the whole file).

    Example:
        >>> str(DataError("arc.jsonl", 3, "answerKey", "missing answer"))
        'arc.jsonl:3: answerKey: missing answer'
    """

    def __init__(self, source: str, line: int, field: str, reason: str) -> None:
        self.source = str(source)
        self.line = int(line)
        self.field = field
        self.reason = reason
        super().__init__(f"{self.source}:{self.line}: {field}: {reason}")

    def __reduce__(self) -> tuple[type[DataError], tuple[str, int, str, str]]:
        return (type(self), (self.source, self.line, self.field, self.reason))


class ErrorLog:
    """Applies an :data:`OnError` policy: re-raises, or counts skipped rows (keeping up to
    ``max_errors`` messages).

    Example:
        >>> log = ErrorLog("skip")
        >>> log.add(DataError("f.csv", 2, "answer", "missing answer"))
        >>> log.skipped
        1
    """

    def __init__(self, on_error: OnError = "raise", max_errors: int = MAX_ERRORS) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.on_error: OnError = on_error
        self.max_errors = max_errors
        self.skipped = 0
        self.errors: list[str] = []

    def add(self, error: DataError) -> None:
        """Raise ``error`` (policy ``"raise"``) or record it as one skipped row."""
        if self.on_error == "raise":
            raise error
        self.skipped += 1
        if len(self.errors) < self.max_errors:
            self.errors.append(str(error))

    def merge(self, skipped: int, errors: list[str]) -> None:
        """Fold in the skipped count and messages of another load."""
        self.skipped += skipped
        room = max(self.max_errors - len(self.errors), 0)
        self.errors.extend(errors[:room])
