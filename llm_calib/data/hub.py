"""Hugging Face hub datasets (the optional ``datasets`` package) mapped onto the local loaders'
records: :data:`HUB_DATASETS` by a dedicated mapping, other names by :mod:`llm_calib.data.jsonl`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from llm_calib.data._rows import domain_from_name, labelled_choice, require_text
from llm_calib.data.errors import DataError, ErrorLog, OnError
from llm_calib.data.jsonl import mc_from_dict, openqa_from_dict
from llm_calib.data.mmlu import mmlu_group
from llm_calib.data.openqa import answer_aliases
from llm_calib.data.records import MultipleChoice, OpenQA
from llm_calib.data.result import LoadResult

__all__ = ["HUB_DATASETS", "HubDataset", "hub_row_to_record", "load_hub"]

Record = MultipleChoice | OpenQA
_Mapper = Callable[[Mapping[str, Any], str, int, str, str], Record]


@dataclass(frozen=True)
class HubDataset:
    """How to read one hub dataset: default ``config`` and ``split``, and the ``mapper``
    ``(row, config, index, source, rid_prefix) -> record``.

    Example:
        >>> HUB_DATASETS["cais/mmlu"].split
        'test'
    """

    name: str
    config: str | None
    split: str
    mapper: _Mapper


def _choices(row: Mapping[str, Any], source: str, line: int) -> tuple[list[Any], list[Any]]:
    choices = row.get("choices")
    if isinstance(choices, Mapping):  # datasets' Sequence feature: {"label": [...], "text": [...]}
        labels, texts = list(choices.get("label") or []), list(choices.get("text") or [])
    elif isinstance(choices, list) and all(isinstance(c, Mapping) for c in choices):
        labels, texts = [c.get("label") for c in choices], [c.get("text") for c in choices]
    else:
        raise DataError(source, line, "choices", "expected {label: [...], text: [...]}")
    if not labels:
        labels = [chr(ord("A") + i) for i in range(len(texts))]
    return labels, texts


def _labelled(domain_of: Callable[[str], str], question_key: str = "question") -> _Mapper:
    def mapper(row: Mapping[str, Any], config: str, index: int, source: str, prefix: str) -> Record:
        line = index + 1
        labels, texts = _choices(row, source, line)
        domain = domain_of(config)
        rid = row.get("id")
        return labelled_choice(
            row.get(question_key), labels, texts, row.get("answerKey"),
            source=source, line=line, domain=domain, id=str(rid) if rid else f"{prefix}-{line}",
            meta={"source_file": source, "line": str(line)}, question_field=question_key,
        )  # fmt: skip

    return mapper


def _mmlu(row: Mapping[str, Any], config: str, index: int, source: str, prefix: str) -> Record:
    line = index + 1
    choices = row.get("choices")
    if not isinstance(choices, list):
        raise DataError(source, line, "choices", "expected a list of option texts")
    answer = row.get("answer")
    if answer is None:
        raise DataError(source, line, "answer", "missing answer")
    if isinstance(answer, str) and len(answer.strip()) == 1 and answer.strip().isalpha():
        answer = ord(answer.strip().upper()) - ord("A")
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise DataError(source, line, "answer", f"expected an index, got {answer!r}")
    subject = str(row.get("subject") or (config if config != "all" else ""))
    group = mmlu_group(subject)
    labels = [chr(ord("A") + i) for i in range(len(choices))]
    key = labels[answer] if 0 <= answer < len(labels) else str(answer)
    meta = {"subject": subject, "group": group or "", "source_file": source, "line": str(line)}
    return labelled_choice(
        row.get("question"), labels, choices, key,
        source=source, line=line, domain=f"mmlu_{group}" if group else "mmlu",
        id=f"{prefix}-{line}", meta=meta, answer_field="answer",
    )  # fmt: skip


def _open(domain: str, answer_key: str) -> _Mapper:
    def mapper(row: Mapping[str, Any], config: str, index: int, source: str, prefix: str) -> Record:
        line = index + 1
        question = require_text(row.get("question"), source, line, "question")
        answers = answer_aliases(row.get(answer_key), source, line, answer_key)
        rid = row.get("id")
        meta = {"source_file": source, "line": str(line)}
        return OpenQA(question, answers, domain, str(rid) if rid else f"{prefix}-{line}", meta)

    return mapper


def _generic(row: Mapping[str, Any], config: str, index: int, source: str, prefix: str) -> Record:
    line = index + 1
    domain = domain_from_name(prefix)
    if "options" in row:
        return mc_from_dict(row, source=source, line=line, domain=domain)
    if "answers" in row:
        return openqa_from_dict(row, source=source, line=line, domain=domain)
    raise DataError(source, line, "options", 'unknown hub dataset: rows need "options" or "answers"')


HUB_DATASETS: dict[str, HubDataset] = {d.name: d for d in (
    HubDataset("cais/mmlu", "all", "test", _mmlu),
    HubDataset("allenai/ai2_arc", "ARC-Easy", "test", _labelled(domain_from_name)),
    HubDataset("allenai/openbookqa", "main", "test", _labelled(lambda c: "openbookqa", "question_stem")),
    HubDataset("tau/commonsense_qa", None, "validation", _labelled(lambda c: "commonsenseqa")),
    HubDataset("allenai/qasc", None, "validation", _labelled(lambda c: "qasc")),
    HubDataset("google-research-datasets/nq_open", None, "validation", _open("nq_open", "answer")),
    HubDataset("stanfordnlp/web_questions", None, "test", _open("webquestions", "answers")),
)}
"""The hub datasets with a dedicated mapping, by hub name."""

_ALIASES = {
    "ai2_arc": "allenai/ai2_arc", "openbookqa": "allenai/openbookqa",
    "commonsense_qa": "tau/commonsense_qa", "qasc": "allenai/qasc",
    "nq_open": "google-research-datasets/nq_open", "web_questions": "stanfordnlp/web_questions",
}  # fmt: skip


def _resolve(name: str, config: str | None, split: str | None) -> tuple[HubDataset | None, str | None, str]:
    """The dataset's entry, and the config and split with its defaults filled in."""
    entry = HUB_DATASETS.get(_ALIASES.get(name, name))
    cfg = config if config is not None else (entry.config if entry else None)
    return entry, cfg, split if split is not None else (entry.split if entry else "train")


