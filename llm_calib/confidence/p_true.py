"""P(True): the probability the model gives to its own proposed answer being true.

Kadavath et al. ("Language Models (Mostly) Know What They Know", 2022) ask the model, after it
answered, whether the proposed answer is true, and read the probability of the "true" choice:

.. code-block:: text

    Question: Who wrote Hamlet?
    Proposed Answer: Shakespeare
    Is the proposed answer:
     (A) True
     (B) False
    The proposed answer is: (A)

P(True) is the softmax over the two continuations' log-likelihoods (``" (A)"`` vs ``" (B)"`` by
default), so it is in ``[0, 1]`` whatever mass the model puts elsewhere. Template and continuations
are overridable (:data:`P_TRUE_PROMPT`, :data:`P_TRUE_CHOICES`); a chat model may do better with its
chat template around the prompt, which the caller renders.

Example:
    >>> round(p_true_from_loglik(-0.5, -2.0), 4)
    0.8176
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from llm_calib.engine.context import fit_options
from llm_calib.scoring.base import encode_continuation, encode_prompt
from llm_calib.scoring.option_likelihood import EncodedQuestion, option_log_likelihoods

__all__ = ["P_TRUE_CHOICES", "P_TRUE_PROMPT", "p_true", "p_true_from_loglik", "p_true_prompt"]

P_TRUE_PROMPT = (
    "Question: {question}\nProposed Answer: {answer}\n"
    "Is the proposed answer:\n (A) True\n (B) False\nThe proposed answer is:"
)
"""Kadavath et al.'s prompt: ``{question}`` and ``{answer}`` are filled in."""

P_TRUE_CHOICES: tuple[str, str] = (" (A)", " (B)")
"""The continuations meaning "true" and "false" after :data:`P_TRUE_PROMPT`."""


def p_true_prompt(question: str, answer: str, template: str = P_TRUE_PROMPT) -> str:
    """The P(True) prompt for one proposed answer.

    Args:
        question: the question text.
        answer: the model's proposed answer.
        template: a ``str.format`` template with ``{question}`` and ``{answer}``.

    Returns:
        The prompt after which the two choices are scored.

    Raises:
        ValueError: the template lacks a field.

    Example:
        >>> print(p_true_prompt("Who wrote Hamlet?", "Shakespeare"))
        Question: Who wrote Hamlet?
        Proposed Answer: Shakespeare
        Is the proposed answer:
         (A) True
         (B) False
        The proposed answer is:
    """
    for name in ("{question}", "{answer}"):
        if name not in template:
            raise ValueError(f"the P(True) template must contain {name}, got {template!r}")
    return template.format(question=question, answer=answer)


def p_true_from_loglik(true_loglik: float, false_loglik: float) -> float:
    """The probability of "true" among the two choices: ``1 / (1 + exp(ll_false - ll_true))``.

    Args:
        true_loglik: summed log-likelihood of the "true" continuation.
        false_loglik: summed log-likelihood of the "false" continuation.

    Returns:
        P(True) in ``[0, 1]``.

    Example:
        >>> p_true_from_loglik(-1.0, -1.0), round(p_true_from_loglik(-30.0, -0.1), 6)
        (0.5, 0.0)
    """
    d = float(false_loglik) - float(true_loglik)
    if d > 0:  # stable for large |d|
        e = math.exp(-d)
        return e / (1.0 + e)
    return 1.0 / (1.0 + math.exp(d))


def p_true(model: Any, tokenizer: Any, questions: Sequence[str], answers: Sequence[str], *,
           template: str = P_TRUE_PROMPT, choices: tuple[str, str] = P_TRUE_CHOICES,
           batch_size: int = 16) -> np.ndarray:
    """P(True) of each proposed answer, by one forward pass per batch of questions.

    Args:
        model: a causal LM.
        tokenizer: its tokenizer.
        questions: the question texts.
        answers: the proposed answers (e.g. the greedy or modal answers), one per question.
        template: the prompt template (:data:`P_TRUE_PROMPT`).
        choices: the "true" and "false" continuations (:data:`P_TRUE_CHOICES`).
        batch_size: questions per forward pass (``>= 1``).

    Returns:
        P(True) per question, float64.

    Raises:
        ValueError: different numbers of questions and answers, two identical choices or
            ``batch_size < 1``.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> p = p_true(model, tok, ["Capital of France?"], ["Paris"])
        >>> p.shape, bool(0.0 < p[0] < 1.0)
        ((1,), True)
    """
    if len(questions) != len(answers):
        raise ValueError(f"p_true: {len(questions)} questions but {len(answers)} answers")
    if len(choices) != 2 or choices[0] == choices[1]:
        raise ValueError(f"choices must be two different continuations (true, false), got {choices!r}")
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    options = tuple(tuple(encode_continuation(tokenizer, c)) for c in choices)
    items = []
    for k, (q, a) in enumerate(zip(questions, answers, strict=True)):
        prompt, fitted = fit_options(encode_prompt(tokenizer, p_true_prompt(q, a, template), chat=False), options,
                                     f"the P(True) question of answer {k}")  # the model's context (engine.context)
        items.append(EncodedQuestion(tuple(prompt), tuple(tuple(o) for o in fitted)))
    out = np.empty(len(items))
    for start in range(0, len(items), int(batch_size)):
        chunk = option_log_likelihoods(model, items[start:start + int(batch_size)], pad_id=_pad_id(tokenizer))
        for i, (true_lp, false_lp) in enumerate(chunk, start):
            out[i] = p_true_from_loglik(float(true_lp.sum()), float(false_lp.sum()))
    return out


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else (tokenizer.eos_token_id or 0))
