"""Open-ended QA: greedy answers (the engine's decoder, :mod:`llm_calib.engine.decode`) up to a newline,
end of sequence or the record's stop sequences (lm-eval's ``until``), the mean answer-token probability
as confidence, SQuAD exact match and token F1 against any alias.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from llm_calib.data.records import OpenQA
from llm_calib.engine.decode import generate_greedy
from llm_calib.engine.generation import GreedyAnswer
from llm_calib.metrics import calibration as metrics
from llm_calib.metrics.answers import exact_match, token_f1
from llm_calib.prompts.templates import (
    PromptFormat,
    record_prompt,
    uses_chat_template,
)
from llm_calib.scoring.base import ScoredResult, encode_prompts, score_in_batches

__all__ = ["OpenEndedSet", "encode_open_prompts", "open_ended_summary", "score_open_ended"]


@dataclass
class OpenEndedSet(ScoredResult):
    """Greedy answers to open questions (a :class:`~llm_calib.scoring.base.ScoredResult`): per question
    the answer text, the accepted aliases (``references``), domain, id and answer-token
    probabilities; ``info`` (settings) and ``details`` (``prompt``, answer ``token_ids``, ``stop``).

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

    per_question: ClassVar[tuple[str, ...]] = ("answers", "references", "domains", "ids", "token_probs")

    def confidence(self, kind: str = "mean") -> np.ndarray:
        """Per-question confidence: ``"mean"``, ``"product"`` or ``"min"`` of the token probabilities."""
        funcs = {"mean": np.mean, "product": np.prod, "min": np.min}
        if kind not in funcs:
            raise ValueError(f"kind must be one of {tuple(funcs)}, got {kind!r}")
        return np.asarray([float(funcs[kind](p)) if p else 0.0 for p in self.token_probs])

    @property
    def correct(self) -> np.ndarray:
        """Exact match (SQuAD-normalised) against any alias."""
        return np.asarray([exact_match(a, r) for a, r in zip(self.answers, self.references, strict=True)])

    @property
    def f1(self) -> np.ndarray:
        """Token F1 against the best alias."""
        return np.asarray([token_f1(a, r) for a, r in zip(self.answers, self.references, strict=True)])

    @property
    def confidences(self) -> np.ndarray:
        """The mean token probability of each answer, clipped to ``[0, 1]``."""
        return np.clip(self.confidence("mean"), 0.0, 1.0)

    def summary(self, n_bins: int = 10, ci: bool = True, n_resamples: int = 1000, seed: int = 0) -> dict[str, float]:
        """The calibration metrics of the answers (:func:`open_ended_summary`)."""
        return open_ended_summary(self, n_bins=n_bins, ci=ci, n_resamples=n_resamples, seed=seed)


def open_ended_summary(
    scored: OpenEndedSet, n_bins: int = 10, ci: bool = True, n_resamples: int = 1000, seed: int = 0,
) -> dict[str, float]:
    """Calibration metrics of open-ended answers (confidence = mean token probability): ``n``,
    ``accuracy`` (exact match), ``f1``, the ECE family, ``brier``, ``nll``, ``auroc``,
    ``mean_confidence``, ``ece_product`` / ``ece_min`` (other confidences); with ``ci``, bootstrap intervals.

    Example:
        >>> s = OpenEndedSet(["Paris", "Rome"], [("Paris",), ("Oslo",)], ["geo"] * 2,
        ...                  ["q0", "q1"], [(0.9,), (0.2,)])
        >>> r = open_ended_summary(s, ci=False)
        >>> r["accuracy"], round(r["brier"], 3)
        (0.5, 0.025)
    """
    c = np.clip(scored.confidence("mean"), 0.0, 1.0)
    k = scored.correct.astype(np.float64)
    base = metrics.binary_summary(c, k, n_bins=n_bins, ci=ci, n_resamples=n_resamples, seed=seed)
    extra = {
        "f1": float(np.mean(scored.f1)) if len(scored) else math.nan,
        "ece_product": metrics.ece(np.clip(scored.confidence("product"), 0, 1), k, n_bins),
        "ece_min": metrics.ece(np.clip(scored.confidence("min"), 0, 1), k, n_bins),
    }
    head = ("n", "accuracy", "ece", "adaptive_ece", "brier", "nll", "auroc", "f1", "ece15", "mce",
            "mean_confidence", "ece_product", "ece_min")  # the key order reports and JSON files have always had
    merged = {**base, **extra}
    out = {key: merged[key] for key in head}
    out.update((key, value) for key, value in base.items() if key not in out)
    return out


def encode_open_prompts(
    tokenizer: Any, records: Sequence[OpenQA], prompt: PromptFormat | None = None,
    reserve: int | Sequence[int] | None = None,
) -> list[list[int]]:
    """Token ids of the prompts after which open questions are answered (scoring and training alike);
    TypeError for a record that is not ``OpenQA``, ValueError for a prompt style other than ``"cloze"``.
    ``reserve``: the answer tokens after each prompt (the generation budget, or the reference answer
    trained on), with which it is fitted to the model's context (:func:`~llm_calib.scoring.base.encode_prompts`).

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
        raise ValueError(f"open questions have no options to list: prompt.style must be 'cloze', got {fmt.style!r}")
    return encode_prompts(tokenizer, records, fmt, reserve=reserve)


def score_open_ended(
    model: Any, tokenizer: Any, records: Sequence[OpenQA], *, prompt: PromptFormat | None = None,
    max_new_tokens: int = 32, batch_size: int = 8, progress: bool = False, temperature: float = 1.0,
) -> OpenEndedSet:
    """Answer open questions greedily (up to a newline, EOS or a record's stop sequences; at most
    ``max_new_tokens``) under ``prompt`` (default ``PromptFormat()``) and record token probabilities.

    With ``temperature`` T the token probabilities are the deployed model's at T,
    ``softmax(z / T)`` of the same logits (a temperature-scaled model answers the same greedily);
    ``info["temperature"]`` records T.

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
    prompts = encode_open_prompts(tokenizer, records, fmt, reserve=max_new_tokens)
    chat = uses_chat_template(tokenizer, fmt)
    scaled = temperature != 1.0
    def answer(idx: list[int]) -> list[GreedyAnswer]:
        return generate_greedy(model, tokenizer, [prompts[i] for i in idx], max_new_tokens=max_new_tokens,
                               until=[records[i].until for i in idx],  # a record's stop sequences (lm-eval)
                               temperatures=[temperature] if scaled else None)

    done = score_in_batches([len(p) for p in prompts], batch_size, answer, desc="open-ended", progress=progress)
    info = {"max_new_tokens": max_new_tokens, "chat_template": chat, "answer_prefix": fmt.answer_prefix,
            "template": fmt.template, "fewshot": fmt.fewshot, **({"temperature": temperature} if scaled else {})}
    details = [{"prompt": record_prompt(tokenizer, r, fmt), "token_ids": list(a.token_ids), "stop": a.stop}
               for r, a in zip(records, done, strict=True)]
    return OpenEndedSet([a.text for a in done], [tuple(r.answers) for r in records], [r.domain for r in records],
                        [r.id for r in records],
                        [tuple(float(p) for p in a.temp_probs[:, 0]) if scaled else a.token_probs for a in done],
                        info, details)
