"""Semantic confidence of any lm-eval generation run, from its ``--log_samples`` file.

lm-eval's ``generate_until`` tasks log each question's responses (``resps``) but no probabilities,
so no calibration metric can be read off them, and chat or API models give no multiple-choice
log-likelihoods at all. Run the task with ``repeats: N`` and sampling in its
``generation_kwargs`` (``do_sample: true``, a temperature), and each question has N sampled
answers: :func:`read_generation_samples` clusters them by answer equivalence and returns a
:class:`~llm_calib.confidence.sampled.SampledSet` (modal answer, its semantic confidence, correctness
against lm-eval's own ``target``, a string or a list of aliases), whose ``summary`` gives Sem-ECE,
AECE, Brier, AUROC and accuracy with bootstrap intervals. See :doc:`/tutorials/open_ended`.

Example:
    >>> import json, tempfile, pathlib
    >>> row = {"doc_id": 0, "doc": {}, "target": ["Paris", "City of Light"], "filter": "none",
    ...        "arguments": {"gen_args_0": {"arg_0": "Q: Capital of France?\\nA:", "arg_1": {"until": ["\\n"]}}},
    ...        "resps": [[" Paris", " paris", " Lyon"]], "filtered_resps": [" Paris"]}
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "samples_geo_2026-01-02T10-11-12.5.jsonl"
    >>> _ = p.write_text(json.dumps(row) + "\\n")
    >>> s = read_generation_samples(p, estimator="plug_in")
    >>> s.ids, s.answers, s.correct.tolist(), round(float(s.confidences[0]), 3)
    (['geo/0'], ['Paris'], [True], 0.667)
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from llm_calib.confidence.sampled import SampledSet
from llm_calib.confidence.semantic import ESTIMATORS, Equivalence, answer_equivalence
from llm_calib.data.lm_eval_logs import rows_by_doc, samples_task_name

__all__ = ["is_generation_row", "read_generation_samples"]

def _first_request(arguments: Any) -> Any:
    """The first request's arguments: ``{"gen_args_0": {"arg_0": .., "arg_1": ..}}`` in files, a list in memory."""
    if isinstance(arguments, Mapping):
        first = min(arguments, key=lambda k: int(str(k).rsplit("_", 1)[-1]))
        return [arguments[first].get("arg_0"), arguments[first].get("arg_1")]
    return arguments[0] if arguments else None


def is_generation_row(row: Mapping[str, Any]) -> bool:
    """Whether an lm-eval samples row comes from a ``generate_until`` task (its request's second
    argument is the generation settings, a dict), not from a log-likelihood task.

    Example:
        >>> is_generation_row({"arguments": {"gen_args_0": {"arg_0": "Q", "arg_1": {"until": ["\\n"]}}}})
        True
        >>> is_generation_row({"arguments": {"gen_args_0": {"arg_0": "Q", "arg_1": " A"}}})
        False
    """
    first = _first_request(row.get("arguments"))
    return isinstance(first, (list, tuple)) and len(first) == 2 and isinstance(first[1], Mapping)


def _aliases(target: Any, where: str) -> tuple[str, ...]:
    if isinstance(target, str):
        return (target,)
    if isinstance(target, (list, tuple)) and target and all(isinstance(t, str) for t in target):
        return tuple(target)
    raise ValueError(f"{where}: target {target!r} is neither a string nor a list of accepted answers")


def _responses(row: Mapping[str, Any], where: str, pattern: re.Pattern[str] | None) -> tuple[str, ...]:
    resps = row.get("resps")
    if not isinstance(resps, list) or len(resps) != 1 or not isinstance(resps[0], list):
        raise ValueError(f"{where}: 'resps' is not one list of responses (a generate_until row has [[r1, …, rN]])")
    out = []
    for r in resps[0]:
        text = str(r)
        if pattern is not None:  # as lm-eval's regex filter: the first match's group 1 (else the match)
            m = pattern.search(text)
            text = (m.group(1) if m.groups() else m.group(0)) if m else "[invalid]"
        out.append(text.strip())
    return tuple(out)


