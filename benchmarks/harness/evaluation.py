"""Data splits, scoring and summaries the benchmark scripts share: seeded disjoint parts of a data
set, scoring a record list with the format that fits it, the metrics of a scored set, and macro
means over groups of domains.

Benchmark-only tooling (not installed with ``llm_calib``): the benchmark scripts beside this
package import it as ``harness.evaluation``. The library's own path is
:func:`llm_calib.evaluation.evaluate.evaluate_records`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from llm_calib.confidence.token import OpenEndedSet
from llm_calib.formats import RecordKindError, ScoredResult, TaskFormat, format_for
from llm_calib.prompts.templates import PromptFormat
from llm_calib.scoring import ScoredSet

__all__ = ["group_means", "score_records", "split_items", "summarize_scored"]

T = TypeVar("T")


def split_items(items: Sequence[T], sizes: Sequence[int], seed: int = 0) -> list[list[T]]:
    """Disjoint seeded parts of ``items`` of the given sizes, each in the original order.

    Example:
        >>> train, test = split_items(range(10), [6, 3], seed=1)
        >>> len(train), len(test), set(train) & set(test)
        (6, 3, set())
    """
    if any(n < 0 for n in sizes):
        raise ValueError(f"sizes must be >= 0, got {list(sizes)}")
    if sum(sizes) > len(items):
        raise ValueError(f"sizes {list(sizes)} need {sum(sizes)} items, have {len(items)}")
    perm, out, start = np.random.default_rng(seed).permutation(len(items)), [], 0
    for n in sizes:
        out.append([items[int(i)] for i in np.sort(perm[start : start + n])])
        start += n
    return out


def score_records(
    model: Any, tokenizer: Any, records: Sequence[Any], *, scorer: str = "option_likelihood",
    normalize: str = "sum", prompt: PromptFormat | None = None, batch_size: int = 8, max_new_tokens: int = 32,
    progress: bool = False, open_prompt: PromptFormat | None = None, task: TaskFormat | None = None,
) -> ScoredSet | OpenEndedSet:
    """Score records with the format that fits them (:func:`~llm_calib.formats.format_for`, or ``task``).

    Raises:
        TypeError: the records mix multiple-choice and open questions.
        ValueError: an unknown scorer or bad arguments.

    Example:
        >>> from llm_calib.data import MultipleChoice
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> score_records(model, tok, [MultipleChoice("2 + 2 = ?", ("4", "5"), 0, "math", "q0")]).scorer
        'option_likelihood'
    """
    records = list(records)
    try:
        if task is not None:
            task.check(records)
            fmt = task
        else:
            fmt = format_for(records, scorer=scorer, normalize=normalize, prompt=prompt, open_prompt=open_prompt,
                             max_new_tokens=max_new_tokens)
    except RecordKindError as exc:
        raise TypeError(f"records must be all MultipleChoice or all OpenQA: {exc}") from exc
    return fmt.score(model, tokenizer, records, batch_size=batch_size, progress=progress)  # type: ignore[return-value]


def summarize_scored(
    scored: ScoredSet | OpenEndedSet, n_bins: int = 10, ci: bool = True, n_resamples: int = 1000, seed: int = 0
) -> dict[str, float]:
    """The calibration metrics of a scored set (its ``summary``); TypeError for anything else.

    Example:
        >>> import torch
        >>> s = ScoredSet([torch.tensor([0.0, 2.0]), torch.tensor([1.0, 0.0])], [1, 1], ["d", "d"], ["a", "b"])
        >>> summarize_scored(s, ci=False)["accuracy"]
        0.5
    """
    if not isinstance(scored, ScoredResult):
        raise TypeError(f"scored must be a scored set, a ScoredSet or an OpenEndedSet, got {type(scored).__name__}")
    return scored.summary(n_bins=n_bins, ci=ci, n_resamples=n_resamples, seed=seed)


def group_means(
    scored: ScoredSet | OpenEndedSet, groups: dict[str, Sequence[str]], metrics: Sequence[str] = ("ece", "accuracy")
) -> dict[str, float]:
    """Per group of domains, the mean of each domain's ``metrics`` (NaN for a group with none present).

    Example:
        >>> import torch
        >>> s = ScoredSet([torch.tensor([0.0, 2.0]), torch.tensor([1.0, 0.0])], [1, 1], ["a", "b"], ["0", "1"])
        >>> group_means(s, {"in": ["a"], "all": ["a", "b"]}, ["accuracy"])
        {'accuracy_in': 1.0, 'accuracy_all': 0.5}
    """
    per = {d: summarize_scored(p, ci=False) for d, p in scored.by_domain().items()}
    out = {}
    for group, domains in groups.items():
        present = [d for d in domains if d in per]
        for m in metrics:
            out[f"{m}_{group}"] = statistics.mean(per[d][m] for d in present) if present else float("nan")
    return out
