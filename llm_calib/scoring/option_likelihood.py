"""Option-likelihood scoring: the log-probability of each option's text after the prompt, one
forward pass per batch of questions through the engine (:mod:`llm_calib.engine.options`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from llm_calib.config.choices import NORMALIZE_MODES
from llm_calib.data.records import MultipleChoice
from llm_calib.engine.context import fit_options
from llm_calib.engine.flat import flat_supported, prefixes_per_row
from llm_calib.engine.options import forward_rows, target_logprobs
from llm_calib.engine.packing import accepts_packed_masks, pack_questions
from llm_calib.engine.prefix import PrefixKV, forward_rows_after, prefix_cache_settings
from llm_calib.prompts.templates import (
    PromptFormat,
    option_continuations,
    record_prompt,
    uses_chat_template,
)
from llm_calib.scoring.base import (
    ScoredSet,
    check_records,
    encode_continuation,
    encode_prompts,
    record_label,
    score_sharing_prefixes,
)

__all__ = [
    "LM_EVAL_NORMALIZATIONS", "NORMALIZE_MODES", "STRATEGIES", "EncodedQuestion", "encode_questions", "normalized",
    "option_log_likelihoods", "option_text_lengths", "score_option_likelihood",
]


STRATEGIES = ("packed", "padded")
"""Batch layouts of :func:`score_option_likelihood`: ``"packed"`` (one row per question, the prompt
computed once) or ``"padded"`` (one row per option, for attention a 4-D mask cannot express)."""


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


def encode_questions(tokenizer: Any, records: Sequence[MultipleChoice], fmt: PromptFormat) -> list[EncodedQuestion]:
    """One :class:`EncodedQuestion` per record, prompt and continuations tokenised separately
    (ValueError for a prompt of no tokens).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> q = MultipleChoice("Capital of France?", ("Paris", "Rome"), 0, "geo", "q0")
        >>> enc = encode_questions(tok, [q], PromptFormat())[0]
        >>> tok.decode(enc.options[0])
        ' Paris'
    """
    out = []
    for r, prompt in zip(records, encode_prompts(tokenizer, records, fmt), strict=True):
        if not prompt:
            raise ValueError(f"record {r.id!r}: the prompt tokenises to no tokens")
        options = [encode_continuation(tokenizer, c) for c in option_continuations(r, fmt)]
        prompt, options = fit_options(prompt, options, record_label(r))  # the model's context (engine.context)
        out.append(EncodedQuestion(tuple(prompt), tuple(tuple(o) for o in options)))
    return out


def _choices(record: MultipleChoice, fmt: PromptFormat) -> list[str]:
    """The scored choice strings without the target delimiter (what lm-eval measures)."""
    if fmt.choices == "letters":
        return [c[len(fmt.target_delimiter):] for c in option_continuations(record, fmt)]
    return [o.strip() for o in record.options]


def option_text_lengths(record: MultipleChoice, fmt: PromptFormat, normalize: str) -> list[int]:
    """Each choice's length in characters (``"char"``) or UTF-8 bytes (``"byte"``) without the target
    delimiter, as lm-eval (ValueError for another ``normalize``).

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


def _question_details(
    tokenizer: Any, record: MultipleChoice, fmt: PromptFormat, item: EncodedQuestion,
    token_logprobs: Sequence[torch.Tensor],
) -> dict[str, Any]:
    """What was scored for one question (see :attr:`ScoredSet.details`)."""
    return {
        "prompt": record_prompt(tokenizer, record, fmt), "choices": _choices(record, fmt),
        "continuations": list(option_continuations(record, fmt)), "token_ids": [list(o) for o in item.options],
        "loglik": [float(lp.sum()) for lp in token_logprobs], "n_tokens": [len(o) for o in item.options],
        "n_chars": option_text_lengths(record, fmt, "char"), "n_bytes": option_text_lengths(record, fmt, "byte"),
    }


def _option_scores(details: dict[str, Any], normalize: str) -> torch.Tensor:
    """One question's float64 option scores: summed log-likelihoods, divided by a length unless ``"sum"``."""
    loglik = torch.tensor(details["loglik"], dtype=torch.float64)
    key = {"mean": "n_tokens", "char": "n_chars", "byte": "n_bytes"}.get(normalize)
    return loglik if key is None else loglik / torch.tensor(details[key], dtype=torch.float64)