def read_generation_samples(
    path: str | os.PathLike[str], *, task: str | None = None, rows: Sequence[Mapping[str, Any]] | None = None,
    equivalence: str | Equivalence = "exact", threshold: float = 0.5, estimator: str = "sample_split",
    splits: int = 10, seed: int = 0, response_regex: str | None = None, min_samples: int = 2,
) -> SampledSet:
    """The sampled answers of one lm-eval ``generate_until`` task, as a :class:`~llm_calib.confidence.sampled.SampledSet`.

    Args:
        path: a ``samples_<task>_<date>.jsonl`` file of ``lm_eval --log_samples``.
        task: the domain of its questions; default: the task name in the file name.
        rows: the samples themselves (``simple_evaluate(...)["samples"][task]``) instead of the file.
        equivalence: ``"exact"``, ``"f1"`` or a function ``(a, b) -> bool``.
        threshold: for ``"f1"``.
        estimator: ``"sample_split"`` (default) or ``"plug_in"``.
        splits: R, the sample splits averaged.
        seed: seeds the splits (question ``i`` uses ``seed + i``, as :func:`~llm_calib.confidence.sampled.score_sampled`).
        response_regex: a per-response filter like lm-eval's ``regex`` filter (group 1 of the first
            match, ``"[invalid]"`` without one), for tasks whose answers are extracted from longer text.
        min_samples: the fewest responses a question may have (semantic confidence needs ``>= 2``).

    Returns:
        The questions by ``doc_id`` (the first filter's rows), ids ``<task>/<doc_id>``, ``details``
        with the prompt and lm-eval's logged metrics.

    Raises:
        ValueError: not a ``generate_until`` samples file, an empty or non-UTF-8 file, a malformed
            line or target, or questions with fewer than ``min_samples`` responses (the message names
            the file and line, and says to run lm-eval with ``repeats``).

    Example:
        >>> rows = [{"doc_id": 0, "target": "4", "arguments": [["2+2=", {"until": ["\\n"]}]],
        ...          "resps": [["4", "4", "5", "4"]], "filtered_resps": ["4"]}]
        >>> read_generation_samples("math.jsonl", rows=rows).summary(ci=False)["accuracy"]
        1.0
    """
    path = Path(path)
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    same = answer_equivalence(equivalence, threshold=threshold) if isinstance(equivalence, str) else equivalence
    pattern = re.compile(response_regex) if response_regex is not None else None
    name = task or samples_task_name(path)
    samples, references, ids, details = [], [], [], []
    first_filter = "none"
    for doc_id, line_no, row in rows_by_doc(path, rows):
        first_filter = row.get("filter", "none")
        where = f"{path}:{line_no}"
        if not is_generation_row(row):
            raise ValueError(f"{where}: not a generate_until row (its request has no generation settings); "
                             "multiple-choice samples files are read by llm_calib.evaluation.lm_eval_samples.read_samples")
        answers = _responses(row, where, pattern)
        if len(answers) < min_samples:
            raise ValueError(
                f"{where}: {len(answers)} response(s) for this question; semantic confidence needs at least "
                f"{min_samples} sampled answers per question: run the lm-eval task with `repeats: N` (N >= 2) and "
                "`do_sample: true` in its generation_kwargs"
            )
        samples.append(answers)
        references.append(_aliases(row.get("target"), where))
        ids.append(f"{name}/{doc_id}")
        context = _first_request(row["arguments"])[0]
        details.append({"prompt": context, "lm_eval": {k: v for k, v in row.items()
                                                       if isinstance(v, (int, float)) and k != "doc_id"}})
    info = {"estimator": estimator, "splits": int(splits), "seed": int(seed), "n": max(len(s) for s in samples),
            "source": str(path), "filter": first_filter,
            "equivalence": equivalence if isinstance(equivalence, str) else getattr(equivalence, "__name__", "custom")}
    if info["equivalence"] == "f1":
        info["threshold"] = threshold
    if response_regex is not None:
        info["response_regex"] = response_regex
    return SampledSet(samples, references, [name] * len(ids), ids, None, info, details, same)
