"""The confidence of open-ended answers, four ways (one option of ``evaluate`` and the Python API).

=============== ====================================================================== ============================
kind            the answer and its confidence                                          cost per question
=============== ====================================================================== ============================
``token``       greedy answer; mean (or product, min) answer-token probability         one greedy decode
``semantic``    modal answer of N samples; the frequency of its meaning cluster        one prompt pass + N decodes
                (Sem-ECE; :mod:`llm_calib.confidence.semantic`)
``p_true``      greedy answer; the model's P(True) that it is correct                  greedy decode + one pass
                (Kadavath et al., 2022; :mod:`llm_calib.confidence.p_true`)
``verbalized``  greedy answer; the confidence 0-100 the model states when asked        greedy decode + a short one
                (:mod:`llm_calib.confidence.verbalized`); unparsed replies counted
=============== ====================================================================== ============================

:func:`score_open` dispatches on :class:`OpenConfidence`; ``token`` and ``semantic`` return an
:class:`~llm_calib.confidence.token.OpenEndedSet` / :class:`~llm_calib.confidence.sampled.SampledSet`,
``p_true`` and ``verbalized`` a :class:`JudgedSet` (greedy answers plus the second opinion).

Example:
    >>> OpenConfidence("semantic", samples=5).sampling.n
    5
    >>> OpenConfidence("mean")
    Traceback (most recent call last):
    ...
    ValueError: confidence must be one of ('token', 'semantic', 'p_true', 'verbalized'), got 'mean'
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from llm_calib.confidence.p_true import P_TRUE_CHOICES, P_TRUE_PROMPT, p_true
from llm_calib.confidence.sampled import SampledSet, score_sampled
from llm_calib.confidence.semantic import EQUIVALENCE_KINDS, ESTIMATORS
from llm_calib.confidence.token import OpenEndedSet, score_open_ended
from llm_calib.confidence.verbalized import (
    VERBALIZED_PROMPT,
    parse_verbalized_replies,
    verbalized_prompt,
)
from llm_calib.data.records import OpenQA
from llm_calib.engine.context import fit_prompt
from llm_calib.engine.decode import generate_greedy
from llm_calib.engine.sampling import SamplingSettings
from llm_calib.metrics import calibration as metrics
from llm_calib.prompts.templates import PromptFormat
from llm_calib.scoring.base import ScoredResult, encode_prompt, record_label

__all__ = ["OPEN_CONFIDENCE_KINDS", "JudgedSet", "OpenConfidence", "score_open"]

OPEN_CONFIDENCE_KINDS: tuple[str, ...] = ("token", "semantic", "p_true", "verbalized")
"""The confidence kinds of open-ended answers (see the module's table)."""


@dataclass(frozen=True)
class OpenConfidence:
    """How open-ended answers get their confidence.

    Attributes:
        kind: one of :data:`OPEN_CONFIDENCE_KINDS`.
        samples: ``semantic``: answers sampled per question (``>= 2``).
        temperature: the temperature of the deployed model ``softmax(z / T)`` (``> 0``): ``semantic``
            samples at it; ``token`` reads the greedy answers' token probabilities at it (the answers
            themselves do not change with T); the post-hoc knob of both
            (:mod:`llm_calib.confidence.temperature`). ``p_true`` and ``verbalized`` ignore it.
        top_p: ``semantic``: nucleus sampling mass (``(0, 1]``).
        seed: ``semantic``: seeds the samples and the sample splits.
        equivalence: ``semantic``: ``"exact"`` (SQuAD-normalised) or ``"f1"``.
        threshold: ``semantic`` with ``"f1"``: the token-F1 threshold (``(0, 1]``).
        estimator: ``semantic``: ``"sample_split"`` or ``"plug_in"``.
        splits: ``semantic``: R, sample splits averaged (``>= 1``).
        p_true_template: ``p_true``: the prompt (``{question}``, ``{answer}``).
        verbalized_template: ``verbalized``: the follow-up (``{prompt}``, ``{answer}``).
        reply_tokens: ``verbalized``: the token budget of the stated confidence.

    Example:
        >>> OpenConfidence("semantic", samples=1)
        Traceback (most recent call last):
        ...
        ValueError: samples must be an integer >= 2 for semantic confidence, got 1
    """

    kind: str = "token"
    samples: int = 10
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    equivalence: str = "exact"
    threshold: float = 0.5
    estimator: str = "sample_split"
    splits: int = 10
    p_true_template: str = P_TRUE_PROMPT
    verbalized_template: str = VERBALIZED_PROMPT
    reply_tokens: int = 8

    def __post_init__(self) -> None:
        if self.kind not in OPEN_CONFIDENCE_KINDS:
            raise ValueError(f"confidence must be one of {OPEN_CONFIDENCE_KINDS}, got {self.kind!r}")
        if self.kind == "semantic" and (isinstance(self.samples, bool) or not isinstance(self.samples, int)
                                        or self.samples < 2):
            raise ValueError(f"samples must be an integer >= 2 for semantic confidence, got {self.samples!r}")
        if self.equivalence not in EQUIVALENCE_KINDS:
            raise ValueError(f"equivalence must be one of {EQUIVALENCE_KINDS}, got {self.equivalence!r}")
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        if not 0.0 < float(self.threshold) <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold!r}")
        if isinstance(self.splits, bool) or not isinstance(self.splits, int) or self.splits < 1:
            raise ValueError(f"splits must be an integer >= 1, got {self.splits!r}")
        if isinstance(self.reply_tokens, bool) or not isinstance(self.reply_tokens, int) or self.reply_tokens < 1:
            raise ValueError(f"reply_tokens must be an integer >= 1, got {self.reply_tokens!r}")
        if self.kind == "semantic":
            self.sampling  # noqa: B018 (validates temperature and top_p now, naming them)
        elif not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")

    @property
    def sampling(self) -> SamplingSettings:
        """The sampling settings of ``semantic`` (``max_new_tokens`` is set per call)."""
        return SamplingSettings(n=self.samples, temperature=self.temperature, top_p=self.top_p, seed=self.seed)

    def to_dict(self) -> dict[str, Any]:
        """The settings that apply to this kind (JSON-ready), as reports record them.

        Example:
            >>> OpenConfidence("p_true").to_dict()["kind"]
            'p_true'
            >>> OpenConfidence("token", temperature=1.5).to_dict()
            {'kind': 'token', 'temperature': 1.5}
        """
        if self.kind == "token":  # the temperature only where it is not 1 (what reports always recorded)
            return {"kind": "token", **({"temperature": self.temperature} if self.temperature != 1.0 else {})}
        keys = {"semantic": ("samples", "temperature", "top_p", "seed", "equivalence", "threshold",
                                "estimator", "splits"),
                "p_true": ("p_true_template",), "verbalized": ("verbalized_template", "reply_tokens")}[self.kind]
        return {"kind": self.kind, **{k: getattr(self, k) for k in keys}}


