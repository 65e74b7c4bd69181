"""Field checks shared by the loaders: each failure is a DataError naming source, line and field."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from llm_calib.data._io import decode_line, iter_lines
from llm_calib.data.errors import DataError, ErrorLog, OnError
from llm_calib.data.records import MultipleChoice
from llm_calib.data.result import LoadResult, R

__all__ = ["domain_from_name", "labelled_choice", "load_json_lines", "parse_json_line", "require_text", "str_meta"]


def require_text(value: Any, source: str, line: int, field: str) -> str:
    """``value`` stripped, or a DataError if it is missing, not a string, or blank."""
    if value is None:
        raise DataError(source, line, field, f"missing {field}")
    if not isinstance(value, str):
        raise DataError(source, line, field, f"expected a string, got {type(value).__name__}")
    text = value.strip()
    if not text:
        what = "empty question" if "question" in field else f"empty {field}"
        raise DataError(source, line, field, what)
    return text


def parse_json_line(text: str, source: str, line: int) -> dict[str, Any]:
    """Parse one JSONL line into an object, or raise a DataError (field ``json``)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(source, line, "json", f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise DataError(source, line, "json", f"expected a JSON object, got {type(obj).__name__}")
    return obj


def labelled_choice(
    question: Any, labels: Sequence[Any], texts: Sequence[Any], answer_key: Any, *, source: str,
    line: int, domain: str, id: str, meta: Mapping[str, str] | None = None,
    question_field: str = "question", choices_field: str = "choices",
    answer_field: str = "answerKey",
) -> MultipleChoice:
    """A MultipleChoice from labelled options (``A``/``B`` or ``1``/``2``...), or a DataError."""
    q = require_text(question, source, line, question_field)
    if len(labels) != len(texts):
        raise DataError(source, line, choices_field, "labels and texts differ in length")
    if len(texts) < 2:
        raise DataError(source, line, choices_field, f"fewer than 2 options ({len(texts)})")
    label_strs = [str(label).strip() for label in labels]
    if len(set(label_strs)) != len(label_strs):
        raise DataError(source, line, choices_field, f"repeated option labels {label_strs}")
    options = tuple(require_text(t, source, line, f"{choices_field}[{i}].text") for i, t in enumerate(texts))
    if answer_key is None or (isinstance(answer_key, str) and not answer_key.strip()):
        raise DataError(source, line, answer_field, "missing answer")
    key = str(answer_key).strip()
    if key not in label_strs:
        raise DataError(
            source, line, answer_field,
            f"gold label {key!r} is not among the options {', '.join(label_strs)}",
        )
    return MultipleChoice(q, options, label_strs.index(key), domain, id, dict(meta or {}))


def str_meta(values: Mapping[str, Any]) -> dict[str, str]:
    """Meta values as strings (JSON for non-strings), dropping None."""
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in values.items() if v is not None}


def domain_from_name(name: str | Path) -> str:
    """A domain label from a name: lower case, runs of other characters become ``_``."""
    return re.sub(r"[^0-9a-z]+", "_", str(name).lower()).strip("_") or "data"


def load_json_lines(path: Path, make: Callable[[dict[str, Any], int], R], on_error: OnError) -> LoadResult[R]:
    """``make(row, line)`` of each non-blank JSON line of ``path``, bad lines under ``on_error``."""
    source = str(path)
    log = ErrorLog(on_error)
    records: list[R] = []
    for line, raw in iter_lines(path):
        if not raw.strip():
            continue
        try:
            records.append(make(parse_json_line(decode_line(raw, source, line), source, line), line))
        except DataError as err:
            log.add(err)
    return LoadResult(records, log.skipped, log.errors, source)
