"""Slow reference implementation of option likelihood: one full forward pass per option.

Used by the tests (the batched scorer must agree to 1e-5) and as the baseline of the speed
comparison. It runs the model's own forward on ``prompt + option`` with no padding, no custom
masks and the full output head, so its correctness is easy to check by reading.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from llm_calib.data.records import MultipleChoice
from llm_calib.prompts import PromptFormat, uses_chat_template
from llm_calib.scoring.base import ScoredSet, check_records, progress_bar
from llm_calib.scoring.option_likelihood import NORMALIZE_MODES, encode_questions

__all__ = ["score_option_likelihood_naive"]


def score_option_likelihood_naive(
    model: Any,
    tokenizer: Any,
    records: Sequence[MultipleChoice],
    *,
    normalize: Literal["sum", "mean"] = "sum",
    prompt: PromptFormat | None = None,
    progress: bool = False,
) -> ScoredSet:
    """Option likelihood computed one sequence per option (reference; slow).

    Args:
        model: a Hugging Face causal LM.
        tokenizer: its tokenizer.
        records: multiple-choice records.
        normalize: ``"sum"`` or ``"mean"`` of the option's token log-probabilities.
        prompt: the prompt format (default ``PromptFormat()``).
        progress: show a tqdm progress bar.

    Returns:
        A :class:`~llm_calib.scoring.base.ScoredSet` with ``scorer="option_likelihood_naive"``.

    Raises:
        ValueError: an unknown ``normalize`` or malformed records.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> qs = [MultipleChoice("2 + 2 = ?", ("4", "5"), 0, "math", "q0")]
        >>> score_option_likelihood_naive(model, tok, qs).logits[0].shape
        torch.Size([2])
    """
    if normalize not in NORMALIZE_MODES:
        raise ValueError(f"normalize must be one of {NORMALIZE_MODES}, got {normalize!r}")
    records = check_records(records)
    fmt = prompt or PromptFormat()
    device = next(model.parameters()).device
    scores = []
    bar = progress_bar(total=len(records), desc="option likelihood (naive)", enabled=progress)
    with torch.inference_mode():
        for item in encode_questions(tokenizer, records, fmt):
            p = len(item.prompt)
            per_option = []
            for opt in item.options:
                ids = torch.tensor([list(item.prompt) + list(opt)], device=device)
                logits = model(input_ids=ids).logits[0].float()
                logp = torch.log_softmax(logits[p - 1 : p - 1 + len(opt)], dim=-1)
                tok_lp = logp[torch.arange(len(opt)), torch.tensor(opt, device=device)].double()
                per_option.append(tok_lp.sum() if normalize == "sum" else tok_lp.mean())
            scores.append(torch.stack(per_option).cpu())
            bar.update(1)
    bar.close()
    return ScoredSet(
        logits=scores,
        labels=[r.gold for r in records],
        domains=[r.domain for r in records],
        ids=[r.id for r in records],
        scorer="option_likelihood_naive",
        info={
            "normalize": normalize,
            "prompt_style": fmt.style,
            "chat_template": uses_chat_template(tokenizer, fmt),
            "answer_prefix": fmt.answer_prefix,
        },
    )
