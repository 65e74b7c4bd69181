"""The result type shared by the multiple-choice scorers, and tokenisation helpers.

Tokenisation choice (documented once, used by every scorer): the prompt and each continuation
are tokenised *separately* and their ids concatenated, so the continuation tokens are exactly the
ids of ``tokenizer(" " + option, add_special_tokens=False)``. This identifies the scored tokens
unambiguously (tokenising ``prompt + continuation`` jointly can merge tokens across the boundary),
and makes the score of an option independent of how the prompt happens to end. For byte-level BPE
tokenizers (GPT-2, Llama-3, SmolLM2) the leading space becomes part of the first continuation
token, matching how the model sees a space-separated answer.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from llm_calib import metrics
from llm_calib.data.records import MultipleChoice

__all__ = [
    "ScoredSet",
    "check_records",
    "encode_continuation",
    "encode_prompt",
    "progress_bar",
    "scoring_split",
]

_SPLIT: contextvars.ContextVar[str | None] = contextvars.ContextVar("llm_calib_scoring_split", default=None)


@dataclass
class ScoredSet:
    """Per-question option scores of a multiple-choice scorer.

    Follows :class:`~llm_calib.formats.base.ScoredResult`, the interface it shares with
    :class:`~llm_calib.scoring.open_ended.OpenEndedSet`. The probabilities of a question are ``softmax(logits[i])``; temperature scaling divides the
    logits by ``T``. Option counts may differ between questions (ragged lists).

    Attributes:
        logits: one 1-D float tensor of option scores per question (log-probabilities, summed or
            length-normalised, for option likelihood; letter-token log-probabilities for the letter
            scorer).
        labels: gold option index per question.
        domains: domain label per question.
        ids: record id per question.
        scorer: name of the scorer that produced the scores.
        info: scorer settings and diagnostics (JSON-serialisable).
        details: per question, what the scorer saw (or None): ``prompt`` (text), ``choices``
            (the scored choice strings, without the target delimiter), ``continuations``,
            ``token_ids`` (per option), ``loglik`` (summed log-probability per option),
            ``n_tokens``, ``n_chars``, ``n_bytes`` (per option). The option-likelihood and letter
            scorers fill it; it feeds :func:`llm_calib.scoring.normalized` and per-sample logs.

    Example:
        >>> import torch
        >>> s = ScoredSet([torch.tensor([0.0, 1.0]), torch.tensor([2.0, 0.0, 0.0])],
        ...               [1, 1], ["a", "b"], ["q0", "q1"])
        >>> s.predictions.tolist(), s.correct.tolist()
        ([1, 0], [True, False])
        >>> round(float(s.probs[0].sum()), 6)
        1.0
        >>> sorted(s.by_domain())
        ['a', 'b']
    """

    logits: list[torch.Tensor]
    labels: list[int]
    domains: list[str]
    ids: list[str]
    scorer: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    details: list[dict[str, Any]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        n = len(self.logits)
        if self.details is not None and len(self.details) != n:
            raise ValueError(f"ScoredSet: details must have one entry per question ({n}), got {len(self.details)}")
        if not len(self.labels) == len(self.domains) == len(self.ids) == n:
            raise ValueError(
                "ScoredSet: logits, labels, domains and ids must have the same length, got "
                f"{n}, {len(self.labels)}, {len(self.domains)}, {len(self.ids)}"
            )
        self.labels = [int(x) for x in self.labels]

    def __len__(self) -> int:
        return len(self.logits)

    @property
    def probs(self) -> list[torch.Tensor]:
        """Softmax of each question's option scores."""
        return [torch.softmax(z.double(), dim=0).to(z.dtype) for z in self.logits]

    @property
    def probs_numpy(self) -> list[np.ndarray]:
        """Probabilities as a ragged list of float64 numpy arrays."""
        return [torch.softmax(z.double(), dim=0).numpy() for z in self.logits]

    @property
    def labels_numpy(self) -> np.ndarray:
        """Gold indices as an int64 array."""
        return np.asarray(self.labels, dtype=np.int64)

    @property
    def predictions(self) -> np.ndarray:
        """Argmax option per question."""
        return np.asarray([int(torch.argmax(z)) for z in self.logits], dtype=np.int64)

    @property
    def confidences(self) -> np.ndarray:
        """Maximum probability per question."""
        return np.asarray([float(p.max()) for p in self.probs_numpy], dtype=np.float64)

    @property
    def correct(self) -> np.ndarray:
        """Whether the argmax option is the gold one."""
        return self.predictions == self.labels_numpy

    @property
    def accuracy(self) -> float:
        """Fraction of questions answered correctly (NaN for an empty set)."""
        return float(self.correct.mean()) if len(self) else float("nan")

    def summary(self, n_bins: int = 10, ci: bool = True, n_resamples: int = 1000, seed: int = 0) -> dict[str, float]:
        """The calibration metrics of the option probabilities (:func:`llm_calib.metrics.summarize`).

        Example:
            >>> s = ScoredSet([torch.tensor([0.0, 2.0]), torch.tensor([1.0, 0.0])], [1, 1], ["d", "d"], ["a", "b"])
            >>> s.summary(ci=False)["accuracy"]
            0.5
        """
        return metrics.summarize(self.probs_numpy, self.labels_numpy, n_bins=n_bins, ci=ci,
                                 n_resamples=n_resamples, seed=seed)

    def select(self, indices: Iterable[int]) -> ScoredSet:
        """The sub-set at ``indices`` (same scorer and info)."""
        idx = list(indices)
        return ScoredSet(
            [self.logits[i] for i in idx],
            [self.labels[i] for i in idx],
            [self.domains[i] for i in idx],
            [self.ids[i] for i in idx],
            self.scorer,
            dict(self.info),
            [self.details[i] for i in idx] if self.details is not None else None,
        )

    def by_domain(self) -> dict[str, ScoredSet]:
        """Split by domain, in order of first appearance."""
        groups: dict[str, list[int]] = {}
        for i, d in enumerate(self.domains):
            groups.setdefault(d, []).append(i)
        return {d: self.select(idx) for d, idx in groups.items()}

    def scaled(self, temperature: float) -> ScoredSet:
        """A copy with every logit vector divided by ``temperature`` (> 0)."""
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        out = self.select(range(len(self)))
        out.logits = [z / temperature for z in self.logits]
        out.info["temperature"] = float(temperature)
        return out

    @staticmethod
    def concat(sets: Sequence[ScoredSet]) -> ScoredSet:
        """Concatenate several sets (the first one's scorer and info are kept)."""
        if not sets:
            raise ValueError("ScoredSet.concat needs at least one set")
        return ScoredSet(
            [z for s in sets for z in s.logits],
            [y for s in sets for y in s.labels],
            [d for s in sets for d in s.domains],
            [i for s in sets for i in s.ids],
            sets[0].scorer,
            dict(sets[0].info),
            [d for s in sets for d in s.details]  # type: ignore[union-attr]
            if all(s.details is not None for s in sets)
            else None,
        )


