"""Option-likelihood scoring: the log-probability of each option's text after the prompt.

Each question costs one forward pass, shared with the other questions of its batch. Two layouts:

* ``"packed"`` (default): one row per question, ``prompt + option_1 + ... + option_K``, with a 4-D
  attention mask under which every option attends to the prompt and to itself only, and position
  ids that restart after the prompt for every option. The prompt is computed once per question.
* ``"padded"``: the ``K`` sequences ``prompt + option_i`` as separate right-padded rows
  (:func:`~llm_calib.engine.packing.option_sequences`; the prompt is recomputed ``K`` times; works
  with any model that accepts a 2-D padding mask). Use it for
  models whose attention the packed 4-D mask cannot express (sliding-window attention on inputs
  longer than the window, attention implementations that ignore custom masks).

Either way the forward pass is the scoring engine's (:func:`llm_calib.engine.options.forward_rows`,
:func:`~llm_calib.engine.options.target_logprobs`): only the hidden states that predict an option
token go through the output head, and the position before the first option token is projected
once per question.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from llm_calib.data.records import MultipleChoice
from llm_calib.engine.options import forward_rows, target_logprobs
from llm_calib.engine.packing import accepts_packed_masks, length_batches, pack_questions
from llm_calib.prompts import (
    PromptFormat,
    option_continuations,
    record_prompt,
    record_uses_chat_template,
    uses_chat_template,
)
from llm_calib.scoring.base import (
    ScoredSet,
    check_records,
    encode_continuation,
    encode_prompt,
    progress_bar,
)

__all__ = [
    "LM_EVAL_NORMALIZATIONS",
    "NORMALIZE_MODES",
    "STRATEGIES",
    "EncodedQuestion",
    "encode_questions",
    "normalized",
    "option_log_likelihoods",
    "option_text_lengths",
    "question_details",
    "score_option_likelihood",
]

NORMALIZE_MODES = ("sum", "mean", "char", "byte")
"""``"sum"`` (summed token log-probabilities), ``"mean"`` (per token), ``"char"`` (divided by the
choice's length in characters, lm-eval's ``acc_norm``) or ``"byte"`` (by its UTF-8 length,
lm-eval's ``acc_bytes``)."""

STRATEGIES = ("packed", "padded")
"""Batch layouts of :func:`score_option_likelihood`."""


@dataclass(frozen=True)
class EncodedQuestion:
    """Token ids of one question: the prompt and every option continuation.

    Example:
        >>> EncodedQuestion((1, 2), ((3,), (4, 5))).n_tokens
        5
    """

    prompt: tuple[int, ...]
    options: tuple[tuple[int, ...], ...]

    @property
    def n_tokens(self) -> int:
        """Length of the packed row (prompt + all options)."""
        return len(self.prompt) + sum(len(o) for o in self.options)


def encode_questions(
    tokenizer: Any, records: Sequence[MultipleChoice], fmt: PromptFormat
) -> list[EncodedQuestion]:
    """Tokenise prompts and option continuations (separately; see :mod:`llm_calib.scoring.base`).

    Args:
        tokenizer: a Hugging Face tokenizer.
        records: multiple-choice records.
        fmt: the prompt format.

    Returns:
        One :class:`EncodedQuestion` per record.

    Raises:
        ValueError: a prompt that tokenises to no tokens.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> q = MultipleChoice("Capital of France?", ("Paris", "Rome"), 0, "geo", "q0")
        >>> enc = encode_questions(tok, [q], PromptFormat())[0]
        >>> tok.decode(enc.options[0])
        ' Paris'
    """
    chat = uses_chat_template(tokenizer, fmt)
    out = []
    for r in records:
        prompt = encode_prompt(tokenizer, record_prompt(tokenizer, r, fmt),
                               chat=chat and record_uses_chat_template(tokenizer, r, fmt))
        if not prompt:
            raise ValueError(f"record {r.id!r}: the prompt tokenises to no tokens")
        options = tuple(
            tuple(encode_continuation(tokenizer, c)) for c in option_continuations(r, fmt)
        )
        out.append(EncodedQuestion(tuple(prompt), options))
    return out


def _choices(record: MultipleChoice, fmt: PromptFormat) -> list[str]:
    """The scored choice strings without the target delimiter (what lm-eval measures)."""
    if fmt.choices == "letters":
        return [c[len(fmt.target_delimiter):] for c in option_continuations(record, fmt)]
    return [o.strip() for o in record.options]


def option_text_lengths(record: MultipleChoice, fmt: PromptFormat, normalize: str) -> list[int]:
    """The length of each scored choice of ``record`` under ``fmt`` that a ``"char"`` (characters,
    lm-eval's ``acc_norm``) or ``"byte"`` (UTF-8 bytes, ``acc_bytes``) option score is divided by:
    the choice without the target delimiter, as lm-eval measures it.

    Raises:
        ValueError: ``normalize`` is neither ``"char"`` nor ``"byte"``.

    Example:
        >>> q = MultipleChoice("Capital?", ("Paris", "Zürich"), 0, "geo", "q0")
        >>> option_text_lengths(q, PromptFormat(), "char"), option_text_lengths(q, PromptFormat(), "byte")
        ([5, 6], [5, 7])
    """
    if normalize == "char":
        return [len(c) for c in _choices(record, fmt)]
    if normalize == "byte":
        return [len(c.encode("utf-8")) for c in _choices(record, fmt)]
    raise ValueError(f"normalize must be 'char' or 'byte', got {normalize!r}")


def question_details(
    tokenizer: Any, record: MultipleChoice, fmt: PromptFormat, item: EncodedQuestion,
    token_logprobs: Sequence[torch.Tensor],
) -> dict[str, Any]:
    """What was scored for one question (see :attr:`ScoredSet.details`).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> q = MultipleChoice("Capital?", ("Paris", "Rome"), 0, "geo", "q0")
        >>> item = encode_questions(tok, [q], PromptFormat())[0]
        >>> lps = [torch.full((len(o),), -1.0, dtype=torch.float64) for o in item.options]
        >>> d = question_details(tok, q, PromptFormat(), item, lps)
        >>> d["choices"], d["n_chars"], d["loglik"][0] == -len(item.options[0])
        (['Paris', 'Rome'], [5, 4], True)
    """
    choices = _choices(record, fmt)
    return {
        "prompt": record_prompt(tokenizer, record, fmt),
        "choices": choices,
        "continuations": list(option_continuations(record, fmt)),
        "token_ids": [list(o) for o in item.options],
        "loglik": [float(lp.sum()) for lp in token_logprobs],
        "n_tokens": [len(o) for o in item.options],
        "n_chars": option_text_lengths(record, fmt, "char"),
        "n_bytes": option_text_lengths(record, fmt, "byte"),
    }


def _aggregate(lp: torch.Tensor, normalize: str, n_chars: int, n_bytes: int) -> torch.Tensor:
    if normalize == "sum":
        return lp.sum()
    if normalize == "mean":
        return lp.mean()
    return lp.sum() / (n_chars if normalize == "char" else n_bytes)


def option_log_likelihoods(
    model: Any,
    items: Sequence[EncodedQuestion],
    *,
    pad_id: int = 0,
    strategy: Literal["packed", "padded"] = "packed",
) -> list[list[torch.Tensor]]:
    """Token log-probabilities of every option of a batch of questions, in one forward pass.

    Args:
        model: a Hugging Face causal LM.
        items: encoded questions (from :func:`encode_questions`).
        pad_id: id used for padding (its value never influences the result).
        strategy: ``"packed"`` or ``"padded"`` (see the module docstring). ``"packed"`` falls
            back to ``"padded"`` for attention implementations without 4-D masks
            (:func:`~llm_calib.engine.packing.accepts_packed_masks`).

    Returns:
        ``out[q][k]``: float64 tensor of the log-probabilities of option ``k``'s tokens of question
        ``q``.

    Raises:
        ValueError: an unknown ``strategy``.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> lp = option_log_likelihoods(model, [EncodedQuestion((5, 6, 7), ((8, 9), (10,)))])
        >>> [t.shape[0] for t in lp[0]]
        [2, 1]
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not items:
        return []
    packed = pack_questions([(it.prompt, it.options) for it in items], pad_id)
    # the packed layout's 4-D masks need eager or sdpa attention; flash kernels get one row per option
    use_masks = strategy == "packed" and accepts_packed_masks(model)
    with torch.inference_mode():
        hidden, _ = forward_rows(model, packed, packed_masks=use_masks)
        token_lp = target_logprobs(model, packed, hidden)
    # targets are laid out option by option, so each option's tokens are one contiguous run
    flat = list(torch.split(token_lp.double().cpu(), packed.option_lengths.tolist()))
    out, i = [], 0
    for it in items:
        out.append(flat[i : i + len(it.options)])
        i += len(it.options)
    return out


def score_option_likelihood(
    model: Any,
    tokenizer: Any,
    records: Sequence[MultipleChoice],
    *,
    normalize: Literal["sum", "mean"] = "sum",
    prompt: PromptFormat | None = None,
    batch_size: int = 8,
    strategy: Literal["packed", "padded"] = "packed",
    progress: bool = False,
) -> ScoredSet:
    """Score multiple-choice questions by the likelihood of each option's text.

    The score of option ``k`` is the summed (``normalize="sum"``), per-token (``"mean"``),
    per-character (``"char"``, lm-eval's ``acc_norm``) or per-byte (``"byte"``) log-probability
    of the continuation ``target_delimiter + option`` after the prompt; probabilities are the
    softmax over options. ``details`` of the result keep every option's summed log-likelihood and
    lengths, so the other normalisations need no second pass
    (:func:`llm_calib.scoring.normalized`). Questions are sorted by length and scored
    ``batch_size`` at a time, one forward pass per batch; results come back in input order.

    Args:
        model: a Hugging Face causal LM (eval mode).
        tokenizer: its tokenizer.
        records: :class:`~llm_calib.data.records.MultipleChoice` records.
        normalize: one of :data:`NORMALIZE_MODES`.
        prompt: the prompt format; default ``PromptFormat()`` (cloze, the reference format).
        batch_size: questions per forward pass (>= 1).
        strategy: ``"packed"`` (default) or ``"padded"`` batch layout.
        progress: show a tqdm progress bar.

    Returns:
        A :class:`~llm_calib.scoring.base.ScoredSet`.

    Raises:
        ValueError: an unknown ``normalize`` or ``strategy``, ``batch_size < 1``, or malformed
            records.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> qs = [MultipleChoice("Capital of France?", ("Paris", "Rome", "Oslo"), 0, "geo", "q0")]
        >>> s = score_option_likelihood(model, tok, qs)
        >>> s.logits[0].shape, round(float(s.probs[0].sum()), 5)
        (torch.Size([3]), 1.0)
    """
    if normalize not in NORMALIZE_MODES:
        raise ValueError(f"normalize must be one of {NORMALIZE_MODES}, got {normalize!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    records = check_records(records)
    fmt = prompt or PromptFormat()
    items = encode_questions(tokenizer, records, fmt)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    scores: list[torch.Tensor | None] = [None] * len(items)
    details: list[dict[str, Any]] = [{}] * len(items)
    bar = progress_bar(total=len(items), desc="option likelihood", enabled=progress)
    try:
        for idx in length_batches([it.n_tokens for it in items], batch_size):
            lps = option_log_likelihoods(
                model, [items[i] for i in idx], pad_id=pad_id, strategy=strategy
            )
            for i, per_option in zip(idx, lps, strict=True):
                d = question_details(tokenizer, records[i], fmt, items[i], per_option)
                agg = [
                    _aggregate(lp, normalize, c, b)
                    for lp, c, b in zip(per_option, d["n_chars"], d["n_bytes"], strict=True)
                ]
                scores[i] = torch.stack(agg)
                details[i] = d
            bar.update(len(idx))
    finally:
        bar.close()
    return ScoredSet(
        logits=[s for s in scores if s is not None],
        labels=[r.gold for r in records],
        domains=[r.domain for r in records],
        ids=[r.id for r in records],
        scorer="option_likelihood",
        info={
            "normalize": normalize,
            "prompt_style": fmt.style,
            "chat_template": uses_chat_template(tokenizer, fmt),
            "answer_prefix": fmt.answer_prefix,
            "strategy": strategy,
            "template": fmt.template,
            "fewshot": fmt.fewshot,
        },
        details=details,
    )


LM_EVAL_NORMALIZATIONS: dict[str, str] = {
    "acc": "sum",
    "acc_norm": "char",
    "acc_bytes": "byte",
    "acc_token": "mean",
}
"""Report names of the option-score normalisations and the ``normalize`` mode of each: ``acc``
(summed log-likelihood), ``acc_norm`` (per character of the choice) and ``acc_bytes`` (per UTF-8
byte) mean what lm-eval's metrics of those names mean; ``acc_token`` (per token) is ours."""


def normalized(scored: ScoredSet, normalize: str) -> ScoredSet:
    """The same questions with option scores normalised another way, without a second pass.

    Needs ``scored.details`` (filled by :func:`score_option_likelihood` and the letter scorer):
    the score of an option becomes its summed log-likelihood divided by its token count
    (``"mean"``), its character count (``"char"``) or its byte count (``"byte"``), or the sum
    itself (``"sum"``).

    Args:
        scored: a scored set with details.
        normalize: one of :data:`NORMALIZE_MODES`, or a key of :data:`LM_EVAL_NORMALIZATIONS`.

    Returns:
        A :class:`~llm_calib.scoring.base.ScoredSet` (``info["normalize"]`` updated).

    Raises:
        ValueError: an unknown ``normalize`` or a set without details.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> qs = [MultipleChoice("Capital of France?", ("Paris", "Rome"), 0, "geo", "q0")]
        >>> s = score_option_likelihood(model, tok, qs)
        >>> n = normalized(s, "acc_norm")
        >>> bool(torch.allclose(n.logits[0] * torch.tensor([5.0, 4.0], dtype=torch.float64), s.logits[0]))
        True
    """
    mode = LM_EVAL_NORMALIZATIONS.get(normalize, normalize)
    if mode not in NORMALIZE_MODES:
        raise ValueError(
            f"normalize must be one of {NORMALIZE_MODES} or {tuple(LM_EVAL_NORMALIZATIONS)}, got {normalize!r}"
        )
    if scored.details is None:
        raise ValueError("normalized() needs ScoredSet.details (score with score_option_likelihood)")
    key = {"mean": "n_tokens", "char": "n_chars", "byte": "n_bytes"}.get(mode)
    logits = []
    for d in scored.details:
        ll = torch.tensor(d["loglik"], dtype=torch.float64)
        logits.append(ll if key is None else ll / torch.tensor(d[key], dtype=torch.float64))
    out = scored.select(range(len(scored)))
    out.logits = logits
    out.info["normalize"] = mode
    return out
