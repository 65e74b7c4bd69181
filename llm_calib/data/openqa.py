"""Open-domain QA JSONL (NQ-open, WebQuestions): ``{"question": str, "answer": [alias, ...]}``.

An ``id`` is used when present, other keys are ignored; a single string answer is one alias.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from llm_calib.data._rows import domain_from_name, load_json_lines, require_text
from llm_calib.data.errors import DataError, OnError
from llm_calib.data.records import OpenQA
from llm_calib.data.result import LoadResult
from llm_calib.metrics.answers import normalize_answer

__all__ = ["answer_aliases", "load_nq_open", "load_openqa_jsonl", "load_webquestions", "one_record_per_alias"]


def answer_aliases(value: Any, source: str, line: int, field: str) -> tuple[str, ...]:
    """Accepted answers from a list of strings (or one string), stripped and deduplicated.

    Example:
        >>> answer_aliases([" Paris ", "Paris, France"], "f", 1, "answer")
        ('Paris', 'Paris, France')
    """
    if value is None or value == [] or value == "":
        raise DataError(source, line, field, "missing answer")
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list):
        raise DataError(source, line, field, f"expected a list of strings, got {type(value).__name__}")
    aliases = tuple(require_text(v, source, line, f"{field}[{i}]") for i, v in enumerate(values))
    return tuple(dict.fromkeys(aliases))


def load_openqa_jsonl(
    path: str | Path, *, domain: str | None = None, answer_field: str = "answer",
    on_error: OnError = "raise",
) -> LoadResult[OpenQA]:
    """Load ``{"question", <answer_field>: [aliases]}`` rows as open QA records (ids from ``id``,
    else ``<domain>-<line>``); raises ``DataError`` for a bad row under ``"raise"``.

    Example:
        >>> import pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp(), "qa.jsonl")
        >>> _ = p.write_text('{"question": "who wrote hamlet", "answer": ["Shakespeare"]}')
        >>> load_openqa_jsonl(p, domain="nq_open").records[0].id
        'nq_open-1'
    """
    path = Path(path)
    source = str(path)
    dom = domain or domain_from_name(path.stem)

    def record(row: dict[str, Any], line: int) -> OpenQA:
        question = require_text(row.get("question"), source, line, "question")
        answers = answer_aliases(row.get(answer_field), source, line, answer_field)
        rid = row.get("id")
        meta = {"source_file": source, "line": str(line)}
        return OpenQA(question, answers, dom, str(rid) if rid is not None else f"{dom}-{line}", meta)

    return load_json_lines(path, record, on_error)


def load_nq_open(path: str | Path, *, on_error: OnError = "raise") -> LoadResult[OpenQA]:
    """Load NQ-open (or EfficientQA) JSONL with :func:`load_openqa_jsonl`; domain ``nq_open``.

    Example:
        >>> import pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp(), "NQ-open.dev.jsonl")
        >>> _ = p.write_text('{"question": "q", "answer": ["a", "b"]}')
        >>> load_nq_open(p).records[0].domain
        'nq_open'
    """
    return load_openqa_jsonl(path, domain="nq_open", on_error=on_error)


def load_webquestions(path: str | Path, *, on_error: OnError = "raise") -> LoadResult[OpenQA]:
    """Load WebQuestions JSONL with :func:`load_openqa_jsonl`; domain ``webquestions``.

    Example:
        >>> import pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp(), "webq-test.jsonl")
        >>> _ = p.write_text('{"id": "7", "question": "q", "answer": ["a"]}')
        >>> load_webquestions(p).records[0].id
        '7'
    """
    return load_openqa_jsonl(path, domain="webquestions", on_error=on_error)


def one_record_per_alias(records: Sequence[OpenQA]) -> list[OpenQA]:
    """One record per (question, accepted answer), to train on every alias.

    Alias ``j`` of ``r`` becomes a record with ``answers=(a_j,)``, id ``f"{r.id}#{j}"`` and
    ``meta["source_id"]``; aliases equal after :func:`~llm_calib.metrics.answers.normalize_answer` count
    once, records without answers stay. For training: evaluate on the original records.

    Example:
        >>> q = OpenQA("Who sang Help!?", ("Beatles", "The Beatles", "John Lennon"), "music", "q7")
        >>> [(r.id, r.answers) for r in one_record_per_alias([q])]
        [('q7#0', ('Beatles',)), ('q7#2', ('John Lennon',))]
    """
    out: list[OpenQA] = []
    for r in records:
        if not isinstance(r, OpenQA):
            raise TypeError(f"records must be OpenQA records, got {type(r).__name__}")
        if not r.answers:
            out.append(r)
            continue
        seen: set[str] = set()
        for j, alias in enumerate(r.answers):
            key = normalize_answer(alias)
            if key in seen:
                continue
            seen.add(key)
            out.append(replace(r, answers=(alias,), id=f"{r.id}#{j}", meta={**r.meta, "source_id": r.id}))
    return out
