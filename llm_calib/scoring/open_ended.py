"""Open-ended QA: greedy answers, token-probability confidences, SQuAD exact match and F1.

The answer is the greedy continuation of the prompt (see :mod:`llm_calib.prompts`) up to the first
newline or end-of-sequence token, decoded by the scoring engine's one greedy decoder
(:mod:`llm_calib.engine.decode`; :func:`generate_greedy`, :class:`GreedyAnswer`,
:func:`eos_token_ids` and :func:`finish_answer` are re-exported here). Its confidence is the mean probability of its tokens (product and
minimum are reported too). An answer is correct when its SQuAD-normalised form equals that of any
accepted alias; token F1 (maximum over aliases) is the soft variant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llm_calib.answers import exact_match, token_f1
from llm_calib.data.records import OpenQA
from llm_calib.engine.decode import GreedyAnswer, eos_token_ids, finish_answer, generate_greedy
from llm_calib.engine.packing import length_batches
from llm_calib.prompts import PromptFormat, record_prompt, uses_chat_template
from llm_calib.scoring.base import encode_prompt, progress_bar

__all__ = [
    "GreedyAnswer",
    "OpenEndedSet",
    "encode_open_prompts",
    "eos_token_ids",
    "finish_answer",
    "generate_greedy",
    "score_open_ended",
]

@dataclass
class OpenEndedSet:
    """Greedy answers to open questions with confidences and correctness.

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
    return [encode_prompt(tokenizer, record_prompt(tokenizer, r, fmt), chat=chat) for r in records]


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
            outs = generate_greedy(model, tokenizer, [prompts[i] for i in idx], max_new_tokens=max_new_tokens)
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
