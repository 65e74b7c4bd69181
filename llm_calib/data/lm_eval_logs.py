"""lm-eval's ``--log_samples`` files as data: the task a file holds (``samples_<task>_<date>.jsonl``),
its rows (one JSON object a line) and its rows one per document, with errors naming file and line.
Read by the calibration of multiple-choice logs (:mod:`llm_calib.evaluation.lm_eval_samples`) and of
generation logs (:mod:`llm_calib.confidence.lm_eval_generations`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["check_samples_file", "first_row", "iter_rows", "rows_by_doc", "samples_task_name"]

_FILE_NAME = re.compile(r"^samples_(?P<task>.+)_(?P<date>\d{4}-\d{2}-\d{2}T[0-9.\-]+)$")


def samples_task_name(path: str | os.PathLike[str]) -> str:
    """The task name in an lm-eval samples file name (``samples_<task>_<date>.jsonl``), else the file's stem.

    Example:
        >>> samples_task_name("out/model/samples_arc_easy_2026-01-02T10-11-12.123456.jsonl")
        'arc_easy'
    """
    stem = Path(path).name.removesuffix(".jsonl")
    m = _FILE_NAME.match(stem)
    return m.group("task") if m else stem


def check_samples_file(path: str | os.PathLike[str]) -> Path:
    """``path`` as a path when it is a file; a missing file or a folder is an error naming it (a
    folder's error lists the samples files inside it).

    Raises:
        FileNotFoundError: no such file.
        IsADirectoryError: ``path`` is a folder.

    Example:
        >>> import tempfile
        >>> check_samples_file(tempfile.mkdtemp())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        IsADirectoryError: ...: is a folder, not a samples file; give a samples_<task>_<date>.jsonl file (none inside it)
    """
    p = Path(path)
    if p.is_dir():
        inside = sorted(str(f.relative_to(p)) for f in p.rglob("samples_*.jsonl"))[:5]
        found = f"inside it: {', '.join(inside)}" if inside else "none inside it"
        raise IsADirectoryError(f"{p}: is a folder, not a samples file; give a samples_<task>_<date>.jsonl file "
                                f"({found})")
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such samples file")
    return p


def iter_rows(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, row)`` of every non-empty line of a samples file; ValueError naming the file
    and line for a line that is not UTF-8 or not JSON (and :func:`check_samples_file`'s errors).

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "samples_t.jsonl"
        >>> _ = p.write_text('\\n{"doc_id": 3}\\n')
        >>> list(iter_rows(p))
        [(2, {'doc_id': 3})]
    """
    path = check_samples_file(path)
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not UTF-8 text (byte {err.start} of the line); an lm-eval "
                                 "samples file is UTF-8 JSON lines") from None
            if line.strip():
                try:
                    yield line_no, json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{line_no}: not JSON: {err}") from None


def rows_by_doc(path: str | os.PathLike[str],
                rows: Sequence[Mapping[str, Any]] | None = None) -> list[tuple[int, int, Mapping[str, Any]]]:
    """The rows of the file's first filter, one per ``doc_id`` in ``doc_id`` order, as
    ``(doc_id, line number, row)``; ``rows``: the samples themselves instead of the file (numbered
    from 1). ValueError naming the file when there are no samples, and naming both lines when a
    ``doc_id`` comes twice under one filter (lm-eval logs a document once: two runs' samples
    appended into one file would count each question twice, or one of them silently).

    Example:
        >>> rows = [{"doc_id": 1, "filter": "a"}, {"doc_id": 0, "filter": "a"}, {"doc_id": 0, "filter": "b"}]
        >>> [(d, line) for d, line, _ in rows_by_doc("x.jsonl", rows)]
        [(0, 2), (1, 1)]
    """
    items = list(enumerate(rows, 1)) if rows is not None else list(iter_rows(path))
    if not items:
        raise ValueError(f"{path}: no samples")
    first_filter = items[0][1].get("filter", "none")
    by_doc: dict[int, tuple[int, Mapping[str, Any]]] = {}
    for line_no, row in items:
        if row.get("filter", "none") == first_filter:
            doc_id = int(row["doc_id"]) if "doc_id" in row else line_no - 1
            if doc_id in by_doc:
                raise ValueError(f"{path}:{line_no}: doc_id {doc_id} again (first at line {by_doc[doc_id][0]}, filter "
                                 f"{first_filter!r}); lm-eval logs each document once: were two runs' samples "
                                 "put into one file? Keep one run's rows")
            by_doc[doc_id] = (line_no, row)
    return [(doc_id, *by_doc[doc_id]) for doc_id in sorted(by_doc)]


def first_row(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The first row of a samples file (None for an empty one); ValueError naming the file and
    line for a line that is not JSON or a file that is not UTF-8.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "s.jsonl"
        >>> _ = p.write_text('\\n{"doc_id": 3}\\n')
        >>> first_row(p)
        {'doc_id': 3}
    """
    for _, row in iter_rows(path):
        return row
    return None
