r"""Semantic confidence of open-ended answers: N sampled answers grouped by meaning.

A question is asked N times with sampling; the answers are clustered by *answer equivalence*; the
model's answer is the largest cluster and its confidence is that cluster's frequency. This is the
consistency-based confidence behind semantic entropy (Kuhn, Gal and Farquhar, "Semantic
Uncertainty", ICLR 2023) and the semantic ECE (Sem-ECE) of open-ended calibration studies; two
estimators of the modal answer's probability are given:

* **plug-in**: :math:`\hat p = n_{\text{mode}} / N`. It is biased upwards: the mode is chosen on the
  same samples that estimate its frequency (with N = 2 and two different answers it is 0.5, never
  lower), which inflates confidence exactly where the model is unsure.
* **sample-split**: the N samples are split at random into halves A and B; the mode is chosen on A
  and its frequency is counted on B; averaged over R splits. Choosing and counting on disjoint
  samples removes the selection bias (the estimate is unbiased for the probability of A's mode).

Equivalence offline is SQuAD-normalised exact match (:func:`llm_calib.metrics.answers.normalize_answer`),
or token F1 at or above a threshold; any ``(a, b) -> bool`` works, e.g. bidirectional entailment
of an NLI model (:func:`nli_equivalence`). Correctness is the modal answer against the gold aliases
under the same equivalence.

Example:
    >>> conf = semantic_confidence(["Paris", "paris.", "Lyon", "The Paris"], splits=50, seed=0)
    >>> conf.answer, conf.plug_in, conf.cluster_sizes
    ('Paris', 0.75, (3, 1))
    >>> 0.5 <= conf.sample_split <= 1.0
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from llm_calib.metrics.answers import normalize_answer, token_f1

__all__ = [
    "EQUIVALENCE_KINDS", "ESTIMATORS", "Equivalence", "SemanticConfidence", "answer_equivalence",
    "cluster_answers", "nli_equivalence", "sample_split_frequency", "semantic_confidence",
]

Equivalence = Callable[[str, str], bool]
"""Whether two answers mean the same: ``equivalent(a, b) -> bool``."""

EQUIVALENCE_KINDS: tuple[str, ...] = ("exact", "f1")
"""The built-in equivalences: SQuAD-normalised exact match, token F1 at or above a threshold."""

ESTIMATORS: tuple[str, ...] = ("plug_in", "sample_split")
"""The estimators of the modal answer's probability (see the module's docstring)."""


class _ExactMatch:
    """SQuAD-normalised equality; a class so that clustering can group by the normalised key."""

    def __call__(self, a: str, b: str) -> bool:
        return normalize_answer(a) == normalize_answer(b)

    def __repr__(self) -> str:
        return "answer_equivalence('exact')"


@dataclass(frozen=True)
class _TokenF1:
    threshold: float

    def __call__(self, a: str, b: str) -> bool:
        return token_f1(a, [b]) >= self.threshold

    def __repr__(self) -> str:
        return f"answer_equivalence('f1', threshold={self.threshold})"


def answer_equivalence(kind: str = "exact", *, threshold: float = 0.5) -> Equivalence:
    """A built-in answer equivalence by name.

    Args:
        kind: ``"exact"`` (equal after SQuAD normalisation: lower case, no punctuation or articles)
            or ``"f1"`` (SQuAD token F1 of the two answers ``>= threshold``; symmetric).
        threshold: for ``"f1"``, in ``(0, 1]``.

    Returns:
        A function ``(a, b) -> bool``.

    Raises:
        ValueError: an unknown ``kind`` or a threshold outside ``(0, 1]`` (naming both).

    Example:
        >>> same = answer_equivalence("f1", threshold=0.5)
        >>> same("the Eiffel Tower", "Eiffel Tower in Paris"), same("Paris", "Lyon")
        (True, False)
        >>> answer_equivalence("exact")("The Beatles!", "beatles")
        True
    """
    if kind not in EQUIVALENCE_KINDS:
        raise ValueError(f"equivalence must be one of {EQUIVALENCE_KINDS}, got {kind!r}")
    if kind == "exact":
        return _ExactMatch()
    if not 0.0 < float(threshold) <= 1.0:
        raise ValueError(f"threshold of the 'f1' equivalence must be in (0, 1], got {threshold!r}")
    return _TokenF1(float(threshold))


def nli_equivalence(model: Any, tokenizer: Any, *, question: str = "",
                    entailment_label: str | None = None) -> Equivalence:
    """Bidirectional entailment of a ``transformers`` NLI classifier as the equivalence.

    Two answers are equivalent when the model predicts *entailment* for both ``(a, b)`` and
    ``(b, a)`` (Kuhn et al., 2023); with ``question``, each side is ``question + " " + answer``.
    Results are cached per ordered pair, so clustering N answers costs at most N(N-1) calls.

    Args:
        model: a sequence-classification model (e.g. ``AutoModelForSequenceClassification`` of an
            MNLI checkpoint), in evaluation mode.
        tokenizer: its tokenizer.
        question: the question both answers reply to (context for the premise and hypothesis).
        entailment_label: the label name that means entailment; default: the label of
            ``model.config.id2label`` containing "entail" (case-insensitive).

    Returns:
        A function ``(a, b) -> bool``.

    Raises:
        ValueError: no label of the model's ``id2label`` names entailment.

    Example:
        >>> from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast
        >>> import tempfile, pathlib
        >>> vocab = pathlib.Path(tempfile.mkdtemp()) / "vocab.txt"
        >>> _ = vocab.write_text("\\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "paris", "lyon"]))
        >>> tok = BertTokenizerFast(vocab_file=str(vocab))
        >>> cfg = BertConfig(vocab_size=6, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
        ...                  intermediate_size=8, num_labels=3,
        ...                  id2label={0: "contradiction", 1: "neutral", 2: "entailment"})
        >>> same = nli_equivalence(BertForSequenceClassification(cfg).eval(), tok)
        >>> isinstance(same("paris", "lyon"), bool)
        True
    """
    import torch

    labels = {int(i): str(name) for i, name in getattr(model.config, "id2label", {}).items()}
    if entailment_label is None:
        found = [i for i, name in labels.items() if "entail" in name.lower() and "not" not in name.lower()]
    else:
        found = [i for i, name in labels.items() if name == entailment_label]
    if len(found) != 1:
        raise ValueError(f"cannot tell which label of the NLI model means entailment: id2label={labels}; "
                         "pass entailment_label=")
    entail = found[0]
    cache: dict[tuple[str, str], bool] = {}
    prefix = f"{question} " if question else ""

    def entails(premise: str, hypothesis: str) -> bool:
        key = (premise, hypothesis)
        if key not in cache:
            enc = tokenizer(prefix + premise, prefix + hypothesis, return_tensors="pt", truncation=True)
            with torch.no_grad():
                logits = model(**enc).logits[0]
            cache[key] = int(logits.argmax()) == entail
        return cache[key]

    return lambda a, b: entails(a, b) and entails(b, a)


def cluster_answers(answers: Sequence[str], equivalent: Equivalence | None = None) -> list[int]:
    """Cluster labels of the answers: each answer joins the first cluster whose first member it is
    equivalent to, else opens a new one (labels ``0, 1, …`` in order of first appearance).

    With the exact-match equivalence this is grouping by the normalised text (linear time); any
    other equivalence is compared with one member of each cluster, as in Kuhn et al. (2023).

    Args:
        answers: the sampled answers of one question.
        equivalent: the equivalence; default :func:`answer_equivalence` ``("exact")``.

    Returns:
        One cluster label per answer.

    Example:
        >>> cluster_answers(["Paris", "Lyon", "paris!", "Nice", "lyon"])
        [0, 1, 0, 2, 1]
    """
    equivalent = equivalent if equivalent is not None else _ExactMatch()
    labels: list[int] = []
    if isinstance(equivalent, _ExactMatch):
        keys: dict[str, int] = {}
        for a in answers:
            labels.append(keys.setdefault(normalize_answer(a), len(keys)))
        return labels
    representatives: list[str] = []
    for a in answers:
        for label, rep in enumerate(representatives):
            if equivalent(a, rep):
                labels.append(label)
                break
        else:
            labels.append(len(representatives))
            representatives.append(a)
    return labels


def _mode(labels: np.ndarray) -> int:
    """The most frequent label; ties go to the label seen first (the smallest label here)."""
    counts = np.bincount(labels)
    return int(np.argmax(counts))  # argmax returns the first maximum: the earliest cluster


@dataclass(frozen=True)
class SemanticConfidence:
    """The semantic confidence of one question's sampled answers.

    Attributes:
        answer: the first sample of the largest cluster (ties: the cluster that appeared first).
        plug_in: the largest cluster's frequency ``n_mode / N``.
        sample_split: the mean over the splits of the frequency, in half B, of half A's mode (NaN
            when N < 2).
        labels: the cluster label of each sample.
        cluster_sizes: the sizes of the clusters, by label.
    """

    answer: str
    plug_in: float
    sample_split: float
    labels: tuple[int, ...]
    cluster_sizes: tuple[int, ...]

    def confidence(self, estimator: str = "sample_split") -> float:
        """The confidence under ``estimator`` (``"plug_in"`` or ``"sample_split"``).

        Example:
            >>> semantic_confidence(["a", "a", "b"], splits=1).confidence("plug_in")
            0.6666666666666666
        """
        if estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
        return self.plug_in if estimator == "plug_in" else self.sample_split


def sample_split_frequency(labels: Sequence[int], *, splits: int = 10, seed: int = 0) -> float:
    """The sample-split estimate of the modal answer's probability from cluster labels.

    Each of ``splits`` random permutations puts the first ``N // 2`` samples in half A and the rest
    in half B; A's mode (ties: the earliest cluster) is scored by its frequency in B; the estimates
    are averaged. Deterministic under ``seed``.

    Args:
        labels: the cluster label of each of the N samples (:func:`cluster_answers`).
        splits: R, the number of random splits (``>= 1``).
        seed: seeds the permutations.

    Returns:
        The mean frequency, in ``[0, 1]``; NaN when N < 2.

    Example:
        >>> sample_split_frequency([0, 0, 0, 0], splits=3)
        1.0
        >>> sample_split_frequency([0, 1], splits=5)  # A's single answer never recurs in B
        0.0
    """
    if int(splits) < 1:
        raise ValueError(f"splits must be an integer >= 1, got {splits!r}")
    y = np.asarray(labels, dtype=np.int64)
    n = len(y)
    if n < 2:
        return float("nan")
    rng = np.random.default_rng(seed)
    half = n // 2
    total = 0.0
    for _ in range(int(splits)):
        perm = rng.permutation(n)
        first, second = y[perm[:half]], y[perm[half:]]
        total += float(np.mean(second == _mode(first)))
    return total / int(splits)


def semantic_confidence(samples: Sequence[str], equivalent: Equivalence | None = None, *, splits: int = 10,
                        seed: int = 0) -> SemanticConfidence:
    """Cluster one question's sampled answers and estimate the modal answer's probability.

    Args:
        samples: the N sampled answers (N >= 1).
        equivalent: the answer equivalence; default exact match after SQuAD normalisation.
        splits: R, the random splits of the sample-split estimate (``>= 1``).
        seed: seeds the splits.

    Returns:
        A :class:`SemanticConfidence`.

    Raises:
        ValueError: no samples, or ``splits < 1``.

    Example:
        >>> c = semantic_confidence(["blue", "Blue.", "green"], splits=20, seed=1)
        >>> c.answer, round(c.plug_in, 3), c.labels
        ('blue', 0.667, (0, 0, 1))
    """
    if len(samples) == 0:
        raise ValueError("semantic confidence needs at least one sampled answer")
    labels = np.asarray(cluster_answers(samples, equivalent), dtype=np.int64)
    mode = _mode(labels)
    sizes = np.bincount(labels)
    answer = samples[int(np.flatnonzero(labels == mode)[0])]
    return SemanticConfidence(
        answer=answer, plug_in=float(sizes[mode]) / len(samples),
        sample_split=sample_split_frequency(labels, splits=splits, seed=seed),
        labels=tuple(int(v) for v in labels), cluster_sizes=tuple(int(v) for v in sizes),
    )
