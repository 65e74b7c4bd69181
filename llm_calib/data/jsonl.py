"""The generic JSONL schemas, for your own data sets (one object per line).

Multiple choice: ``{"question", "options": [str, ...], "answer"}`` (an index, an option's text
or a letter); open QA: ``{"question", "answers": [str, ...] or str}``; instruction data (a
(prompt, response) pair, e.g. the lower level of the CALM paper's protocol): ``{"prompt",
"response"}`` or Alpaca's ``{"instruction", "input" (optional, may be empty), "output"}``; all
with optional ``domain``, ``id`` and ``meta``. Instruction rows become open records
(:class:`~llm_calib.data.records.OpenQA`, the response as the one reference answer): training
fits the response tokens after the prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from llm_calib.data._rows import domain_from_name, load_json_lines, require_text, str_meta
from llm_calib.data.errors import DataError, OnError
from llm_calib.data.openqa import answer_aliases
from llm_calib.data.records import MultipleChoice, OpenQA
from llm_calib.data.result import LoadResult

__all__ = ["INSTRUCTION_FIELDS", "JsonlKind", "distinct_options", "instruction_from_dict", "load_jsonl",
           "mc_from_dict", "openqa_from_dict", "resolve_answer"]

JsonlKind = Literal["auto", "mc", "open", "instruction"]
"""Schema for :func:`load_jsonl` (detect from the first row, multiple choice, open QA, or
instruction (prompt, response) pairs)."""

INSTRUCTION_FIELDS = {"prompt": ("prompt", "response"), "alpaca": ("instruction", "output")}
"""The two instruction-data schemas by name: (prompt field, response field). Alpaca's optional
``input`` is appended to its ``instruction`` after a blank line."""


def resolve_answer(answer: Any, options: tuple[str, ...], source: str, line: int) -> int:
    """The 0-based gold index of a generic-schema ``answer`` (index, option text, or letter).

    Example:
        >>> opts = ("red", "green", "blue")
        >>> [resolve_answer(a, opts, "f", 1) for a in (2, "green", "A")]
        [2, 1, 0]
    """
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise DataError(source, line, "answer", "missing answer")
    if isinstance(answer, bool) or not isinstance(answer, int | str):
        raise DataError(
            source, line, "answer", f"expected an int or a string, got {type(answer).__name__}"
        )
    if isinstance(answer, int):
        if not 0 <= answer < len(options):
            raise DataError(
                source, line, "answer",
                f"gold index {answer} is not among the options 0-{len(options) - 1}",
            )
        return answer
    text = answer.strip()
    matches = [i for i, option in enumerate(options) if option == text]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise DataError(
            source, line, "answer", f"answer {text!r} matches several options {matches}"
        )
    if len(text) == 1 and "A" <= text <= "Z" and ord(text) - ord("A") < len(options):
        return ord(text) - ord("A")
    last = chr(ord("A") + len(options) - 1)
    raise DataError(
        source, line, "answer",
        f"gold label {text!r} is not among the options {options} (nor a letter A-{last})",
    )


def distinct_options(options: tuple[str, ...], gold: int, source: str, line: int, *,
                     merge: bool = False) -> tuple[tuple[str, ...], int]:
    """``(options, gold)`` when no two options have the same text. Two identical options get the
    same score up to float noise, so which one is "correct" would be decided by that noise: a
    ``DataError`` naming ``source:line`` and both indices, or with ``merge`` each text kept once
    (its first place) and ``gold`` moved to its text's place.

    Example:
        >>> distinct_options(("Paris", "Rome", "Paris"), 2, "f.jsonl", 3, merge=True)
        (('Paris', 'Rome'), 0)
        >>> distinct_options(("Paris", "Rome", "Paris"), 2, "f.jsonl", 3)
        Traceback (most recent call last):
        llm_calib.data.errors.DataError: f.jsonl:3: options: options[0] and options[2] are both 'Paris'; identical options score alike up to float noise: remove one, or merge them (jsonl:PATH:merge_duplicates)
    """
    first: dict[str, int] = {}
    for i, text in enumerate(options):
        if text in first and not merge:
            raise DataError(source, line, "options",
                            f"options[{first[text]}] and options[{i}] are both {text!r}; identical options score "
                            "alike up to float noise: remove one, or merge them (jsonl:PATH:merge_duplicates)")
        first.setdefault(text, i)
    if len(first) == len(options):
        return options, gold
    kept = tuple(first)
    if len(kept) < 2:
        raise DataError(source, line, "options", f"fewer than 2 distinct options ({kept})")
    return kept, kept.index(options[gold])


def _id_and_meta(
    row: Mapping[str, Any], domain: str, source: str, line: int
) -> tuple[str, str, dict[str, str]]:
    dom = row.get("domain")
    dom = dom.strip() if isinstance(dom, str) and dom.strip() else domain
    rid = row.get("id")
    meta_in = row.get("meta")
    if meta_in is not None and not isinstance(meta_in, dict):
        raise DataError(source, line, "meta", "expected an object")
    meta = str_meta(meta_in or {})
    meta.setdefault("source_file", source)
    meta.setdefault("line", str(line))
    return dom, str(rid) if rid is not None else f"{dom}-{line}", meta


def mc_from_dict(row: Mapping[str, Any], *, source: str, line: int, domain: str,
                 merge_duplicates: bool = False) -> MultipleChoice:
    """A multiple-choice record from a generic-schema row (``domain`` if the row has none); two
    options of the same text are an error, or merged with ``merge_duplicates``
    (:func:`distinct_options`).

    Example:
        >>> mc_from_dict({"question": "2+2?", "options": ["3", "4"], "answer": "4"},
        ...              source="f", line=1, domain="toy").gold
        1
    """
    question = require_text(row.get("question"), source, line, "question")
    raw_options = row.get("options")
    if not isinstance(raw_options, list):
        raise DataError(source, line, "options", "expected a list of strings")
    if len(raw_options) < 2:
        raise DataError(source, line, "options", f"fewer than 2 options ({len(raw_options)})")
    options = tuple(
        require_text(o, source, line, f"options[{i}]") for i, o in enumerate(raw_options)
    )
    gold = resolve_answer(row.get("answer"), options, source, line)
    options, gold = distinct_options(options, gold, source, line, merge=merge_duplicates)
    dom, rid, meta = _id_and_meta(row, domain, source, line)
    return MultipleChoice(question, options, gold, dom, rid, meta)


def openqa_from_dict(row: Mapping[str, Any], *, source: str, line: int, domain: str) -> OpenQA:
    """An open QA record from a generic-schema row (``domain`` if the row has none).

    Example:
        >>> openqa_from_dict({"question": "Capital of Peru?", "answers": ["Lima"]},
        ...                  source="f", line=3, domain="geo").id
        'geo-3'
    """
    question = require_text(row.get("question"), source, line, "question")
    answers = answer_aliases(row.get("answers"), source, line, "answers")
    dom, rid, meta = _id_and_meta(row, domain, source, line)
    return OpenQA(question, answers, dom, rid, meta)


def instruction_from_dict(row: Mapping[str, Any], *, source: str, line: int, domain: str) -> OpenQA:
    """An open record from an instruction-data row: ``{"prompt", "response"}`` or Alpaca's
    ``{"instruction", "input", "output"}`` (``input`` optional; when not blank it follows the
    instruction after a blank line). The response is the one reference answer.

    Raises:
        DataError: a missing, non-string or blank prompt / instruction or response / output, a
            non-string ``input``, or a row mixing the two schemas (naming file, line and field).

    Example:
        >>> r = instruction_from_dict({"instruction": "Translate to French.", "input": "cat", "output": "chat"},
        ...                           source="f", line=2, domain="alpaca")
        >>> r.question, r.answers, r.id
        ('Translate to French.\\n\\ncat', ('chat',), 'alpaca-2')
    """
    schemas = [name for name, fields in INSTRUCTION_FIELDS.items() if any(f in row for f in fields)]
    if len(schemas) != 1:
        raise DataError(source, line, "prompt", 'an instruction row needs "prompt" and "response", or Alpaca\'s '
                        '"instruction" and "output" (not both schemas in one row)')
    prompt_field, response_field = INSTRUCTION_FIELDS[schemas[0]]
    prompt = require_text(row.get(prompt_field), source, line, prompt_field)
    if schemas[0] == "alpaca":
        extra = row.get("input")
        if extra is not None and not isinstance(extra, str):
            raise DataError(source, line, "input", f"expected a string, got {type(extra).__name__}")
        if extra and extra.strip():
            prompt = f"{prompt}\n\n{extra.strip()}"
    response = require_text(row.get(response_field), source, line, response_field)
    dom, rid, meta = _id_and_meta(row, domain, source, line)
    return OpenQA(prompt, (response,), dom, rid, meta)


def _row_kind(row: Mapping[str, Any]) -> str | None:
    if "options" in row:
        return "mc"
    if "answers" in row:
        return "open"
    if any(f in row for fields in INSTRUCTION_FIELDS.values() for f in fields):
        return "instruction"
    return None


_MAKERS = {"mc": mc_from_dict, "open": openqa_from_dict, "instruction": instruction_from_dict}
_KIND_FIELD = {"mc": "options", "open": "answers", "instruction": "response"}


def load_jsonl(
    path: str | Path, *, kind: JsonlKind = "auto", domain: str | None = None,
    on_error: OnError = "raise", merge_duplicates: bool = False,
) -> LoadResult[MultipleChoice] | LoadResult[OpenQA]:
    """Load a JSONL file in the generic schema; ``kind`` is ``"mc"``, ``"open"``, ``"instruction"``
    or ``"auto"`` (the first row's), ``domain`` defaults to the file stem; options of the same
    text in one row are an error unless ``merge_duplicates`` (:func:`distinct_options`).

    Raises ``DataError`` for invalid UTF-8 or JSON, a bad question, options, answer, prompt or
    response, or a row of another kind than the file's.

    Example:
        >>> import pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp(), "colours.jsonl")
        >>> _ = p.write_text('{"question": "Sky?", "options": ["blue", "green"], "answer": "A"}')
        >>> [(r.domain, r.gold) for r in load_jsonl(p)]
        [('colours', 0)]
    """
    if kind not in ("auto", *_MAKERS):
        raise ValueError(f"kind must be 'auto', 'mc', 'open' or 'instruction', got {kind!r}")
    path = Path(path)
    source = str(path)
    dom = domain or domain_from_name(path.stem)
    file_kind = None if kind == "auto" else kind

    def record(row: dict[str, Any], line: int) -> MultipleChoice | OpenQA:
        nonlocal file_kind
        row_kind = _row_kind(row)
        if row_kind is None:
            raise DataError(
                source, line, "options",
                'a row needs "options" (multiple choice), "answers" (open QA) or "prompt" and '
                '"response" (instruction data; Alpaca\'s "instruction", "input", "output" too)',
            )
        if file_kind is None:
            file_kind = row_kind
        elif row_kind != file_kind:
            want = _KIND_FIELD[file_kind]
            raise DataError(
                source, line, want, f"this file holds {file_kind!r} rows, which need {want!r}"
            )
        if file_kind == "mc":
            return mc_from_dict(row, source=source, line=line, domain=dom, merge_duplicates=merge_duplicates)
        return _MAKERS[file_kind](row, source=source, line=line, domain=dom)

    return load_json_lines(path, record, on_error)
