"""The result types' shared base, the multiple-choice :class:`ScoredSet`, and tokenisation helpers.

Every scorer tokenises the prompt and each continuation separately and concatenates the ids, so
the scored tokens are exactly ``tokenizer(" " + option)`` (no merge across the boundary).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from llm_calib.data.records import MultipleChoice
from llm_calib.engine.context import fit_prompt
from llm_calib.engine.flat import flat_supported
from llm_calib.engine.packing import length_batches
from llm_calib.engine.prefix import (
    PrefixCacheSettings,
    PrefixCacheStats,
    PrefixKV,
    kv_bytes_per_token,
    plan_prefix_batches,
    run_prefix_plan,
)
from llm_calib.metrics import calibration as metrics
from llm_calib.prompts.templates import (
    PromptFormat,
    record_prompt,
    record_uses_chat_template,
    uses_chat_template,
)

__all__ = [
    "ScoredResult", "ScoredSet", "check_records", "encode_continuation", "encode_prompt", "encode_prompts",
    "progress_bar", "record_label", "score_in_batches", "score_sharing_prefixes", "scoring_split",
]

_SPLIT: contextvars.ContextVar[str | None] = contextvars.ContextVar("llm_calib_scoring_split", default=None)

S = TypeVar("S", bound="ScoredResult")
T = TypeVar("T")


class ScoredResult:
    """What every scored set offers, whatever the format that produced it.

    :class:`ScoredSet` and :class:`~llm_calib.confidence.token.OpenEndedSet` are dataclasses of
    per-question lists (named in ``per_question``), ``info`` and optional ``details``; they define
    ``correct``, ``confidences`` and ``summary``, and share selection, domain split and concatenation.

    Example:
        >>> from llm_calib.confidence.token import OpenEndedSet
        >>> mc = ScoredSet([torch.tensor([0.0, 1.0]), torch.tensor([2.0, 0.0])], [1, 1], ["a", "b"], ["q0", "q1"])
        >>> op = OpenEndedSet(["Paris"], [("Paris",)], ["d"], ["q1"], [(0.8,)])
        >>> [isinstance(s, ScoredResult) for s in (mc, op)], [s.accuracy for s in (mc, op)]
        ([True, True], [0.5, 1.0])
        >>> sorted(mc.by_domain()), len(ScoredSet.concat([mc, mc.select([0])]))
        (['a', 'b'], 3)
    """

    per_question: ClassVar[tuple[str, ...]]
    ids: list[str]
    domains: list[str]
    info: dict[str, Any]
    details: list[dict[str, Any]] | None

    def __len__(self) -> int:
        return len(getattr(self, self.per_question[0]))

    @property
    def correct(self) -> np.ndarray:
        """Whether each question is answered correctly."""
        raise NotImplementedError

    @property
    def confidences(self) -> np.ndarray:
        """The confidence in ``[0, 1]`` of each answer (what calibration metrics bin)."""
        raise NotImplementedError

    def summary(self, n_bins: int = 10, ci: bool = True, n_resamples: int = 1000, seed: int = 0) -> dict[str, float]:
        """The calibration metrics of the set."""
        raise NotImplementedError

    @property
    def accuracy(self) -> float:
        """Fraction of questions answered correctly (NaN for an empty set)."""
        return float(self.correct.mean()) if len(self) else float("nan")

    def select(self: S, indices: Iterable[int]) -> S:
        """The sub-set at ``indices`` (same settings and info)."""
        idx = list(indices)
        picked = {f: [getattr(self, f)[i] for i in idx] for f in self.per_question}
        details = [self.details[i] for i in idx] if self.details is not None else None
        return dataclasses.replace(self, **picked, info=dict(self.info), details=details)  # type: ignore[type-var]

    def by_domain(self: S) -> dict[str, S]:
        """Split by domain, in order of first appearance."""
        groups: dict[str, list[int]] = {}
        for i, d in enumerate(self.domains):
            groups.setdefault(d, []).append(i)
        return {d: self.select(idx) for d, idx in groups.items()}

    @classmethod
    def concat(cls: type[S], sets: Sequence[S]) -> S:
        """Several sets as one (the first one's settings and info are kept)."""
        if not sets:
            raise ValueError(f"{cls.__name__}.concat needs at least one set")
        joined = {f: [x for s in sets for x in getattr(s, f)] for f in cls.per_question}
        details = ([d for s in sets for d in s.details]  # type: ignore[union-attr]
                   if all(s.details is not None for s in sets) else None)
        first = sets[0]
        return dataclasses.replace(first, **joined, info=dict(first.info), details=details)  # type: ignore[type-var]


@dataclass
class ScoredSet(ScoredResult):
    """Per-question option scores of a multiple-choice scorer: ``logits`` (one 1-D tensor per
    question, option counts may differ; probabilities are their softmax), gold ``labels``,
    ``domains``, ``ids``, the ``scorer`` name, ``info`` (settings, diagnostics) and ``details``
    (per question ``prompt``, ``choices``, ``continuations``; per option ``token_ids``, summed
    ``loglik``, ``n_tokens``, ``n_chars``, ``n_bytes``; read by :func:`llm_calib.scoring.normalized`).

    Example:
        >>> s = ScoredSet([torch.tensor([0.0, 1.0]), torch.tensor([2.0, 0.0, 0.0])],
        ...               [1, 1], ["a", "b"], ["q0", "q1"])
        >>> s.predictions.tolist(), s.correct.tolist()
        ([1, 0], [True, False])
    """

    logits: list[torch.Tensor]
    labels: list[int]
    domains: list[str]
    ids: list[str]
    scorer: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    details: list[dict[str, Any]] | None = field(default=None, repr=False)

    per_question: ClassVar[tuple[str, ...]] = ("logits", "labels", "domains", "ids")

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

    @classmethod
    def from_records(cls, records: Sequence[MultipleChoice], logits: list[torch.Tensor], scorer: str,
                     info: dict[str, Any], details: list[dict[str, Any]] | None = None) -> ScoredSet:
        """The scores of ``records``: their gold options, domains and ids."""
        return cls(logits, [r.gold for r in records], [r.domain for r in records], [r.id for r in records],
                   scorer, info, details)

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

    def summary(self, n_bins: int = 10, ci: bool = True, n_resamples: int = 1000, seed: int = 0) -> dict[str, float]:
        """The calibration metrics of the option probabilities (:func:`llm_calib.metrics.calibration.summarize`)."""
        return metrics.summarize(self.probs_numpy, self.labels_numpy, n_bins=n_bins, ci=ci,
                                 n_resamples=n_resamples, seed=seed)

    def scaled(self, temperature: float) -> ScoredSet:
        """A copy with every logit vector divided by ``temperature`` (> 0)."""
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        out = self.select(range(len(self)))
        out.logits = [z / temperature for z in self.logits]
        out.info["temperature"] = float(temperature)
        return out


def check_records(records: Sequence[Any]) -> list[MultipleChoice]:
    """``records`` as a list, after checking that they are :class:`MultipleChoice` records (else TypeError).

    Example:
        >>> check_records([MultipleChoice("q?", ("a", "b"), 0, "d", "0")])[0].gold
        0
    """
    out = list(records)
    for r in out:
        if not isinstance(r, MultipleChoice):
            raise TypeError(f"records must be MultipleChoice records, got {type(r).__name__} "
                            "(use llm_calib.confidence.token.score_open_ended for open questions)")
    return out


def _adds_bos(tokenizer: Any) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("x", add_special_tokens=True)["input_ids"]
    return len(ids) > 0 and ids[0] == bos


def encode_prompt(tokenizer: Any, text: str, *, chat: bool) -> list[int]:
    """Token ids of a prompt: a chat-templated one as it is; a plain one with the tokenizer's default
    BOS (not doubled, never an EOS), as lm-eval tokenises contexts.

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


def record_label(record: Any) -> str:
    """How a message names a record: ``question 'q7' (arc_easy)``.

    Example:
        >>> record_label(MultipleChoice("q?", ("a", "b"), 0, "geo", "q7"))
        "question 'q7' (geo)"
    """
    return f"question {getattr(record, 'id', '?')!r} ({getattr(record, 'domain', '?')})"


def encode_prompts(
    tokenizer: Any, records: Sequence[Any], fmt: PromptFormat, texts: Sequence[str] | None = None,
    reserve: int | Sequence[int] | None = None,
) -> list[list[int]]:
    """Token ids of each record's prompt under ``fmt`` (:func:`encode_prompt`; chat-templated where
    the prompt format and the record use the chat template): what every scorer and format encodes.
    ``texts``: the prompts already rendered by :func:`~llm_calib.prompts.templates.record_prompt` (rendered
    here when None), for a caller that also reports them. ``reserve``: the tokens that follow each
    prompt (one count, or one per record), with which it is fitted to the model's context
    (:func:`~llm_calib.engine.context.fit_prompt`); None: not fitted (the caller fits it).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> q = MultipleChoice("Capital of France?", ("Paris", "Rome"), 0, "geo", "q0")
        >>> tok.decode(encode_prompts(tok, [q], PromptFormat())[0]).endswith("The answer is:")
        True
    """
    chat = uses_chat_template(tokenizer, fmt)
    if texts is None:
        texts = [record_prompt(tokenizer, r, fmt) for r in records]
    prompts = [encode_prompt(tokenizer, t, chat=chat and record_uses_chat_template(tokenizer, r, fmt))
               for r, t in zip(records, texts, strict=True)]
    if reserve is None:
        return prompts
    reserves = [reserve] * len(prompts) if isinstance(reserve, int) else list(reserve)
    return [fit_prompt(p, n, record_label(r)) for p, n, r in zip(prompts, reserves, records, strict=True)]


def encode_continuation(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a continuation (with its leading space), tokenised alone without special tokens
    (ValueError for a continuation of no tokens).

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
    """Label every :func:`progress_bar` opened inside the block ``<name>: <desc>``.

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


