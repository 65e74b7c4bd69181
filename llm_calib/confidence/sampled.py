"""Open questions scored by sampling: N answers per question, semantic confidence (Sem-ECE).

:func:`score_sampled` asks every question N times (:func:`~llm_calib.engine.sampling.sample_answers`:
the prompt's keys and values computed once, shared by its N samples) and returns a
:class:`SampledSet`: per question its samples, clustered by answer equivalence
(:mod:`llm_calib.confidence.semantic`); the answer is the largest cluster, its confidence the cluster's
frequency (``plug_in``) or the sample-split estimate (``sample_split``, the default), and it is
correct when it is equivalent to one of the gold aliases. The ECE of these confidences is the
semantic ECE (Sem-ECE) of open-ended calibration studies.

Example:
    >>> s = SampledSet([("Paris", "paris", "Lyon")], [("Paris",)], ["geo"], ["q0"])
    >>> s.answers, s.correct.tolist(), round(float(s.confidence("plug_in")[0]), 3)
    (['Paris'], [True], 0.667)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from llm_calib.confidence.semantic import (
    ESTIMATORS,
    Equivalence,
    SemanticConfidence,
    answer_equivalence,
    semantic_confidence,
)
from llm_calib.confidence.token import encode_open_prompts
from llm_calib.data.records import OpenQA
from llm_calib.engine.sampling import SamplingSettings, sample_answers
from llm_calib.metrics import calibration as metrics
from llm_calib.prompts.templates import PromptFormat, record_prompt, uses_chat_template
from llm_calib.scoring.base import ScoredResult, score_in_batches

__all__ = ["SampledSet", "score_sampled"]


@dataclass
class SampledSet(ScoredResult):
    """N sampled answers per open question (a :class:`~llm_calib.scoring.base.ScoredResult`).

    Attributes:
        samples: per question, its sampled answer texts.
        references: per question, the accepted aliases.
        domains: per question, its domain.
        ids: per question, its id.
        sample_token_probs: per question and sample, the answer tokens' probabilities (optional).
        info: settings: ``estimator`` (``"sample_split"`` or ``"plug_in"``), ``splits``, ``seed``,
            ``equivalence`` (its name), the sampling settings.
        details: per question ``prompt`` and the samples' ``token_ids`` / ``stop`` (optional).
        equivalence: the answer equivalence (default: exact match after SQuAD normalisation).

    Example:
        >>> s = SampledSet([("a", "a", "b", "a")], [("a",)], ["d"], ["q"], info={"splits": 4})
        >>> s.semantic[0].cluster_sizes, bool(0 <= s.confidences[0] <= 1)
        ((3, 1), True)
    """

    samples: list[tuple[str, ...]]
    references: list[tuple[str, ...]]
    domains: list[str]
    ids: list[str]
    sample_token_probs: list[tuple[tuple[float, ...], ...]] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    details: list[dict[str, Any]] | None = field(default=None, repr=False)
    equivalence: Equivalence | None = field(default=None, repr=False)

    per_question: ClassVar[tuple[str, ...]] = ("samples", "references", "domains", "ids")

    def __post_init__(self) -> None:
        n = len(self.samples)
        for name in ("references", "domains", "ids"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"SampledSet: {len(getattr(self, name))} {name} for {n} questions")
        estimator = self.info.get("estimator", "sample_split")
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
        self._semantic: list[SemanticConfidence] | None = None

    def select(self, indices: Any) -> SampledSet:
        """The sub-set at ``indices`` (token probabilities and equivalence kept)."""
        idx = list(indices)
        out = super().select(idx)
        if self.sample_token_probs is not None:
            out.sample_token_probs = [self.sample_token_probs[i] for i in idx]
            out._semantic = None
        return out

    @property
    def _equivalent(self) -> Equivalence:
        return self.equivalence if self.equivalence is not None else answer_equivalence("exact")

    @property
    def semantic(self) -> list[SemanticConfidence]:
        """Per question, its clusters and both confidence estimates (computed once).

        The sample split of question ``i`` is seeded by ``info["seed"] + i``; ``info["splits"]``
        (default 10) splits are averaged.
        """
        if self._semantic is None:
            splits, seed = int(self.info.get("splits", 10)), int(self.info.get("seed", 0))
            self._semantic = [semantic_confidence(s, self._equivalent, splits=splits, seed=seed + i)
                              for i, s in enumerate(self.samples)]
        return self._semantic

    @property
    def answers(self) -> list[str]:
        """The modal answer of each question (first sample of its largest cluster)."""
        return [c.answer for c in self.semantic]

    @property
    def correct(self) -> np.ndarray:
        """Whether each modal answer is equivalent to one of the gold aliases."""
        same = self._equivalent
        return np.asarray([any(same(a, r) for r in refs) for a, refs in zip(self.answers, self.references, strict=True)],
                          dtype=bool)

    def confidence(self, estimator: str | None = None) -> np.ndarray:
        """Per-question confidence under ``estimator`` (default ``info["estimator"]``, else sample split).

        With a single sample per question the sample-split estimate is undefined (NaN).
        """
        estimator = estimator or self.info.get("estimator", "sample_split")
        return np.asarray([c.confidence(estimator) for c in self.semantic], dtype=np.float64)

    @property
    def confidences(self) -> np.ndarray:
        """The confidence of each modal answer under the set's estimator."""
        return self.confidence()

    def summary(self, n_bins: int = 10, ci: bool = True, n_resamples: int = 1000, seed: int = 0) -> dict[str, float]:
        """Sem-ECE and the other metrics of the modal answers (:func:`llm_calib.metrics.calibration.binary_summary`),
        plus ``ece_plug_in`` (the other estimator's ECE), ``mean_clusters`` and ``samples``.

        Example:
            >>> s = SampledSet([("a", "a"), ("b", "c")], [("a",), ("x",)], ["d"] * 2, ["q0", "q1"])
            >>> r = s.summary(ci=False)
            >>> r["accuracy"], r["samples"], r["mean_clusters"]
            (0.5, 2.0, 1.5)
        """
        out = metrics.binary_summary(self.confidences, self.correct, n_bins=n_bins, ci=ci,
                                     n_resamples=n_resamples, seed=seed)
        other = "plug_in" if self.info.get("estimator", "sample_split") == "sample_split" else "sample_split"
        c_other = self.confidence(other)
        keep = np.isfinite(c_other)
        out[f"ece_{other}"] = metrics.ece(c_other[keep], self.correct[keep], n_bins) if keep.any() else float("nan")
        out["mean_clusters"] = float(np.mean([len(c.cluster_sizes) for c in self.semantic])) if len(self) else float("nan")
        out["samples"] = float(np.mean([len(s) for s in self.samples])) if len(self) else float("nan")
        return out


