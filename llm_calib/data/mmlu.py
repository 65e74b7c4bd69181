"""MMLU CSV files ``<subject>_<split>.csv``: rows ``question,A,B,C,D,answer_letter``, no header."""

from __future__ import annotations

import csv
from collections.abc import Iterator, Sequence
from pathlib import Path

from llm_calib.data._io import decode_line, iter_lines
from llm_calib.data.errors import DataError, ErrorLog, OnError
from llm_calib.data.records import MultipleChoice
from llm_calib.data.result import LoadResult

__all__ = ["MMLU_GROUPS", "MMLU_SPLITS", "MMLU_SUBJECTS", "load_mmlu", "mmlu_group", "mmlu_subject"]

MMLU_GROUPS: dict[str, tuple[str, ...]] = {
    "stem": (
        "abstract_algebra", "astronomy", "college_biology", "college_chemistry",
        "college_computer_science", "college_mathematics", "college_physics", "computer_security",
        "conceptual_physics", "electrical_engineering", "elementary_mathematics",
        "high_school_biology", "high_school_chemistry", "high_school_computer_science",
        "high_school_mathematics", "high_school_physics", "high_school_statistics",
        "machine_learning",
    ),
    "humanities": (
        "formal_logic", "high_school_european_history", "high_school_us_history",
        "high_school_world_history", "international_law", "jurisprudence", "logical_fallacies",
        "moral_disputes", "moral_scenarios", "philosophy", "prehistory", "professional_law",
        "world_religions",
    ),
    "social_sciences": (
        "econometrics", "high_school_geography", "high_school_government_and_politics",
        "high_school_macroeconomics", "high_school_microeconomics", "high_school_psychology",
        "human_sexuality", "professional_psychology", "public_relations", "security_studies",
        "sociology", "us_foreign_policy",
    ),
    "other": (
        "anatomy", "business_ethics", "clinical_knowledge", "college_medicine", "global_facts",
        "human_aging", "management", "marketing", "medical_genetics", "miscellaneous", "nutrition",
        "professional_accounting", "professional_medicine", "virology",
    ),
}  # fmt: skip
"""The 57 MMLU subjects by group (18 STEM, 13 humanities, 12 social sciences, 14 other)."""

MMLU_SUBJECTS: tuple[str, ...] = tuple(sorted(s for group in MMLU_GROUPS.values() for s in group))
"""All 57 standard subjects, sorted."""

MMLU_SPLITS: tuple[str, ...] = ("dev", "val", "test")
"""Split suffixes of MMLU file names (``dev`` holds the 5 few-shot examples per subject)."""

_GROUP_OF = {s: g for g, subjects in MMLU_GROUPS.items() for s in subjects}
_LETTERS = "ABCD"


def mmlu_group(subject: str) -> str | None:
    """The group of a standard MMLU subject, or None if the subject is not a standard one.

    Example:
        >>> mmlu_group("college_physics"), mmlu_group("jurisprudence"), mmlu_group("cooking")
        ('stem', 'humanities', None)
    """
    return _GROUP_OF.get(subject)


def mmlu_subject(path: str | Path) -> tuple[str, str | None]:
    """``(subject, split)`` from a file name ``<subject>_<split>.csv``; split None if absent.

    Example:
        >>> mmlu_subject("data/mmlu/test/high_school_us_history_test.csv")
        ('high_school_us_history', 'test')
    """
    stem = Path(path).stem
    subject, _, split = stem.rpartition("_")
    if subject and split in MMLU_SPLITS:
        return subject, split
    return stem, None


def _csv_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"MMLU path {path} does not exist")
    return sorted(p for p in path.iterdir() if p.suffix == ".csv" and p.is_file())


def load_mmlu(
    path: str | Path, *, groups: Sequence[str] | None = None, subjects: Sequence[str] | None = None,
    on_error: OnError = "raise",
) -> LoadResult[MultipleChoice]:
    """Load one MMLU CSV file or every ``*.csv`` of a directory (sorted), filtered by ``groups`` and
    ``subjects``; ids ``<file stem>-<row>``. Raises ``DataError`` (bad row, no files selected),
    ``ValueError`` (unknown group) or ``FileNotFoundError``.

    Example:
        >>> import pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp(), "astronomy_test.csv")
        >>> _ = p.write_text('"Closest star?",Sun,Vega,Sirius,Rigel,A\\n')
        >>> rec = load_mmlu(p).records[0]
        >>> rec.domain, rec.gold, rec.meta["subject"]
        ('mmlu_stem', 0, 'astronomy')
    """
    path = Path(path)
    if groups is not None:
        unknown = sorted(set(groups) - set(MMLU_GROUPS))
        if unknown:
            raise ValueError(f"unknown MMLU group(s) {unknown}; valid: {', '.join(MMLU_GROUPS)}")
    files = []
    for f in _csv_files(path):
        subject, _ = mmlu_subject(f)
        if groups is not None and mmlu_group(subject) not in groups:
            continue
        if subjects is not None and subject not in subjects:
            continue
        files.append(f)
    if not files:
        what = f" for groups {list(groups)}" if groups else ""
        what += f" for subjects {list(subjects)}" if subjects else ""
        raise DataError(str(path), 0, "path", f"no MMLU csv files{what}")
    log = ErrorLog(on_error)
    records: list[MultipleChoice] = []
    for f in files:
        records.extend(_load_file(f, log))
    return LoadResult(records, log.skipped, log.errors, str(path))


def _load_file(path: Path, log: ErrorLog) -> list[MultipleChoice]:
    source = str(path)
    subject, split = mmlu_subject(path)
    group = mmlu_group(subject)
    domain = f"mmlu_{group}" if group else "mmlu"
    bad_lines: dict[int, DataError] = {}

    def text_lines() -> Iterator[str]:
        for number, raw in iter_lines(path):
            try:
                text = decode_line(raw, source, number)
            except DataError as err:
                bad_lines[number] = err
                text = raw.decode("utf-8", errors="replace")
            yield text + "\n"

    reader = csv.reader(text_lines())
    records: list[MultipleChoice] = []
    first_line, row_number = 1, 0
    for row in reader:
        line, first_line = first_line, reader.line_num + 1
        if not any(cell.strip() for cell in row):
            continue
        row_number += 1
        try:
            for n in range(line, reader.line_num + 1):
                if n in bad_lines:
                    raise bad_lines[n]
            records.append(_row_to_record(row, source, line, subject, split, group, domain, row_number))
        except DataError as err:
            log.add(err)
    return records


def _row_to_record(
    row: list[str], source: str, line: int, subject: str, split: str | None, group: str | None,
    domain: str, row_number: int,
) -> MultipleChoice:
    if len(row) != 6:
        raise DataError(source, line, "row", f"expected 6 columns (question, A, B, C, D, answer), got {len(row)}")
    question, *options, answer = (cell.strip() for cell in row)
    if not question:
        raise DataError(source, line, "question", "empty question")
    for letter, option in zip(_LETTERS, options, strict=True):
        if not option:
            raise DataError(source, line, letter, f"empty option {letter}")
    if not answer:
        raise DataError(source, line, "answer", "missing answer")
    if answer.upper() not in _LETTERS:
        raise DataError(source, line, "answer", f"gold label {answer!r} is not among the options A, B, C, D")
    meta = {"subject": subject, "group": group or "", "split": split or "", "source_file": source, "line": str(line)}
    rid = f"{Path(source).stem}-{row_number}"
    return MultipleChoice(question, tuple(options), _LETTERS.index(answer.upper()), domain, rid, meta)
