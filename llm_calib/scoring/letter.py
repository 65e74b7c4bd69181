"""Letter scoring: the options are listed in the prompt as ``A.``, ``B.``, ...; the score of an
option is the log-probability of its letter token at the answer position, renormalised over the
options (softmax over the letter scores).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from llm_calib.data.records import MultipleChoice
from llm_calib.engine.options import target_logprobs
from llm_calib.engine.packing import length_batches, pack_letters
from llm_calib.prompts import (
    PromptFormat,
    option_letters,
    record_prompt,
    record_uses_chat_template,
    uses_chat_template,
)
from llm_calib.scoring.base import ScoredSet, check_records, encode_prompt, progress_bar

__all__ = ["letter_token_ids", "score_letter"]


def letter_token_ids(tokenizer: Any, n: int) -> list[int]:
    """Token ids of the first ``n`` option letters as the model would write them after the prefix.

    Uses the single-token forms ``" A"``, ``" B"``, ... when every letter has one (byte-level BPE
    tokenizers), else ``"A"``, ``"B"``, ...

    Args:
        tokenizer: a Hugging Face tokenizer.
        n: number of letters.

    Returns:
        One token id per letter.

    Raises:
        ValueError: if some letter is not a single token in either form.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> tok.convert_ids_to_tokens(letter_token_ids(tok, 3))
        ['ĠA', 'ĠB', 'ĠC']
    """
    letters = option_letters(n)
    for template in (" {}", "{}"):
        ids = [
            tokenizer(template.format(c), add_special_tokens=False)["input_ids"] for c in letters
        ]
        if all(len(i) == 1 for i in ids):
            return [i[0] for i in ids]
    raise ValueError(
        f"the tokenizer has no single-token form of the option letters {letters!r}; "
        "use scorer='option_likelihood' instead"
    )


def score_letter(
    model: Any,
    tokenizer: Any,
    records: Sequence[MultipleChoice],
    *,
    prompt: PromptFormat | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> ScoredSet:
    """Score multiple-choice questions by the logits of the option letters.

    The prompt lists the options (``prompt.style`` must be ``"listed"``); the scores are the
    log-probabilities of the letter tokens at the position after the prompt (the answer prefix),
    so ``softmax(scores)`` renormalises the model's letter probabilities over the options.
    ``info["letter_mass"]`` is the mean total probability the model puts on the option letters.

    Args:
        model: a Hugging Face causal LM.
        tokenizer: its tokenizer.
        records: multiple-choice records (at most 26 options).
        prompt: the prompt format; default ``PromptFormat(style="listed")``.
        batch_size: prompts per forward pass.
        progress: show a tqdm progress bar.

    Returns:
        A :class:`~llm_calib.scoring.base.ScoredSet` with ``scorer="letter"``.

    Raises:
        ValueError: the prompt style is not ``"listed"``, ``batch_size < 1``, malformed records,
            or a tokenizer without single-token option letters.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> qs = [MultipleChoice("Capital of France?", ("Paris", "Rome"), 0, "geo", "q0")]
        >>> s = score_letter(model, tok, qs)
        >>> len(s.logits[0]), round(float(s.probs[0].sum()), 5)
        (2, 1.0)
    """
    fmt = prompt or PromptFormat(style="listed")
    if fmt.style != "listed" and fmt.template is None:
        raise ValueError(
            f"the letter scorer needs the options listed in the prompt: prompt.style must be "
            f"'listed' (or a template that lists them), got {fmt.style!r}"
        )
    fmt = replace(fmt, choices="letters")  # few-shot examples are answered with their letter
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    records = check_records(records)
    chat = uses_chat_template(tokenizer, fmt)
    max_k = max((len(r.options) for r in records), default=2)
    letter_ids = letter_token_ids(tokenizer, max_k)
    texts = [record_prompt(tokenizer, r, fmt) for r in records]
    prompts = [encode_prompt(tokenizer, t, chat=chat and record_uses_chat_template(tokenizer, r, fmt))
               for r, t in zip(records, texts, strict=True)]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    scores: list[torch.Tensor | None] = [None] * len(records)
    mass: list[float] = [0.0] * len(records)
    bar = progress_bar(total=len(records), desc="letter", enabled=progress)
    try:
        for idx in length_batches([len(p) for p in prompts], batch_size):
            letters = [letter_ids[: len(records[i].options)] for i in idx]
            packed = pack_letters([prompts[i] for i in idx], letters, pad_id)
            with torch.inference_mode():
                token_lp = target_logprobs(model, packed).double().cpu()
            for i, s in zip(idx, torch.split(token_lp, packed.n_options), strict=True):
                scores[i] = s
                mass[i] = float(s.exp().sum())
            bar.update(len(idx))
    finally:
        bar.close()
    return ScoredSet(
        logits=[s for s in scores if s is not None],
        labels=[r.gold for r in records],
        domains=[r.domain for r in records],
        ids=[r.id for r in records],
        scorer="letter",
        info={
            "prompt_style": fmt.style,
            "chat_template": chat,
            "answer_prefix": fmt.answer_prefix,
            "letter_mass": float(np.mean(mass)) if mass else float("nan"),
        },
        details=[
            {
                "prompt": t,
                "choices": list(option_letters(len(r.options))),
                "continuations": [tokenizer.decode([i]) for i in letter_ids[: len(r.options)]],
                "token_ids": [[i] for i in letter_ids[: len(r.options)]],
                "loglik": [float(v) for v in s],
                "n_tokens": [1] * len(r.options),
                "n_chars": [1] * len(r.options),
                "n_bytes": [1] * len(r.options),
            }
            for t, r, s in zip(texts, records, scores, strict=True)
            if s is not None
        ],
    )
