"""Multiple-choice formats: :class:`OptionLikelihood` (each option's text after a cloze prompt)
and :class:`Letter` (each option's letter after a prompt that lists them). Both score, train on
and monitor a distribution over the options.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from llm_calib.data.records import MultipleChoice
from llm_calib.engine.packing import PackedQuestions, pack_letters, pack_questions
from llm_calib.formats.base import TaskFormat
from llm_calib.formats.categorical import entropy, identity
from llm_calib.formats.registry import register_format
from llm_calib.metrics import calibration as metrics
from llm_calib.prompts.templates import PromptFormat
from llm_calib.scoring.base import ScoredSet, encode_prompts
from llm_calib.scoring.letter import check_listed_prompt, letter_token_ids, score_letter
from llm_calib.scoring.option_likelihood import (
    LM_EVAL_NORMALIZATIONS,
    encode_questions,
    normalized,
    option_text_lengths,
    score_option_likelihood,
)

if TYPE_CHECKING:
    from llm_calib.training_interface import Batch, Losses

__all__ = ["Letter", "MultipleChoiceFormat", "OptionLikelihood", "normalization_metrics", "normalization_summary"]


def normalization_summary(scored: ScoredSet, n_bins: int = 10) -> dict[str, dict[str, float]] | None:
    """:func:`normalization_metrics` of every lm-eval normalisation name (None without details).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.data import builtin_multiple_choice
        >>> model, tok = tiny_random_model()
        >>> s = score_option_likelihood(model, tok, builtin_multiple_choice(4, domains=["capitals"]))
        >>> sorted(normalization_summary(s))
        ['acc', 'acc_bytes', 'acc_norm', 'acc_token']
    """
    if scored.details is None or not len(scored):
        return None
    return {name: normalization_metrics(scored, name, n_bins) for name in LM_EVAL_NORMALIZATIONS}


def normalization_metrics(scored: ScoredSet, normalize: str, n_bins: int = 10) -> dict[str, float]:
    """``accuracy``, ``ece``, ``nll`` and ``brier`` of ``scored`` re-scored under one normalisation
    (:func:`~llm_calib.scoring.normalized`).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.data import builtin_multiple_choice
        >>> model, tok = tiny_random_model()
        >>> s = score_option_likelihood(model, tok, builtin_multiple_choice(4, domains=["capitals"]))
        >>> sorted(normalization_metrics(s, "acc_norm"))
        ['accuracy', 'brier', 'ece', 'nll']
    """
    s = normalized(scored, normalize)
    probs, labels = s.probs_numpy, s.labels_numpy
    conf, correct = metrics.confidence_correct(probs, labels)
    return {
        "accuracy": s.accuracy,
        "ece": metrics.ece(conf, correct, n_bins),
        "nll": metrics.nll(probs, labels),
        "brier": metrics.brier(probs, labels),
    }


class MultipleChoiceFormat(TaskFormat):
    """What the multiple-choice formats share: labels, option-distribution losses, temperature scaling, rows.

    A subclass registered by name (:func:`~llm_calib.formats.registry.register_format`) is a
    scorer; it is built as ``cls(normalize=..., prompt=...)`` and scores under
    :meth:`~llm_calib.formats.base.TaskFormat.prompt_settings` (its ``default_prompt`` when given
    no prompt; a configuration's ``style`` becomes a prompt through :meth:`configured_prompt`).

    Example:
        >>> issubclass(Letter, MultipleChoiceFormat), Letter().description
        (True, 'multiple choice')
    """

    name: ClassVar[str]
    family: ClassVar[str] = "multiple_choice"
    description: ClassVar[str] = "multiple choice"
    temperature_scalable: ClassVar[bool] = True

    @classmethod
    def configured_prompt(cls, style: str, chat_template: bool | None) -> PromptFormat:
        """The prompt format of a configuration's ``style`` and ``chat_template``.

        Example:
            >>> Letter.configured_prompt("cloze", None).style   # the letters need listed options
            'listed'
        """
        return PromptFormat(style=style, chat_template=chat_template)

    def label(self, record: MultipleChoice) -> int:
        """The gold option index."""
        return record.gold

    def categorical(
        self, losses: Losses, theta: dict[str, Tensor] | None, lam: dict[str, Tensor] | None, batch: Batch
    ) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor]]:
        """One option distribution per question (adjusted scores), the gold options, no reduction."""
        scores = losses.scores(theta, lam, batch)
        return scores, batch.labels.to(scores.device), identity

    def deployed_entropy(self, losses: Losses, theta: dict[str, Tensor] | None, batch: Batch) -> Tensor:
        """Entropy of the unadjusted option distribution."""
        return entropy(losses.scores(theta, None, batch))

    def monitor(self, losses: Losses, batch: Batch) -> dict[str, Tensor]:
        """Max probability, argmax correct, ``-log p(gold)`` and entropy of the option distribution."""
        scores = losses.scores(None, None, batch).double().cpu()
        p = torch.softmax(scores, -1)
        conf, pred = p.max(-1)
        labels = batch.labels.cpu()
        return {
            "confidence": conf,
            "correct": (pred == labels).double(),
            "nll": -torch.log(p[torch.arange(len(labels)), labels].clamp_min(1e-12)),
            "entropy": entropy(scores),
        }

    def temperature_scaled(self, scored: ScoredSet, temperature: float | None) -> ScoredSet | None:
        """``scored.scaled(temperature)`` (None without a temperature)."""
        return None if temperature is None else scored.scaled(temperature)

    def extra_metrics(self, scored: ScoredSet, n_bins: int = 10) -> dict[str, dict[str, float]] | None:
        """Every option-score normalisation side by side (:func:`normalization_summary`)."""
        return normalization_summary(scored, n_bins)

    def sample_rows(self, domain: str, scored: ScoredSet) -> Iterator[dict[str, Any]]:
        """Per question: what was scored, ``probs``, ``prediction``, ``gold``, ``confidence``, ``correct``,
        ``predictions``."""
        s = scored
        probs, preds, conf = s.probs_numpy, s.predictions, s.confidences
        by_norm = {n: normalized(s, n).predictions for n in LM_EVAL_NORMALIZATIONS} if s.details is not None else {}
        for i in range(len(s)):
            d = s.details[i] if s.details is not None else {}
            yield {
                "id": s.ids[i], "domain": domain, "prompt": d.get("prompt"), "options": d.get("choices"),
                "continuations": d.get("continuations"), "loglik": d.get("loglik"), "n_tokens": d.get("n_tokens"),
                "token_ids": d.get("token_ids"), "probs": [float(x) for x in probs[i]], "prediction": int(preds[i]),
                "gold": int(s.labels[i]), "confidence": float(conf[i]), "correct": bool(preds[i] == s.labels[i]),
                "predictions": {n: int(p[i]) for n, p in by_norm.items()},
            }


@register_format("option_likelihood")
@dataclass(frozen=True)
class OptionLikelihood(MultipleChoiceFormat):
    """Multiple choice scored by the log-likelihood of each option's text.

    Args:
        normalize: ``"sum"``, ``"mean"``, ``"char"`` or ``"byte"`` option scores (scoring and training).
        prompt: the prompt format; None: ``PromptFormat()`` (cloze).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.data import builtin_multiple_choice
        >>> model, tok = tiny_random_model()
        >>> qs = builtin_multiple_choice(2, domains=["capitals"])
        >>> fmt = OptionLikelihood()
        >>> prompts, options = fmt.encode(tok, qs)
        >>> fmt.pack(prompts, options, 0).batch_size, fmt.score(model, tok, qs).scorer
        (2, 'option_likelihood')
    """

    normalize: str = "sum"
    prompt: PromptFormat | None = None

    layout: ClassVar[str] = "options"
    auto_adjustment: ClassVar[str] = "option_temperature"
    default_prompt: ClassVar[PromptFormat] = PromptFormat()  # cloze

    def encode(self, tokenizer: Any, records: Sequence[MultipleChoice]) -> tuple[list[tuple[int, ...]], list[tuple[tuple[int, ...], ...]]]:
        """Prompt ids and each option's continuation ids
        (:func:`~llm_calib.scoring.option_likelihood.encode_questions`)."""
        enc = encode_questions(tokenizer, records, self.prompt_settings())
        return [e.prompt for e in enc], [e.options for e in enc]

    def option_text_lengths(self, record: MultipleChoice, normalize: str) -> list[int]:
        """:func:`~llm_calib.scoring.option_likelihood.option_text_lengths` under this format's prompt."""
        return option_text_lengths(record, self.prompt_settings(), normalize)

    def pack(self, prompts: Sequence[Sequence[int]], options: Sequence[Sequence[Sequence[int]]], pad_id: int) -> PackedQuestions:
        """Prompt followed by every option (:func:`~llm_calib.engine.packing.pack_questions`)."""
        return pack_questions(list(zip(prompts, options, strict=True)), pad_id)

    def score(self, model: Any, tokenizer: Any, records: Sequence[MultipleChoice], *, batch_size: int = 8,
              progress: bool = False) -> ScoredSet:
        """:func:`~llm_calib.scoring.option_likelihood.score_option_likelihood` under :meth:`prompt_settings`."""
        return score_option_likelihood(model, tokenizer, records, normalize=self.normalize,
                                       prompt=self.prompt_settings(), batch_size=batch_size, progress=progress)


@register_format("letter")
@dataclass(frozen=True)
class Letter(MultipleChoiceFormat):
    """Multiple choice scored by the option letters after a prompt that lists the options.

    Args:
        prompt: a prompt that lists the options (style ``"listed"`` or a template); None: listed.
        normalize: unused (letter scores are single tokens), as every multiple-choice format takes it.

    Raises:
        ValueError: a prompt that does not list the options.

    Example:
        >>> Letter().prompt_settings().style
        'listed'
        >>> Letter(PromptFormat(style="cloze"))
        Traceback (most recent call last):
        ...
        ValueError: the letter scorer needs the options listed in the prompt: prompt style 'listed' (or a template that lists them), got 'cloze'
    """

    prompt: PromptFormat | None = None
    normalize: str = "sum"

    layout: ClassVar[str] = "letter"
    auto_adjustment: ClassVar[str] = "answer_tokens"
    default_prompt: ClassVar[PromptFormat] = PromptFormat(style="listed")

    def __post_init__(self) -> None:
        check_listed_prompt(self.prompt)

    @classmethod
    def configured_prompt(cls, style: str, chat_template: bool | None) -> PromptFormat:
        """The listed prompt, whatever ``style`` a configuration gives (its options must be listed)."""
        return PromptFormat(style="listed", chat_template=chat_template)

    def encode(self, tokenizer: Any, records: Sequence[MultipleChoice]) -> tuple[list[tuple[int, ...]], list[tuple[tuple[int, ...], ...]]]:
        """The listed prompt's ids (as the letter scorer's) and one letter token id per option."""
        prompts = [tuple(p) for p in encode_prompts(tokenizer, records, self.prompt_settings(), reserve=0)]
        options = [tuple((t,) for t in letter_token_ids(tokenizer, len(r.options))) for r in records]
        return prompts, options

    def option_text_lengths(self, record: MultipleChoice, normalize: str) -> list[int]:
        """Ones: a letter score is one token, which no normalisation changes (as in scoring)."""
        return [1] * len(record.options)

    def pack(self, prompts: Sequence[Sequence[int]], options: Sequence[Sequence[Sequence[int]]], pad_id: int) -> PackedQuestions:
        """The prompt alone; the letters are read at its last position
        (:func:`~llm_calib.engine.packing.pack_letters`)."""
        return pack_letters(list(prompts), [[o[0] for o in opts] for opts in options], pad_id)

    def length(self, prompt: Sequence[int], options: Sequence[Sequence[int]]) -> int:
        """The prompt (letters are not part of the input)."""
        return len(prompt)

    def score(self, model: Any, tokenizer: Any, records: Sequence[MultipleChoice], *, batch_size: int = 8,
              progress: bool = False) -> ScoredSet:
        """:func:`~llm_calib.scoring.letter.score_letter` under :meth:`prompt_settings`."""
        return score_letter(model, tokenizer, records, prompt=self.prompt_settings(), batch_size=batch_size,
                            progress=progress)
