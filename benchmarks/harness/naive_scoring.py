"""Slow reference implementation of option likelihood: one full forward pass per option.

Not part of the library: the baseline of the speed benchmark (``llm_speed.py``) and the reference
the tests compare the batched scorer with (it must agree to 1e-5). It runs the model's own forward on ``prompt + option`` with no padding, no custom
masks and the full output head, so its correctness is easy to check by reading.

:func:`option_scores_naive` is the differentiable counterpart used for training references: the
same one-sequence-per-option computation with trainable parameters substituted through
:func:`torch.func.functional_call`, returning option scores shaped like
:func:`llm_calib.engine.packing.option_scores_from_logits`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from llm_calib.adjustment import LogitAdjustment
from llm_calib.calm.lora import FunctionalLM
from llm_calib.calm.losses import CalmLosses
from llm_calib.data.records import MultipleChoice
from llm_calib.engine.packing import PackedQuestions
from llm_calib.formats import MultipleChoiceFormat
from llm_calib.prompts.templates import PromptFormat, uses_chat_template
from llm_calib.scoring.base import ScoredSet, check_records, progress_bar
from llm_calib.scoring.option_likelihood import NORMALIZE_MODES, EncodedQuestion, encode_questions
from llm_calib.training_interface import Batch

__all__ = ["NaiveCalmLosses", "option_scores_naive", "score_option_likelihood_naive", "unpack_questions"]

# One question for option_scores_naive: an encoded question or (prompt_ids, [option_ids, ...]).
_Item = EncodedQuestion | tuple[Sequence[int], Sequence[Sequence[int]]]


def option_scores_naive(
    model: Any,
    items: Sequence[_Item],
    theta: Mapping[str, Tensor] | None = None,
    *,
    normalize: Literal["sum", "mean"] = "sum",
    logits_transform: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Differentiable option scores, one full forward pass per option (reference; slow).

    For every option the sequence ``prompt + option`` alone (batch of one, no padding, no custom
    mask) goes through the whole model, with ``theta`` substituted for the model's parameters of
    the same names through :func:`torch.func.functional_call`; the output head runs at every
    position (the model's own forward), the logits predicting the option's tokens are sliced out,
    optionally transformed (e.g. a logit adjustment), and the option's token log-probabilities are
    summed or averaged. Gradients flow to ``theta`` and to whatever ``logits_transform`` closes
    over. The result is laid out as :func:`llm_calib.engine.packing.option_scores_from_logits`
    lays out the packed scorer's, so the two can be compared entry by entry.

    Args:
        model: a Hugging Face causal LM (or a peft wrapper of one).
        items: per question, an :class:`~llm_calib.scoring.option_likelihood.EncodedQuestion` or
            ``(prompt_ids, [option_ids, ...])``.
        theta: parameters to substitute, keyed by names relative to ``model`` (as in
            ``model.named_parameters()``); None runs the model's own parameters.
        normalize: ``"sum"`` or ``"mean"`` of each option's token log-probabilities.
        logits_transform: applied to the ``(n_tokens, V)`` logits of each option before the
            log-softmax (e.g. ``lambda z: adjustment.apply(z, lam)``).

    Returns:
        ``(B, K_max)`` option scores in the logits' float precision (float32 for half-precision
        models), ``-inf`` where a question has fewer options.

    Raises:
        ValueError: an unknown ``normalize``, no questions, an empty prompt or an empty option.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, _ = tiny_random_model()
        >>> theta = {k: v.detach().clone().requires_grad_(True)
        ...          for k, v in model.named_parameters() if k.endswith("q_proj.weight")}
        >>> s = option_scores_naive(model, [((5, 6, 7), ((8, 9), (10,)))], theta)
        >>> s.shape, s.requires_grad
        (torch.Size([1, 2]), True)
    """
    if normalize not in NORMALIZE_MODES:
        raise ValueError(f"normalize must be one of {NORMALIZE_MODES}, got {normalize!r}")
    if not items:
        raise ValueError("option_scores_naive needs at least one question")
    device = next(model.parameters()).device
    params = dict(theta) if theta is not None else None
    per_question: list[Tensor] = []
    for q, item in enumerate(items):
        prompt, options = (item.prompt, item.options) if isinstance(item, EncodedQuestion) else item
        p = len(prompt)
        if p == 0:
            raise ValueError(f"question {q}: empty prompt")
        scores = []
        for k, opt in enumerate(options):
            n = len(opt)
            if n == 0:
                raise ValueError(f"question {q}, option {k}: no tokens")
            kwargs = {"input_ids": torch.tensor([[*prompt, *opt]], device=device), "use_cache": False}
            if params is None:
                out = model(**kwargs)
            else:
                out = torch.func.functional_call(model, params, (), kwargs, strict=False)
            logits = out.logits[0, p - 1 : p - 1 + n]
            if logits.dtype in (torch.float16, torch.bfloat16):
                logits = logits.float()
            if logits_transform is not None:
                logits = logits_transform(logits)
            logp = torch.log_softmax(logits, dim=-1)
            tok_lp = logp[torch.arange(n, device=device), torch.tensor(list(opt), device=device)]
            scores.append(tok_lp.sum() if normalize == "sum" else tok_lp.mean())
        per_question.append(torch.stack(scores))
    width = max(s.shape[0] for s in per_question)
    return torch.stack(
        [torch.nn.functional.pad(s, (0, width - s.shape[0]), value=float("-inf")) for s in per_question]
    )


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