def score_in_batches(lengths: Sequence[int], batch_size: int, score: Callable[[list[int]], Sequence[T]], *,
                     desc: str, progress: bool) -> list[T]:
    """``score(indices)`` over batches of similar length (:func:`~llm_calib.engine.packing.length_batches`), in
    input order.

    Example:
        >>> score_in_batches([3, 1, 2], 2, lambda idx: [10 * i for i in idx], desc="x", progress=False)
        [0, 10, 20]
    """
    out: list[Any] = [None] * len(lengths)
    bar = progress_bar(total=len(lengths), desc=desc, enabled=progress)
    try:
        for idx in length_batches(lengths, batch_size):
            for i, value in zip(idx, score(idx), strict=True):
                out[i] = value
            bar.update(len(idx))
    finally:
        bar.close()
    return out


def score_sharing_prefixes(
    model: Any, prompts: Sequence[Sequence[int]], lengths: Sequence[int], batch_size: int,
    score: Callable[[list[int], list[PrefixKV | None]], Sequence[T]], *, settings: PrefixCacheSettings, desc: str,
    progress: bool,
) -> tuple[list[T], PrefixCacheStats | None]:
    """``score(indices, prefixes)`` over batches that share prompt prefixes
    (:func:`~llm_calib.engine.prefix.plan_prefix_batches`, flat batches where the model runs them:
    :func:`~llm_calib.engine.flat.flat_supported`), in input order, with the prefix each row continues
    and the cache's counts; with the cache off (``settings.enabled`` False) exactly
    :func:`score_in_batches` with no prefixes and no counts.

    Example:
        >>> from llm_calib.engine.prefix import PrefixCacheSettings
        >>> from llm_calib.models import tiny_random_model
        >>> model = tiny_random_model()[0]
        >>> prompts = [[7] * 20 + [1], [7] * 20 + [2], [3]]
        >>> out, stats = score_sharing_prefixes(model, prompts, [21, 21, 1], 4, lambda idx, kvs: [kv.length if kv
        ...     else 0 for kv in kvs], settings=PrefixCacheSettings(), desc="x", progress=False)
        >>> out, stats.tokens_saved
        ([20, 20, 0], 20)
    """
    if not settings.enabled or not prompts:
        return score_in_batches(lengths, batch_size, lambda idx: score(idx, [None] * len(idx)), desc=desc,
                                progress=progress), None
    stats = PrefixCacheStats()
    flat = flat_supported(model)
    plan = plan_prefix_batches(prompts, lengths, batch_size, bytes_per_token=kv_bytes_per_token(model),
                               max_bytes=settings.max_mb * 2**20, flat=flat)
    bar = progress_bar(total=len(prompts), desc=desc, enabled=progress)
    try:
        out = run_prefix_plan(model, prompts, plan, score, stats=stats, on_batch=bar.update, flat=flat)
    finally:
        bar.close()
    return out, stats


def progress_bar(*, total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar counting ``total`` questions, or a no-op stand-in (``update``, ``close``) when not ``enabled``.

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