@dataclass
class JudgedSet(OpenEndedSet):
    """Greedy answers with a second-opinion confidence: P(True) or a stated (verbalized) confidence.

    Attributes:
        judged: per question, the confidence in ``[0, 1]`` (NaN: an unparsed verbalized reply,
            left out of the metrics and counted as ``unscored``).

    Example:
        >>> s = JudgedSet(["Paris", "Rome"], [("Paris",), ("Oslo",)], ["geo"] * 2, ["q0", "q1"],
        ...               [(0.9,), (0.2,)], judged=[0.8, float("nan")])
        >>> r = s.summary(ci=False)
        >>> r["n"], r["unscored"], r["accuracy_all"]
        (1, 1, 0.5)
    """

    judged: list[float] = field(default_factory=list)

    per_question: ClassVar[tuple[str, ...]] = (*OpenEndedSet.per_question, "judged")

    def __post_init__(self) -> None:
        if len(self.judged) != len(self.answers):
            raise ValueError(f"JudgedSet: {len(self.judged)} confidences for {len(self.answers)} answers")

    @property
    def confidences(self) -> np.ndarray:
        """The judged confidence of each answer (NaN where none could be read)."""
        return np.asarray(self.judged, dtype=np.float64)

    def summary(self, n_bins: int = 10, ci: bool = True, n_resamples: int = 1000, seed: int = 0) -> dict[str, float]:
        """:func:`~llm_calib.metrics.calibration.binary_summary` of the judged confidences, plus ``f1`` and
        ``ece_token`` (the token confidence's ECE on the same answers, for comparison)."""
        out = metrics.binary_summary(self.confidences, self.correct, n_bins=n_bins, ci=ci,
                                     n_resamples=n_resamples, seed=seed)
        out["f1"] = float(np.mean(self.f1)) if len(self) else math.nan
        out["ece_token"] = metrics.ece(np.clip(self.confidence("mean"), 0, 1), self.correct, n_bins)
        out.setdefault("unscored", 0)
        return out


