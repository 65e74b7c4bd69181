"""Open-ended QA: greedy answers, token-probability confidences, SQuAD exact match and F1.

The answer is the greedy continuation of the prompt (see :mod:`llm_calib.prompts`) up to the first
newline or end-of-sequence token (or the record's stop sequences, lm-eval's ``until``), decoded by the scoring engine's one greedy decoder
(:mod:`llm_calib.engine.decode`; :func:`generate_greedy`, :class:`GreedyAnswer`,
:func:`eos_token_ids` and :func:`finish_answer` are re-exported here). Its confidence is the mean probability of its tokens (product and
minimum are reported too). An answer is correct when its SQuAD-normalised form equals that of any
accepted alias; token F1 (maximum over aliases) is the soft variant.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llm_calib import metrics
from llm_calib.answers import exact_match, token_f1
from llm_calib.data.records import OpenQA
from llm_calib.engine.decode import GreedyAnswer, eos_token_ids, finish_answer, generate_greedy
from llm_calib.engine.packing import length_batches
from llm_calib.prompts import (
    PromptFormat,
    record_prompt,
    record_uses_chat_template,
    uses_chat_template,
)
from llm_calib.scoring.base import encode_prompt, progress_bar

__all__ = [
    "GreedyAnswer",
    "OpenEndedSet",
    "encode_open_prompts",
    "eos_token_ids",
    "finish_answer",
    "generate_greedy",
    "open_ended_summary",
    "score_open_ended",
]

@dataclass
class OpenEndedSet:
    """Greedy answers to open questions with confidences and correctness.

    Follows :class:`~llm_calib.formats.base.ScoredResult`, the interface it shares with
    :class:`~llm_calib.scoring.base.ScoredSet`.

    Attributes:
        answers: the generated answer texts.
        references: the accepted aliases of each question.
        domains: domain per question.
        ids: record id per question.
        token_probs: answer-token probabilities per question.
        info: settings (JSON-serialisable).
        details: per question ``prompt`` (text), ``token_ids`` (of the answer) and ``stop``
            (why generation ended), or None.

    Example:
        >>> s = OpenEndedSet(["Paris", "Rome"], [("Paris",), ("Oslo",)], ["geo", "geo"],
        ...                  ["q0", "q1"], [(0.9, 0.5), (0.2,)])
        >>> s.correct.tolist(), s.confidence("mean").round(2).tolist()
        ([True, False], [0.7, 0.2])
    """

    answers: list[str]
    references: list[tuple[str, ...]]
    domains: list[str]
    ids: list[str]
    token_probs: list[tuple[float, ...]]
    info: dict[str, Any] = field(default_factory=dict)
    details: list[dict[str, Any]] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.answers)

    def confidence(self, kind: str = "mean") -> np.ndarray:
        """Per-question confidence: ``"mean"``, ``"product"`` or ``"min"`` of the token probabilities."""
        funcs = {"mean": np.mean, "product": np.prod, "min": np.min}
        if kind not in funcs:
            raise ValueError(f"kind must be one of {tuple(funcs)}, got {kind!r}")
        return np.asarray([float(funcs[kind](p)) if p else 0.0 for p in self.token_probs])

    @property
    def correct(self) -> np.ndarray:
        """Exact match (SQuAD-normalised) against any alias."""
        return np.asarray(
            [exact_match(a, r) for a, r in zip(self.answers, self.references, strict=True)]
        )

    @property
    def f1(self) -> np.ndarray:
        """Token F1 against the best alias."""
        return np.asarray(
            [token_f1(a, r) for a, r in zip(self.answers, self.references, strict=True)]
        )

    @property
    def confidences(self) -> np.ndarray:
        """The mean token probability of each answer, clipped to ``[0, 1]`` (what the calibration
        metrics bin)."""
        return np.clip(self.confidence("mean"), 0.0, 1.0)

    @property
    def accuracy(self) -> float:
        """Fraction of exact matches (NaN for an empty set)."""
        return float(self.correct.mean()) if len(self) else float("nan")

    def summary(self, n_bins: int = 10, ci: bool = True, n_resamples: int = 1000, seed: int = 0) -> dict[str, float]:
        """The calibration metrics of the answers (:func:`open_ended_summary`)."""
        return open_ended_summary(self, n_bins=n_bins, ci=ci, n_resamples=n_resamples, seed=seed)

    def select(self, indices: Sequence[int]) -> OpenEndedSet:
        """The sub-set at ``indices``."""
        return OpenEndedSet(
            [self.answers[i] for i in indices],
            [self.references[i] for i in indices],
            [self.domains[i] for i in indices],
            [self.ids[i] for i in indices],
            [self.token_probs[i] for i in indices],
            dict(self.info),
            [self.details[i] for i in indices] if self.details is not None else None,
        )

    def by_domain(self) -> dict[str, OpenEndedSet]:
        """Split by domain, in order of first appearance."""
        groups: dict[str, list[int]] = {}
        for i, d in enumerate(self.domains):
            groups.setdefault(d, []).append(i)
        return {d: self.select(idx) for d, idx in groups.items()}

    @staticmethod
    def concat(sets: Sequence[OpenEndedSet]) -> OpenEndedSet:
        """Concatenate several sets (the first one's info is kept).

        Example:
            >>> a = OpenEndedSet(["Paris"], [("Paris",)], ["geo"], ["q0"], [(0.9,)])
            >>> len(OpenEndedSet.concat([a, a]))
            2
        """
        if not sets:
            raise ValueError("OpenEndedSet.concat needs at least one set")
        return OpenEndedSet(
            [a for s in sets for a in s.answers],
            [r for s in sets for r in s.references],
            [d for s in sets for d in s.domains],
            [i for s in sets for i in s.ids],
            [p for s in sets for p in s.token_probs],
            dict(sets[0].info),
            [d for s in sets for d in s.details]  # type: ignore[union-attr]
            if all(s.details is not None for s in sets)
            else None,
        )


def open_ended_summary(
    scored: OpenEndedSet,
    n_bins: int = 10,
    ci: bool = True,
    n_resamples: int = 1000,
    seed: int = 0,
) -> dict[str, float]:
    """Calibration metrics of open-ended answers (confidence = mean token probability).

    Keys: ``n``, ``accuracy`` (exact match), ``f1``, ``ece``, ``ece15``, ``adaptive_ece``,
    ``mce``, ``brier`` and ``nll`` (of the confidence as a probability of being correct),
    ``auroc``, ``mean_confidence``, ``ece_product``, ``ece_min`` (ECE of the product and minimum
    token-probability confidences); with ``ci``, bootstrap intervals of the headline metrics.

    Args:
        scored: greedy answers with their token probabilities.
        n_bins: equal-width bins of the ECE variants.
        ci: add 95% bootstrap intervals.
        n_resamples: bootstrap resamples.
        seed: bootstrap seed.

    Returns:
        The metrics by name.

    Example:
        >>> s = OpenEndedSet(["Paris", "Rome"], [("Paris",), ("Oslo",)], ["geo"] * 2,
        ...                  ["q0", "q1"], [(0.9,), (0.2,)])
        >>> r = open_ended_summary(s, ci=False)
        >>> r["accuracy"], round(r["brier"], 3)
        (0.5, 0.025)
    """
    c = np.clip(scored.confidence("mean"), 0.0, 1.0)
    k = scored.correct.astype(np.float64)

    def _brier(c: np.ndarray, k: np.ndarray) -> float:
        return float(np.mean((np.asarray(c) - np.asarray(k)) ** 2))

    def _nll(c: np.ndarray, k: np.ndarray) -> float:
        cc = np.clip(np.asarray(c), metrics.NLL_EPS, 1 - metrics.NLL_EPS)
        kk = np.asarray(k)
        return float(-np.mean(kk * np.log(cc) + (1 - kk) * np.log(1 - cc)))

    def _acc(c: np.ndarray, k: np.ndarray) -> float:
        return float(np.mean(k))

    funcs = {
        "accuracy": _acc,
        "ece": lambda c, k: metrics.ece(c, k, n_bins),
        "adaptive_ece": lambda c, k: metrics.adaptive_ece(c, k, n_bins),
        "brier": _brier,
        "nll": _nll,
        "auroc": metrics.auroc,
    }
    out: dict[str, float] = {"n": len(scored)}
    out.update({name: f(c, k) for name, f in funcs.items()})
    out["f1"] = float(np.mean(scored.f1)) if len(scored) else math.nan
    out["ece15"] = metrics.ece(c, k, 15)
    out["mce"] = metrics.mce(c, k, n_bins)
    out["mean_confidence"] = float(c.mean())
    out["ece_product"] = metrics.ece(np.clip(scored.confidence("product"), 0, 1), k, n_bins)
    out["ece_min"] = metrics.ece(np.clip(scored.confidence("min"), 0, 1), k, n_bins)
    if ci:
        for name, f in funcs.items():
            lo, hi = metrics.bootstrap_ci(f, c, k, n_resamples=n_resamples, seed=seed)
            out[f"{name}_ci_low"], out[f"{name}_ci_high"] = lo, hi
    return out


def encode_open_prompts(
    tokenizer: Any, records: Sequence[OpenQA], prompt: PromptFormat | None = None
) -> list[list[int]]:
    """Token ids of the prompts after which open questions are answered.

    The one place that builds open-ended prompts: greedy answering (:func:`score_open_ended`) and
    CALM training on open questions (:mod:`llm_calib.calm.trainer`) both continue these ids.

    Args:
        tokenizer: a Hugging Face tokenizer.
        records: :class:`~llm_calib.data.records.OpenQA` records.
        prompt: the prompt format (default ``PromptFormat()``); must be the cloze style.

    Returns:
        One list of ids per record.

    Raises:
        TypeError: a record that is not :class:`~llm_calib.data.records.OpenQA`.
        ValueError: a prompt style other than ``"cloze"``.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> ids = encode_open_prompts(tok, [OpenQA("Capital of France?", ("Paris",), "geo", "q0")])
        >>> tok.decode(ids[0]).endswith("The answer is:")
        True
    """
    for r in records:
        if not isinstance(r, OpenQA):
            raise TypeError(f"records must be OpenQA records, got {type(r).__name__}")
    fmt = prompt or PromptFormat()
    if fmt.style != "cloze":
        raise ValueError(
            f"open questions have no options to list: prompt.style must be 'cloze', got {fmt.style!r}"
        )
    chat = uses_chat_template(tokenizer, fmt)
    return [encode_prompt(tokenizer, record_prompt(tokenizer, r, fmt), chat=chat and record_uses_chat_template(tokenizer, r, fmt))
            for r in records]


def score_open_ended(
    model: Any,
    tokenizer: Any,
    records: Sequence[OpenQA],
    *,
    prompt: PromptFormat | None = None,
    max_new_tokens: int = 32,
    batch_size: int = 8,
    progress: bool = False,
) -> OpenEndedSet:
    """Answer open questions greedily and record confidences.

    Args:
        model: a Hugging Face causal LM.
        tokenizer: its tokenizer.
        records: :class:`~llm_calib.data.records.OpenQA` records.
        prompt: the prompt format (default ``PromptFormat()``: chat template, question only,
            ``The answer is:``).
        max_new_tokens: generation budget per answer.
        batch_size: questions generated together.
        progress: show a tqdm progress bar.

    Returns:
        An :class:`OpenEndedSet`.

    Raises:
        TypeError: a record that is not :class:`~llm_calib.data.records.OpenQA`.
        ValueError: ``batch_size < 1`` or a prompt style other than ``"cloze"``.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> s = score_open_ended(model, tok, [OpenQA("Capital of France?", ("Paris",), "geo", "q0")],
        ...                      max_new_tokens=3)
        >>> 0.0 < float(s.confidence("mean")[0]) <= 1.0
        True
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    records = list(records)
    fmt = prompt or PromptFormat()
    prompts = encode_open_prompts(tokenizer, records, fmt)
    chat = uses_chat_template(tokenizer, fmt)
    answers: list[GreedyAnswer | None] = [None] * len(records)
    bar = progress_bar(total=len(records), desc="open-ended", enabled=progress)
    try:
        for idx in length_batches([len(p) for p in prompts], batch_size):
            outs = generate_greedy(model, tokenizer, [prompts[i] for i in idx], max_new_tokens=max_new_tokens,
                                   until=[records[i].until for i in idx])  # a record's stop sequences (lm-eval)
            for i, o in zip(idx, outs, strict=True):
                answers[i] = o
            bar.update(len(idx))
    finally:
        bar.close()
    done = [a for a in answers if a is not None]
    return OpenEndedSet(
        answers=[a.text for a in done],
        references=[tuple(r.answers) for r in records],
        domains=[r.domain for r in records],
        ids=[r.id for r in records],
        token_probs=[a.token_probs for a in done],
        info={
            "max_new_tokens": max_new_tokens,
            "chat_template": chat,
            "answer_prefix": fmt.answer_prefix,
            "template": fmt.template,
            "fewshot": fmt.fewshot,
        },
        details=[
            {"prompt": record_prompt(tokenizer, r, fmt), "token_ids": list(a.token_ids), "stop": a.stop}
            for r, a in zip(records, done, strict=True)
        ],
    )