def option_log_likelihoods(model: Any, items: Sequence[EncodedQuestion], *, pad_id: int = 0,
                           strategy: Literal["packed", "padded"] = "packed",
                           prefix: PrefixKV | Sequence[PrefixKV | None] | None = None) -> list[list[torch.Tensor]]:
    """``out[q][k]``: float64 log-probabilities of option ``k``'s tokens of question ``q``, in one
    forward pass (``"packed"``: flat where the model runs it, :mod:`llm_calib.engine.flat`; one
    row per option for attention without 4-D masks). With ``prefix`` (the keys/values of the
    first ``prefix.length`` tokens every prompt starts with,
    :func:`~llm_calib.engine.prefix.compute_prefix`, or one prefix or None per question) only the
    rest of each row runs.

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
    per_row = prefixes_per_row(prefix, len(items))
    packed = pack_questions([(it.prompt[kv.length if kv is not None else 0 :], it.options)
                             for it, kv in zip(items, per_row, strict=True)], pad_id)
    with torch.inference_mode():
        if strategy == "packed":  # flat (unpadded) where the model allows, on the prefix's keys/values as they are
            hidden = forward_rows_after(model, per_row, packed)
        else:  # one row per option
            hidden, _ = forward_rows(model, packed, packed_masks=False)
        token_lp = target_logprobs(model, packed, hidden)
    # targets are laid out option by option, so each option's tokens are one contiguous run
    flat = iter(torch.split(token_lp.double().cpu(), packed.option_lengths.tolist()))
    return [[next(flat) for _ in it.options] for it in items]


def score_option_likelihood(
    model: Any, tokenizer: Any, records: Sequence[MultipleChoice], *,
    normalize: Literal["sum", "mean"] = "sum", prompt: PromptFormat | None = None, batch_size: int = 8,
    strategy: Literal["packed", "padded"] = "packed", progress: bool = False,
    prefix_cache: bool | None = None, prefix_cache_mb: float | None = None,
) -> ScoredSet:
    """Score multiple-choice questions by the log-likelihood of ``target_delimiter + option`` after the
    prompt (default ``PromptFormat()``): probabilities are the softmax over the options' scores under
    ``normalize`` (:data:`NORMALIZE_MODES`); ``details`` keep every option's summed log-likelihood and
    lengths, so other normalisations need no second pass (:func:`normalized`). ``batch_size``:
    questions per forward pass; ``strategy``: a :data:`STRATEGIES` layout.

    Questions whose prompts start with the same tokens (a few-shot context, a task description)
    share them (:mod:`llm_calib.engine.prefix`): the prefix's keys/values are computed once per
    group and only the rest runs per question, same scores up to float rounding; ``info["prefix_cache"]``
    reports the groups, tokens saved and peak bytes. ``prefix_cache`` (default: on, or as set by
    :func:`~llm_calib.engine.prefix.prefix_cache`) turns it off (scores then bit-identical to
    scoring without it), ``prefix_cache_mb`` bounds the prefix keys/values of one batch (MiB). The
    ``"padded"`` strategy and attention without 4-D masks score without it.

    Raises:
        ValueError: an unknown ``normalize`` or ``strategy``, ``batch_size < 1``, or malformed records.

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

    settings = prefix_cache_settings(prefix_cache, prefix_cache_mb)
    if strategy != "packed" or not (flat_supported(model) or accepts_packed_masks(model)):  # flat or a 4-D mask
        settings = replace(settings, enabled=False)

    def score(idx: list[int], prefixes: list[PrefixKV | None]) -> list[list[torch.Tensor]]:
        return option_log_likelihoods(model, [items[i] for i in idx], pad_id=pad_id, strategy=strategy,
                                      prefix=prefixes)

    token_lps, stats = score_sharing_prefixes(model, [it.prompt for it in items], [it.n_tokens for it in items],
                                              batch_size, score, settings=settings, desc="option likelihood",
                                              progress=progress)
    details = [_question_details(tokenizer, r, fmt, item, per_option)
               for r, item, per_option in zip(records, items, token_lps, strict=True)]
    scores = [_option_scores(d, normalize) for d in details]
    info = {"normalize": normalize, "prompt_style": fmt.style, "chat_template": uses_chat_template(tokenizer, fmt),
            "answer_prefix": fmt.answer_prefix, "strategy": strategy, "template": fmt.template, "fewshot": fmt.fewshot}
    if stats is not None:
        info["prefix_cache"] = stats.as_dict()
    return ScoredSet.from_records(records, scores, "option_likelihood", info, details)


LM_EVAL_NORMALIZATIONS: dict[str, str] = {"acc": "sum", "acc_norm": "char", "acc_bytes": "byte", "acc_token": "mean"}
"""lm-eval's metric names (``acc``, ``acc_norm``, ``acc_bytes``; ``acc_token`` is ours) and their ``normalize``
modes."""


def normalized(scored: ScoredSet, normalize: str) -> ScoredSet:
    """The same questions re-scored under ``normalize`` (a mode or lm-eval name) from ``scored.details``,
    no second pass (ValueError for an unknown mode or a set without details).

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
    out = scored.select(range(len(scored)))
    out.logits = [_option_scores(d, mode) for d in scored.details]
    out.info["normalize"] = mode
    return out