def _source(name: str, config: str | None, split: str) -> str:
    return f"hf:{name}" + (f"/{config}" if config else "") + f"[{split}]"


def hub_row_to_record(
    name: str, row: Mapping[str, Any], *, index: int = 0, config: str | None = None,
    split: str | None = None,
) -> MultipleChoice | OpenQA:
    """Map one row of a hub dataset (or short alias, e.g. ``ai2_arc``) to a record, as
    :func:`load_hub` does; raises ``DataError`` for an invalid row.

    Example:
        >>> row = {"question": "Which is a star?", "answerKey": "A",
        ...        "choices": {"text": ["Sun", "Moon"], "label": ["A", "B"]}}
        >>> hub_row_to_record("allenai/ai2_arc", row, config="ARC-Challenge").domain
        'arc_challenge'
    """
    entry, cfg, spl = _resolve(name, config, split)
    source = _source(name, cfg, spl)
    if not isinstance(row, Mapping):
        raise DataError(source, index + 1, "row", f"expected a mapping, got {type(row).__name__}")
    prefix = f"{name.rsplit('/', 1)[-1]}-{cfg + '-' if cfg else ''}{spl}"
    mapper = entry.mapper if entry else _generic
    return mapper(row, cfg or "", index, source, prefix)


def load_hub(
    name: str, *, config: str | None = None, split: str | None = None, on_error: OnError = "raise",
    **load_kwargs: Any,
) -> LoadResult[MultipleChoice] | LoadResult[OpenQA]:
    """Load a hub dataset with ``datasets.load_dataset`` (``**load_kwargs`` passed on) as records;
    ``ImportError`` without ``datasets``, ``DataError`` for a bad row.

    Example:
        >>> import importlib.util
        >>> try:
        ...     ok = importlib.util.find_spec("datasets") is not None or load_hub("cais/mmlu")
        ... except ImportError as e:
        ...     ok = "pip install datasets" in str(e)
        >>> ok
        True
    """
    try:
        datasets = importlib.import_module("datasets")
    except ImportError as exc:
        raise ImportError(
            f"loading the hub dataset {name!r} needs the optional package `datasets` "
            "(pip install datasets) and internet access or a filled Hugging Face cache; "
            "local copies load without it, e.g. 'arc_easy:path/to/test.jsonl'"
        ) from exc
    entry, cfg, spl = _resolve(name, config, split)
    hub_name = entry.name if entry else name
    dataset = datasets.load_dataset(hub_name, cfg, split=spl, **load_kwargs)
    log = ErrorLog(on_error)
    records: list[Any] = []
    for index, row in enumerate(dataset):
        try:
            records.append(hub_row_to_record(hub_name, row, index=index, config=cfg, split=spl))
        except DataError as err:
            log.add(err)
    return LoadResult(records, log.skipped, log.errors, _source(hub_name, cfg, spl))
