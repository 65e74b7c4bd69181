"""Prompt formats for multiple-choice and open-ended scoring.

A :class:`PromptFormat` turns a question (and, for the *listed* style, its options) into the text
that precedes the scored continuation. The reference format of the evaluation protocol (:doc:`/methods/calm`)
is the default: the model's chat template with its default system message, a user turn holding the
question alone, the generation prompt, then ``The answer is:``; each option is scored as the
continuation ``" " + option``.

Without a chat template the prompt is ``[system message + "\\n\\n"] + user text + "\\n" +
answer prefix``.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "LETTERS",
    "PromptFormat",
    "build_prompt",
    "continuation_text",
    "option_letters",
    "user_message",
    "uses_chat_template",
]

LETTERS: str = string.ascii_uppercase
"""Letters used to label listed options (``A`` ... ``Z``)."""

_STYLES = ("cloze", "listed")


@dataclass(frozen=True)
class PromptFormat:
    """How a question is turned into a prompt.

    Attributes:
        style: ``"cloze"`` (the prompt holds the question only) or ``"listed"`` (the options are
            listed below the question, labelled ``A.``, ``B.``, ...). The letter scorer needs
            ``"listed"``.
        chat_template: ``True`` to wrap the user text in the tokenizer's chat template, ``False``
            for plain text, ``None`` to use the chat template when the tokenizer has one.
        system_message: a system message to put in the chat (or in front of the plain prompt);
            ``None`` keeps the template's default (the SmolLM2 template inserts its own).
        answer_prefix: text appended after the generation prompt; the scored continuation
            follows it.

    Example:
        >>> fmt = PromptFormat(style="listed", chat_template=False)
        >>> print(build_prompt(None, "2 + 2 = ?", ("3", "4"), fmt))
        2 + 2 = ?
        A. 3
        B. 4
        The answer is:
    """

    style: Literal["cloze", "listed"] = "cloze"
    chat_template: bool | None = None
    system_message: str | None = None
    answer_prefix: str = "The answer is:"

    def __post_init__(self) -> None:
        if self.style not in _STYLES:
            raise ValueError(f"PromptFormat.style must be one of {_STYLES}, got {self.style!r}")
        if self.chat_template not in (True, False, None):
            raise ValueError(
                f"PromptFormat.chat_template must be True, False or None, got {self.chat_template!r}"
            )


def option_letters(n: int) -> str:
    """Return the labels of ``n`` listed options.

    Args:
        n: number of options, 1 to 26.

    Returns:
        The first ``n`` capital letters.

    Raises:
        ValueError: if ``n`` is outside 1..26.

    Example:
        >>> option_letters(4)
        'ABCD'
    """
    if not 1 <= n <= len(LETTERS):
        raise ValueError(f"n (number of options) must be in 1..{len(LETTERS)}, got {n}")
    return LETTERS[:n]


def user_message(
    question: str, options: tuple[str, ...] | list[str] | None, fmt: PromptFormat
) -> str:
    """The text of the user turn: the question, plus the lettered options if ``fmt.style`` is listed.

    Args:
        question: the question text.
        options: the answer options (ignored for the cloze style; required for listed).
        fmt: the prompt format.

    Returns:
        The user text.

    Raises:
        ValueError: ``style="listed"`` without options, or more options than letters.

    Example:
        >>> user_message("Pick one.", ("x", "y"), PromptFormat(style="listed"))
        'Pick one.\\nA. x\\nB. y'
        >>> user_message("Pick one.", ("x", "y"), PromptFormat())
        'Pick one.'
    """
    question = question.strip()
    if fmt.style == "cloze":
        return question
    if not options:
        raise ValueError("options are required for PromptFormat(style='listed')")
    lines = [question]
    lines += [
        f"{letter}. {opt}"
        for letter, opt in zip(option_letters(len(options)), options, strict=True)
    ]
    return "\n".join(lines)


def uses_chat_template(tokenizer: Any, fmt: PromptFormat) -> bool:
    """Whether ``fmt`` applied to ``tokenizer`` goes through the chat template.

    Args:
        tokenizer: a Hugging Face tokenizer, or ``None``.
        fmt: the prompt format.

    Returns:
        ``True`` if the chat template is used.

    Raises:
        ValueError: if ``fmt.chat_template`` is ``True`` but the tokenizer has no chat template.

    Example:
        >>> uses_chat_template(None, PromptFormat())
        False
    """
    has = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    if fmt.chat_template is None:
        return has
    if fmt.chat_template and not has:
        raise ValueError(
            "PromptFormat(chat_template=True) but the tokenizer has no chat template; "
            "use chat_template=None or False"
        )
    return bool(fmt.chat_template)


def build_prompt(
    tokenizer: Any,
    question: str,
    options: tuple[str, ...] | list[str] | None = None,
    fmt: PromptFormat | None = None,
) -> str:
    """Build the prompt text that precedes the scored continuation.

    With a chat template: ``apply_chat_template([system?, user], add_generation_prompt=True)``
    followed directly by ``fmt.answer_prefix``. Without: ``[system + "\\n\\n"] + user + "\\n" +
    answer_prefix``. The prompt ends without a trailing space; continuations start with one.

    Args:
        tokenizer: a Hugging Face tokenizer (only needed when a chat template is used).
        question: the question text.
        options: the options (used by the listed style).
        fmt: the prompt format; default :class:`PromptFormat()` (the reference format).

    Returns:
        The prompt string. When a chat template was applied the string already holds the
        template's special tokens, so tokenise it with ``add_special_tokens=False``.

    Example:
        >>> build_prompt(None, "Capital of France?", fmt=PromptFormat(chat_template=False))
        'Capital of France?\\nThe answer is:'
    """
    fmt = fmt or PromptFormat()
    user = user_message(question, options, fmt)
    if uses_chat_template(tokenizer, fmt):
        messages = []
        if fmt.system_message is not None:
            messages.append({"role": "system", "content": fmt.system_message})
        messages.append({"role": "user", "content": user})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text + fmt.answer_prefix
    head = f"{fmt.system_message}\n\n" if fmt.system_message else ""
    return f"{head}{user}\n{fmt.answer_prefix}"


def continuation_text(option: str) -> str:
    """The scored continuation for an option: a space then the option text.

    Args:
        option: the option text.

    Returns:
        ``" " + option.strip()``.

    Example:
        >>> continuation_text("Paris ")
        ' Paris'
    """
    return " " + option.strip()