def score_sampled(
    model: Any, tokenizer: Any, records: Sequence[OpenQA], sampling: SamplingSettings, *,
    prompt: PromptFormat | None = None, equivalence: str | Equivalence = "exact", threshold: float = 0.5,
    estimator: str = "sample_split", splits: int = 10, batch_size: int = 8, progress: bool = False,
) -> SampledSet:
    """Sample ``sampling.n`` answers to every open question and measure their semantic confidence.

    Args:
        model: a causal LM.
        tokenizer: its tokenizer.
        records: the open questions.
        sampling: n, temperature, top-p, seed, token budget.
        prompt: the prompt format (default ``PromptFormat()``, cloze only).
        equivalence: ``"exact"``, ``"f1"`` (token F1 >= ``threshold``) or a function ``(a, b) -> bool``.
        threshold: for ``"f1"``.
        estimator: ``"sample_split"`` (default) or ``"plug_in"`` (see :mod:`llm_calib.confidence.semantic`).
        splits: R, the sample splits averaged (``>= 1``).
        batch_size: questions per forward pass (each decodes ``n`` rows).
        progress: show a progress bar.

    Returns:
        A :class:`SampledSet`.

    Raises:
        TypeError: a record that is not :class:`~llm_calib.data.records.OpenQA`.
        ValueError: a bad equivalence, estimator, ``splits`` or ``batch_size``.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> qs = [OpenQA("Capital of France?", ("Paris",), "geo", "q0")]
        >>> s = score_sampled(model, tok, qs, SamplingSettings(n=4, max_new_tokens=3))
        >>> len(s.samples[0]), s.info["estimator"]
        (4, 'sample_split')
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if int(splits) < 1:
        raise ValueError(f"splits must be an integer >= 1, got {splits!r}")
    same = answer_equivalence(equivalence, threshold=threshold) if isinstance(equivalence, str) else equivalence
    records = list(records)
    fmt = prompt or PromptFormat()
    prompts = encode_open_prompts(tokenizer, records, fmt, reserve=sampling.max_new_tokens)

    def answer(idx: list[int]) -> list[list[Any]]:
        # each question's samples are seeded by its index in the set, so batching never changes them
        return sample_answers(model, tokenizer, [prompts[i] for i in idx], sampling,
                              until=[records[i].until for i in idx], batch_size=len(idx), question_indices=idx)

    done = score_in_batches([len(p) for p in prompts], batch_size, answer, desc="sampled", progress=progress)
    info = {"estimator": estimator, "splits": int(splits), "seed": sampling.seed, "n": sampling.n,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "max_new_tokens": sampling.max_new_tokens,
            "equivalence": equivalence if isinstance(equivalence, str) else getattr(equivalence, "__name__", "custom"),
            "chat_template": uses_chat_template(tokenizer, fmt), "template": fmt.template, "fewshot": fmt.fewshot}
    if info["equivalence"] == "f1":
        info["threshold"] = threshold
    details = [{"prompt": record_prompt(tokenizer, r, fmt), "token_ids": [list(s.token_ids) for s in a],
                "stop": [s.stop for s in a]} for r, a in zip(records, done, strict=True)]
    return SampledSet([tuple(s.text for s in a) for a in done], [tuple(r.answers) for r in records],
                      [r.domain for r in records], [r.id for r in records],
                      [tuple(s.token_probs for s in a) for a in done], info, details, same)