def _greedy_details(greedy: OpenEndedSet) -> list[str]:
    return [d["prompt"] for d in greedy.details] if greedy.details is not None else [""] * len(greedy)


def _judge(model: Any, tokenizer: Any, records: Sequence[OpenQA], greedy: OpenEndedSet, confidence: OpenConfidence,
           batch_size: int) -> JudgedSet:
    """The greedy answers' P(True) or stated confidence."""
    info = {**greedy.info, "confidence": confidence.to_dict()}
    details = [dict(d) for d in greedy.details] if greedy.details is not None else None
    if confidence.kind == "p_true":
        judged = p_true(model, tokenizer, [r.question for r in records], greedy.answers,
                        template=confidence.p_true_template, choices=P_TRUE_CHOICES, batch_size=batch_size).tolist()
    else:
        follow_ups = [verbalized_prompt(p, " " + a, confidence.verbalized_template)
                      for p, a in zip(_greedy_details(greedy), greedy.answers, strict=True)]
        replies: list[str] = []
        for start in range(0, len(follow_ups), batch_size):
            ids = [fit_prompt(encode_prompt(tokenizer, t, chat=False), confidence.reply_tokens,
                              f"the follow-up of {record_label(records[start + k])}")
                   for k, t in enumerate(follow_ups[start:start + batch_size])]
            replies += [a.text for a in generate_greedy(model, tokenizer, ids, max_new_tokens=confidence.reply_tokens)]
        parsed = parse_verbalized_replies(replies)
        judged = [math.nan if c is None else c for c in parsed.confidences]
        info["unparsed"] = len(parsed.unparsed)
        if details is not None:
            for d, reply in zip(details, replies, strict=True):
                d["reply"] = reply
    return JudgedSet(greedy.answers, greedy.references, greedy.domains, greedy.ids, greedy.token_probs, info,
                     details, judged=[float(j) for j in judged])


def score_open(model: Any, tokenizer: Any, records: Sequence[OpenQA], confidence: OpenConfidence | None = None, *,
               prompt: PromptFormat | None = None, max_new_tokens: int = 32, batch_size: int = 8,
               progress: bool = False) -> ScoredResult:
    """Answer open questions and give each answer the confidence of ``confidence.kind``.

    Args:
        model: a causal LM.
        tokenizer: its tokenizer.
        records: the open questions.
        confidence: the kind and its settings (None: ``token``).
        prompt: the prompt format (cloze).
        max_new_tokens: the answers' generation budget (greedy and sampled alike).
        batch_size: questions per forward pass.
        progress: show progress bars.

    Returns:
        An :class:`~llm_calib.confidence.token.OpenEndedSet` (``token``), a
        :class:`~llm_calib.confidence.sampled.SampledSet` (``semantic``) or a :class:`JudgedSet`.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> qs = [OpenQA("Capital of France?", ("Paris",), "geo", "q0")]
        >>> s = score_open(model, tok, qs, OpenConfidence("p_true"), max_new_tokens=3)
        >>> type(s).__name__, bool(0 < s.confidences[0] < 1)
        ('JudgedSet', True)
    """
    confidence = confidence or OpenConfidence()
    if confidence.kind == "semantic":
        from dataclasses import replace

        sampled: SampledSet = score_sampled(
            model, tokenizer, records, replace(confidence.sampling, max_new_tokens=max_new_tokens), prompt=prompt,
            equivalence=confidence.equivalence, threshold=confidence.threshold, estimator=confidence.estimator,
            splits=confidence.splits, batch_size=batch_size, progress=progress)
        sampled.info["confidence"] = confidence.to_dict()
        return sampled
    if confidence.kind == "token":
        return score_open_ended(model, tokenizer, records, prompt=prompt, max_new_tokens=max_new_tokens,
                                batch_size=batch_size, progress=progress, temperature=confidence.temperature)
    greedy = score_open_ended(model, tokenizer, records, prompt=prompt, max_new_tokens=max_new_tokens,
                              batch_size=batch_size, progress=progress)
    return _judge(model, tokenizer, records, greedy, confidence, batch_size)