def check_records(records: Sequence[Any]) -> list[MultipleChoice]:
    """Check that ``records`` are :class:`MultipleChoice` records and return them as a list.

    Args:
        records: the records to score.

    Returns:
        The records as a list.

    Raises:
        TypeError: a record that is not :class:`MultipleChoice`.

    Example:
        >>> check_records([MultipleChoice("q?", ("a", "b"), 0, "d", "0")])[0].gold
        0
    """
    out = list(records)
    for r in out:
        if not isinstance(r, MultipleChoice):
            raise TypeError(
                f"records must be MultipleChoice records, got {type(r).__name__} "
                "(use llm_calib.scoring.score_open_ended for open questions)"
            )
    return out


def _adds_bos(tokenizer: Any) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("x", add_special_tokens=True)["input_ids"]
    return len(ids) > 0 and ids[0] == bos


def encode_prompt(tokenizer: Any, text: str, *, chat: bool) -> list[int]:
    """Token ids of a prompt.

    A chat-templated prompt already holds its special tokens, so it is tokenised without adding
    any. A plain prompt gets the tokenizer's BOS token when the tokenizer adds one by default
    and the text does not start with it (and never an EOS token), as lm-eval tokenises contexts.

    Args:
        tokenizer: a Hugging Face tokenizer.
        text: the prompt text.
        chat: whether ``text`` came from a chat template.

    Returns:
        The ids.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> encode_prompt(tok, "The answer is:", chat=False) == tok("The answer is:")["input_ids"]
        True
    """
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not chat and _adds_bos(tokenizer) and ids[:1] != [tokenizer.bos_token_id]:  # a text that starts
        ids = [tokenizer.bos_token_id, *ids]  # with BOS keeps it once, as lm-eval's HFLM
    return ids


def encode_continuation(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a continuation, tokenised on its own without special tokens.

    Args:
        tokenizer: a Hugging Face tokenizer.
        text: the continuation, with its leading space (see
            :func:`llm_calib.prompts.continuation_text`).

    Returns:
        The token ids.

    Raises:
        ValueError: if the continuation has no tokens.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> tok.decode(encode_continuation(tok, " Paris"))
        ' Paris'
    """
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError(f"continuation {text!r} tokenises to no tokens")
    return ids


class _NoBar:
    def __init__(self, desc: str = "") -> None:
        self.desc = desc

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


@contextlib.contextmanager
def scoring_split(name: str) -> Iterator[None]:
    """Name the split that the progress bars opened inside the block score.

    Every :func:`progress_bar` opened in the block is labelled ``<name>: <desc>``, so a run that
    scores several sets (evaluation sets, the temperature-fit set) says which one a bar counts.

    Args:
        name: the split, e.g. its data spec.

    Example:
        >>> with scoring_split("arc_easy:test"):
        ...     bar = progress_bar(total=3, desc="option likelihood", enabled=False)
        >>> bar.desc
        'arc_easy:test: option likelihood'
    """
    token = _SPLIT.set(name)
    try:
        yield
    finally:
        _SPLIT.reset(token)


def progress_bar(*, total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar counting ``total`` questions, or a no-op stand-in when not ``enabled``.

    Inside :func:`scoring_split` the label starts with the split's name.

    Args:
        total: number of questions.
        desc: label of the bar.
        enabled: show a real bar.

    Returns:
        An object with ``update(n)`` and ``close()``.

    Example:
        >>> bar = progress_bar(total=3, desc="scoring", enabled=False)
        >>> bar.update(3); bar.close()
    """
    split = _SPLIT.get()
    if split is not None:
        desc = f"{split}: {desc}"
    if not enabled:
        return _NoBar(desc)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="q", dynamic_ncols=True)
