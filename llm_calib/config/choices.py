"""The values of the settings that several layers read: how option scores are normalised and the
prompt's vocabularies and presets. The one place each is spelled; the configuration checks its fields against
them, and the engine and the prompt templates read them from here.

Example:
    >>> NORMALIZE_MODES, PROMPT_STYLES
    (('sum', 'mean', 'char', 'byte'), ('cloze', 'listed'))
"""

from __future__ import annotations

from typing import Any, Literal, get_args

__all__ = ["CHOICE_KINDS", "FEWSHOT_SAMPLERS", "NORMALIZE_MODES", "PROMPT_PRESETS", "PROMPT_STYLES", "Normalize"]

Normalize = Literal["sum", "mean", "char", "byte"]
"""How an option's token log-probabilities become its score: summed, per token, per character
(lm-eval's ``acc_norm``) or per UTF-8 byte (``acc_bytes``)."""

NORMALIZE_MODES: tuple[str, ...] = get_args(Normalize)
"""The values of :data:`Normalize`, in order."""

PROMPT_STYLES: tuple[str, ...] = ("cloze", "listed")
"""Multiple-choice prompt styles: the question only, or the options listed as ``A.``, ``B.``, ..."""

CHOICE_KINDS: tuple[str, ...] = ("text", "letters")
"""What a multiple-choice prompt scores: each option's text or its letter."""

FEWSHOT_SAMPLERS: tuple[str, ...] = ("random", "first_n")
"""How few-shot examples are drawn: seeded per question, or the first n (lm-eval's MMLU sampler)."""

_LM_EVAL_QA = "Question: {question}\nAnswer:"

PROMPT_PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "lm_eval_arc": {"template": _LM_EVAL_QA, "chat_template": False},
    "lm_eval_mmlu": {
        "template": "{question}\n{options}\nAnswer:",
        "description": "The following are multiple choice questions (with answers) about {subject}.\n\n",
        "choices": "letters",
        "chat_template": False,
        "fewshot_sampler": "first_n",
        "fewshot_match": "subject",
    },
    "lm_eval_openbookqa": {"template": "{question}", "chat_template": False},
    "lm_eval_commonsenseqa": {
        "template": "Question: {question}\n{options}\nAnswer:",
        "choices": "letters",
        "chat_template": False,
    },
    "lm_eval_qasc": {"template": _LM_EVAL_QA, "chat_template": False},
    "lm_eval_piqa": {"template": _LM_EVAL_QA, "chat_template": False},
    "qa": {"template": "Q: {question}\nA:", "fewshot_delimiter": "\n", "chat_template": False},
}
"""Named prompt formats (keyword arguments of :class:`~llm_calib.prompts.templates.PromptFormat`): ``default`` (the reference
format), lm-eval's zero-shot prompts (``lm_eval_*``, plain text; table in
:doc:`/tutorials/evaluate_llm`) and ``qa`` (short-answer ``Q: {question}\\nA:``)."""
