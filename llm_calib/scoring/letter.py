"""Letter scoring: the options listed as ``A.``, ``B.``, ...; an option's score is the
log-probability of its letter at the answer position (softmax over the letters).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from llm_calib.data.records import MultipleChoice
from llm_calib.engine.flat import flat_supported
from llm_calib.engine.options import target_logprobs
from llm_calib.engine.packing import accepts_packed_masks, pack_letters
from llm_calib.engine.prefix import PrefixKV, forward_rows_after, prefix_cache_settings
from llm_calib.prompts.templates import (
    PromptFormat,
    option_letters,
    record_prompt,
    uses_chat_template,
)
from llm_calib.scoring.base import ScoredSet, check_records, encode_prompts, score_sharing_prefixes

__all__ = ["check_listed_prompt", "letter_token_ids", "score_letter"]


def letter_token_ids(tokenizer: Any, n: int) -> list[int]:
    """Token ids of the first ``n`` option letters: ``" A"``, ``" B"``, ... if single tokens, else ``"A"``,
    ...; ValueError if some letter is a single token in neither form.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> tok.convert_ids_to_tokens(letter_token_ids(tok, 3))
        ['ĠA', 'ĠB', 'ĠC']
    """
    letters = option_letters(n)
    for template in (" {}", "{}"):
        ids = [tokenizer(template.format(c), add_special_tokens=False)["input_ids"] for c in letters]
        if all(len(i) == 1 for i in ids):
            return [i[0] for i in ids]
    raise ValueError(
        f"the tokenizer has no single-token form of the option letters {letters!r}; "
        "use scorer='option_likelihood' instead"
    )


def check_listed_prompt(prompt: PromptFormat | None) -> None:
    """The letter scorer's rule: the prompt lists the options (style ``"listed"``, or a template); else ValueError.

    Example:
        >>> check_listed_prompt(PromptFormat(style="listed"))
    """
    if prompt is not None and prompt.style != "listed" and prompt.template is None:
        raise ValueError(
            "the letter scorer needs the options listed in the prompt: prompt style 'listed' "
            f"(or a template that lists them), got {prompt.style!r}"
        )


def score_letter(
    model: Any, tokenizer: Any, records: Sequence[MultipleChoice], *, prompt: PromptFormat | None = None,
    batch_size: int = 8, progress: bool = False, prefix_cache: bool | None = None,
    prefix_cache_mb: float | None = None,
) -> ScoredSet:
    """Score multiple-choice questions (at most 26 options) by the log-probabilities of the option
    letters after a prompt that lists them (default ``PromptFormat(style="listed")``);
    ``info["letter_mass"]`` is the mean total probability on the letters. Prompts starting with
    the same tokens share them through the prefix cache, as in
    :func:`~llm_calib.scoring.option_likelihood.score_option_likelihood` (``prefix_cache``,
    ``prefix_cache_mb``, ``info["prefix_cache"]``).

    Raises:
        ValueError: a prompt without the options, ``batch_size < 1``, bad records or letters of several tokens.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> qs = [MultipleChoice("Capital of France?", ("Paris", "Rome"), 0, "geo", "q0")]
        >>> s = score_letter(model, tok, qs)
        >>> len(s.logits[0]), round(float(s.probs[0].sum()), 5)
        (2, 1.0)
    """
    fmt = prompt or PromptFormat(style="listed")
    check_listed_prompt(fmt)
    fmt = replace(fmt, choices="letters")  # few-shot examples are answered with their letter
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    records = check_records(records)
    chat = uses_chat_template(tokenizer, fmt)
    max_k = max((len(r.options) for r in records), default=2)
    letter_ids = letter_token_ids(tokenizer, max_k)
    texts = [record_prompt(tokenizer, r, fmt) for r in records]
    prompts = encode_prompts(tokenizer, records, fmt, texts, reserve=0)  # the letters are read at the prompt's end
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def score(idx: list[int], prefixes: list[PrefixKV | None]) -> tuple[torch.Tensor, ...]:
        letters = [letter_ids[: len(records[i].options)] for i in idx]
        packed = pack_letters([prompts[i][kv.length if kv is not None else 0 :] for i, kv in zip(idx, prefixes, strict=True)],
                              letters, pad_id)
        with torch.inference_mode():
            hidden = forward_rows_after(model, prefixes, packed)
            return torch.split(target_logprobs(model, packed, hidden).double().cpu(), packed.n_options)

    settings = prefix_cache_settings(prefix_cache, prefix_cache_mb)
    if not (flat_supported(model) or accepts_packed_masks(model)):  # the prefix runs flat or under a 4-D mask
        settings = replace(settings, enabled=False)
    scores, stats = score_sharing_prefixes(model, prompts, [len(p) for p in prompts], batch_size, score,
                                           settings=settings, desc="letter", progress=progress)
    mass = [float(s.exp().sum()) for s in scores]
    info = {"prompt_style": fmt.style, "chat_template": chat, "answer_prefix": fmt.answer_prefix,
            "letter_mass": float(np.mean(mass)) if mass else float("nan")}
    if stats is not None:
        info["prefix_cache"] = stats.as_dict()
    details = []
    for t, r, s in zip(texts, records, scores, strict=True):
        ids, ones = letter_ids[: len(r.options)], [1] * len(r.options)
        details.append({"prompt": t, "choices": list(option_letters(len(r.options))),
                        "continuations": [tokenizer.decode([i]) for i in ids], "token_ids": [[i] for i in ids],
                        "loglik": [float(v) for v in s], "n_tokens": ones, "n_chars": ones, "n_bytes": ones})
    return ScoredSet.from_records(records, list(scores), "letter", info, details)
