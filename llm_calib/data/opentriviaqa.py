"""OpenTriviaQA category files: blocks of a ``#Q`` question, a ``^`` answer line and options
``A``, ``B``, ...; the real files' quirks are in :doc:`/tutorials/evaluate_llm` ("Data specs").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from llm_calib.data._io import decode_line, iter_lines
from llm_calib.data._rows import domain_from_name
from llm_calib.data.errors import DataError, ErrorLog, OnError
from llm_calib.data.records import MultipleChoice
from llm_calib.data.result import LoadResult

__all__ = ["OPENTRIVIAQA_CATEGORIES", "load_opentriviaqa"]

OPENTRIVIAQA_CATEGORIES: tuple[str, ...] = (
    "animals", "brain-teasers", "celebrities", "entertainment", "for-kids", "general", "geography", "history",
    "hobbies", "humanities", "literature", "movies", "music", "newest", "people", "rated", "religion-faith",
    "science-technology", "sports", "television", "video-games", "world",
)  # fmt: skip
"""The 22 category files of the upstream repository."""

_OPTION = re.compile(r"([A-Z])(?:[ \t](.*))?")


@dataclass
class _Block:
    line: int
    question: list[str]
    answer: str | None = None
    answer_line: int = 0
    options: list[str] = field(default_factory=list)
    error: DataError | None = None
    repaired: bool = False


def _category_files(path: Path, categories: Sequence[str] | None) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"OpenTriviaQA path {path} does not exist")
    if (path / "categories").is_dir():
        path = path / "categories"
    available = {
        p.name: p
        for p in path.iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and p.suffix.lower() not in (".md", ".txt")
        and p.name.upper() != "LICENSE"
    }
    if categories is None:
        return [available[name] for name in sorted(available)]
    missing = [c for c in categories if c not in available]
    if missing:
        raise DataError(
            str(path), 0, "category",
            f"unknown categories {missing}; available: {', '.join(sorted(available))}",
        )
    return [available[c] for c in categories]


def load_opentriviaqa(
    path: str | Path, *, categories: Sequence[str] | None = None, repair_encoding: bool = True,
    on_error: OnError = "raise",
) -> LoadResult[MultipleChoice]:
    """Load OpenTriviaQA category files (a file, the ``categories`` directory or its parent) as
    multiple-choice records with ids ``<category>-<line of #Q>``, lines that are not UTF-8 repaired
    unless ``repair_encoding`` is False. Raises ``DataError`` (bad block) or ``FileNotFoundError``.

    Example:
        >>> import pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp(), "geography")
        >>> _ = p.write_text("#Q Largest ocean?\\n^ Pacific\\nA Atlantic\\nB Pacific\\n")
        >>> rec = load_opentriviaqa(p).records[0]
        >>> rec.options, rec.gold, rec.id
        (('Atlantic', 'Pacific'), 1, 'geography-1')
    """
    path = Path(path)
    log = ErrorLog(on_error)
    records: list[MultipleChoice] = []
    for f in _category_files(path, categories):
        records.extend(_load_file(f, repair_encoding, log))
    return LoadResult(records, log.skipped, log.errors, str(path))


def _load_file(path: Path, repair: bool, log: ErrorLog) -> list[MultipleChoice]:
    source = str(path)
    category = path.name
    domain = f"opentriviaqa_{domain_from_name(category)}"
    blocks: list[_Block] = []
    block: _Block | None = None
    for line, raw in iter_lines(path):
        bad: DataError | None = None
        repaired = False
        try:
            text = decode_line(raw, source, line)
        except DataError as err:
            text, repaired = decode_line(raw, source, line, repair=True), repair
            bad = None if repair else err
        if text.startswith("#Q"):
            block = _Block(line, [text[2:].strip()], repaired=repaired, error=bad)
            blocks.append(block)
            continue
        if block is None:
            if bad is not None:
                log.add(bad)
            elif text.strip():
                log.add(DataError(source, line, "#Q", "text before the first '#Q' question"))
            continue
        block.repaired |= repaired
        if bad is not None and block.error is None:
            block.error = bad
        if block.answer is None:
            if text.startswith("^"):
                block.answer, block.answer_line = text[1:].strip(), line
            else:
                block.question.append(text.strip())
            continue
        if not text.strip():
            continue
        m = _OPTION.fullmatch(text.rstrip())
        expected = chr(ord("A") + len(block.options))
        if m is None or m.group(1) != expected:
            if block.error is None:
                block.error = DataError(source, line, "options", f"expected option {expected!r}, got {text[:40]!r}")
            continue
        block.options.append((m.group(2) or "").strip())

    records = []
    for b in blocks:
        try:
            records.append(_block_to_record(b, source, category, domain))
        except DataError as err:
            log.add(err)
    return records


def _block_to_record(b: _Block, source: str, category: str, domain: str) -> MultipleChoice:
    if b.error is not None:
        raise b.error
    question = "\n".join(q for q in b.question if q)
    if not question:
        raise DataError(source, b.line, "#Q", "empty question")
    if b.answer is None:
        raise DataError(source, b.line, "^", "missing answer (no '^' line before the next question)")
    if not b.answer:
        raise DataError(source, b.answer_line, "^", "missing answer (empty '^' line)")
    options = list(dict.fromkeys(o for o in b.options if o))  # empty and repeated ones dropped
    if b.answer not in options:
        raise DataError(source, b.answer_line, "^", f"gold label {b.answer!r} is not among the options {options}")
    if len(options) < 2:
        raise DataError(source, b.line, "options", f"fewer than 2 options ({len(options)})")
    meta = {"category": category, "source_file": source, "line": str(b.line)}
    if len(options) != len(b.options):
        meta["dropped_options"] = str(len(b.options) - len(options))
    if b.repaired:
        meta["encoding"] = "repaired"
    return MultipleChoice(question, tuple(options), options.index(b.answer), domain, f"{category}-{b.line}", meta)