def unpack_questions(packed: PackedQuestions) -> list[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]]:
    """``(prompt, options)`` token ids per question, recovered from a ``pack_questions`` batch."""
    if packed.attention_mask.dim() != 4:
        raise ValueError("unpack_questions needs a pack_questions batch (4-D mask)")
    L = packed.input_ids.shape[1]
    ids = packed.input_ids.tolist()
    rows, target_rows = packed.rows.tolist(), packed.target_rows.tolist()
    lengths = packed.option_lengths.tolist()
    first_target: dict[int, int] = {}
    for t, o in enumerate(packed.target_option.tolist()):
        first_target.setdefault(o, t)
    out, option = [], 0
    for b, k in enumerate(packed.n_options):
        p = rows[target_rows[first_target[option]]] - b * L + 1
        offset, opts = p, []
        for n in lengths[option : option + k]:
            opts.append(tuple(ids[b][offset : offset + n]))
            offset += n
        out.append((tuple(ids[b][:p]), tuple(opts)))
        option += k
    return out


class NaiveCalmLosses(CalmLosses):
    """:class:`CalmLosses` whose option scores come from the naive one-sequence-per-option path.

    The batch's packed layout only tells which tokens to score; every option then runs alone
    through the whole model (θ substituted with ``functional_call``), with the full output head.
    The losses themselves (g, f, the baselines) are :class:`CalmLosses`' own: only the option
    scores they are computed from change. Multiple choice only.
    """

    def __init__(self, lm: FunctionalLM, adjustment: LogitAdjustment, *args: Any, **kwargs: Any) -> None:
        super().__init__(lm, adjustment, *args, **kwargs)
        name = next(n for n, m in lm.base.named_modules() if m is lm.decoder)
        self._prefix = f"{name}." if name else ""

    def model_params(self, theta: dict[str, Tensor]) -> dict[str, Tensor]:
        """θ (decoder-relative, as :class:`FunctionalLM` holds it) as parameters of the base model."""
        return {self._prefix + k: v for k, v in self.lm.decoder_parameters(theta).items()}

    def scores(self, theta: dict[str, Tensor] | None, lam: dict[str, Tensor] | None, batch: Batch) -> Tensor:
        if not isinstance(batch.format, MultipleChoiceFormat):
            raise NotImplementedError("the naive reference scores multiple-choice batches only")
        items = unpack_questions(batch.packed)
        params = None if theta is None else self.model_params(theta)
        on_options = lam is not None and self.adjustment.acts_on_options
        transform = None if lam is None or on_options else (lambda z: self.adjustment.apply(z, lam))
        scores = option_scores_naive(self.lm.base, items, params, normalize=self.normalize, logits_transform=transform)
        if on_options:  # an option-level λ acts on the finished option scores
            scores = self.adjustment.apply_options(scores, batch.packed.option_length_table(scores.device), lam)
        return scores
