"""AI2-style multiple-choice JSONL (ARC, OpenBookQA, CommonsenseQA, QASC):
``{"id", "question": {"stem", "choices": [{"label", "text"}, ...]}, "answerKey"}`` per line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llm_calib.data._rows import domain_from_name, labelled_choice, load_json_lines
from llm_calib.data.errors import DataError, OnError
from llm_calib.data.records import MultipleChoice
from llm_calib.data.result import LoadResult

__all__ = ["AI2_DATASETS", "ai2_domain", "load_ai2"]

AI2_DATASETS: tuple[str, ...] = ("arc_easy", "arc_challenge", "openbookqa", "commonsenseqa", "qasc")
"""Domain labels of the AI2-format datasets, as used in the spec grammar and in results."""

_ALIASES = {"arc-easy": "arc_easy", "arc-challenge": "arc_challenge", "commonsense_qa": "commonsenseqa"}


def ai2_domain(path: str | Path) -> str:
    """The nearest path component naming a known AI2 dataset, else the file stem.

    Example:
        >>> ai2_domain("data/arc_challenge/test.jsonl"), ai2_domain("x/openbookqa.jsonl")
        ('arc_challenge', 'openbookqa')
    """
    p = Path(path)
    for part in reversed([*p.parent.parts, p.stem]):
        name = _ALIASES.get(part.lower(), part.lower())
        if name in AI2_DATASETS:
            return name
    return domain_from_name(p.stem)


def load_ai2(path: str | Path, *, domain: str | None = None, on_error: OnError = "raise") -> LoadResult[MultipleChoice]:
    """Load an AI2-format JSONL file as multiple-choice records (domain: :func:`ai2_domain`); a bad
    row (invalid UTF-8 or JSON, empty stem, < 2 choices, ``answerKey`` not a label) is a ``DataError``.

    Example:
        >>> import json, pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp(), "arc_easy.jsonl")
        >>> choices = [{"label": "A", "text": "star"}, {"label": "B", "text": "planet"}]
        >>> row = {"question": {"stem": "Sun?", "choices": choices}, "answerKey": "A"}
        >>> _ = p.write_text(json.dumps(row))
        >>> rec = load_ai2(p).records[0]
        >>> rec.options, rec.gold, rec.domain
        (('star', 'planet'), 0, 'arc_easy')
    """
    path = Path(path)
    source = str(path)
    dom = domain or ai2_domain(path)

    def record(row: dict[str, Any], line: int) -> MultipleChoice:
        question = row.get("question")
        if isinstance(question, dict):
            stem, choices = question.get("stem"), question.get("choices")
        else:  # flat variant: {"question": str, "choices": [...]}
            stem, choices = question, row.get("choices")
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise DataError(source, line, "question.choices", "expected a list of {label, text}")
        rid = row.get("id")
        return labelled_choice(
            stem, [c.get("label", chr(ord("A") + i)) for i, c in enumerate(choices)],
            [c.get("text") for c in choices], row.get("answerKey"), source=source, line=line,
            domain=dom, id=str(rid) if rid is not None else f"{dom}-{line}",
            meta={"source_file": source, "line": str(line)},
            question_field="question.stem", choices_field="question.choices",
        )

    return load_json_lines(path, record, on_error)
