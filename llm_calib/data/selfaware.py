"""SelfAware (Yin et al. 2023): ``{"example": [{question, answer, answerable, source}, ...]}``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from llm_calib.data._io import decode_line, iter_lines
from llm_calib.data._rows import require_text
from llm_calib.data.errors import DataError, ErrorLog, OnError
from llm_calib.data.openqa import answer_aliases
from llm_calib.data.records import OpenQA
from llm_calib.data.result import LoadResult

__all__ = ["SelfAwareKeep", "filter_selfaware", "load_selfaware"]

SelfAwareKeep = Literal["all", "answerable", "triviaqa"]
"""Which SelfAware questions :func:`load_selfaware` keeps."""


def _example_lines(text: str, count: int) -> list[int]:
    """1-based line of each element of the top-level ``"example"`` array (0 when unknown)."""
    match = re.search(r'"example"\s*:\s*\[', text)
    lines = [0] * count
    if match is None:
        return lines
    decoder = json.JSONDecoder()
    pos, line = match.end(), text.count("\n", 0, match.end()) + 1
    ws = re.compile(r"[\s,]*")
    for i in range(count):
        start = ws.match(text, pos).end()  # type: ignore[union-attr]
        if start >= len(text) or text[start] == "]":
            break
        line += text.count("\n", pos, start)
        lines[i] = line
        try:
            _, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            break
        line += text.count("\n", start, end)
        pos = end
    return lines


def load_selfaware(path: str | Path, *, keep: SelfAwareKeep = "all", on_error: OnError = "raise") -> LoadResult[OpenQA]:
    """Load ``SelfAware.json`` as open QA records (domain ``selfaware``, id ``question_id``);
    ``keep`` is ``"all"``, ``"answerable"`` or ``"triviaqa"``. Raises ``DataError`` for a bad
    example (line of its opening brace) or a file that is not JSON with an ``example`` list.

    Example:
        >>> import json, pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp(), "SelfAware.json")
        >>> _ = p.write_text(json.dumps({"example": [{"question_id": 2, "question": "Q?",
        ...     "answer": None, "answerable": False, "source": "SelfAware"}]}))
        >>> [(r.id, r.answerable) for r in load_selfaware(p)]
        [('2', False)]
    """
    if keep not in ("all", "answerable", "triviaqa"):
        raise ValueError(f"keep must be 'all', 'answerable' or 'triviaqa', got {keep!r}")
    path = Path(path)
    source = str(path)
    text = "\n".join(decode_line(raw, source, n) for n, raw in iter_lines(path))
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(source, exc.lineno, "json", f"invalid JSON ({exc.msg})") from None
    examples = doc.get("example") if isinstance(doc, dict) else None
    if not isinstance(examples, list):
        raise DataError(source, 1, "example", 'expected an object with an "example" list')
    lines = _example_lines(text, len(examples))
    log = ErrorLog(on_error)
    records: list[OpenQA] = []
    for i, (example, line) in enumerate(zip(examples, lines, strict=True)):
        try:
            record = _to_record(example, i, source, line)
        except DataError as err:
            log.add(err)
            continue
        records.append(record)
    if keep != "all":
        records = filter_selfaware(records, sources=("triviaqa",) if keep == "triviaqa" else None)
    return LoadResult(records, log.skipped, log.errors, source)


def _to_record(example: Any, index: int, source: str, line: int) -> OpenQA:
    prefix = f"example[{index}]"
    if not isinstance(example, dict):
        raise DataError(source, line, prefix, "expected an object")
    question = require_text(example.get("question"), source, line, f"{prefix}.question")
    answerable = example.get("answerable")
    if not isinstance(answerable, bool):
        raise DataError(source, line, f"{prefix}.answerable", f"expected true/false, got {answerable!r}")
    raw_answer = example.get("answer")
    if not answerable and raw_answer in (None, [], ""):
        answers: tuple[str, ...] = ()
    else:
        answers = answer_aliases(raw_answer, source, line, f"{prefix}.answer")
    src = example.get("source")
    qid = example.get("question_id", index + 1)
    meta = {"source": str(src) if src is not None else "",
            "answerable": "true" if answerable else "false", "line": str(line)}
    return OpenQA(question, answers, "selfaware", str(qid), meta, answerable=answerable)


def filter_selfaware(
    records: Iterable[OpenQA], *, answerable: bool | None = True,
    sources: Sequence[str] | None = ("triviaqa",),
) -> list[OpenQA]:
    """Keep SelfAware records by answerability (None keeps both) and ``meta["source"]`` prefix.

    Example:
        >>> recs = [OpenQA("a?", ("x",), "selfaware", "1", {"source": "triviaqa_dev"}),
        ...         OpenQA("b?", ("y",), "selfaware", "2", {"source": "squadqa_train"})]
        >>> [r.id for r in filter_selfaware(recs)]
        ['1']
    """
    prefixes = tuple(s.lower() for s in sources) if sources is not None else None
    kept = []
    for r in records:
        if answerable is not None and r.answerable != answerable:
            continue
        if prefixes is not None and not r.meta.get("source", "").lower().startswith(prefixes):
            continue
        kept.append(r)
    return kept
