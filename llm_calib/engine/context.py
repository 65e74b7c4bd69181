"""The model's context length, checked for every sequence scored or trained on: a sequence longer
than the positions a model was trained with is not an error to most models (rotary embeddings
extrapolate), it is silently wrong. Each encoder fits its sequences with :func:`fit_prompt` or
:func:`fit_options` inside a :func:`context_window`: too long is refused (naming the record, its
length and the limit), or, as the user chooses, its prompt is cut from the left (as lm-eval cuts
its contexts) and counted; the window warns once with the count when it closes."""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

__all__ = ["CONTEXT_OVERFLOW_MODES", "ContextOverflow", "ContextWindow", "context_window", "fit_options",
           "fit_prompt", "model_context_length"]

ContextOverflow = Literal["refuse", "truncate"]
"""What to do with a sequence longer than the model's context: refuse it (an error naming it), or
truncate its prompt from the left (counted, with a warning)."""

CONTEXT_OVERFLOW_MODES: tuple[str, ...] = get_args(ContextOverflow)
"""The values of :data:`ContextOverflow`."""

_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
"""Config keys that hold a model's context length, in the order transformers' models use them."""


def model_context_length(model: Any) -> int | None:
    """The number of positions ``model`` was built for (``config.max_position_embeddings`` and its
    other names), or None when its config names none.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model_context_length(tiny_random_model()[0]), model_context_length(object())
        (512, None)
    """
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config  # multimodal wrappers keep the LM's here
    for key in _LENGTH_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@dataclass
class ContextWindow:
    """The limit sequences are fitted to, what to do beyond it, and the records truncated so far.

    Attributes:
        limit: the model's context length (None: no limit known, nothing is checked).
        on_overflow: ``"refuse"`` or ``"truncate"`` (:data:`ContextOverflow`).
        truncated: per record (its description), ``(tokens it needed, tokens kept)``.

    Example:
        >>> window = ContextWindow(512, "truncate", {"question 'q1' (geo)": (700, 512)})
        >>> window.summary()["truncated"], window.note()[:60]
        (1, "1 question(s) longer than the model's context of 512 tokens ")
    """

    limit: int | None
    on_overflow: str = "refuse"
    truncated: dict[str, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.on_overflow not in CONTEXT_OVERFLOW_MODES:
            raise ValueError(f"context overflow must be one of {CONTEXT_OVERFLOW_MODES}, got {self.on_overflow!r}")

    def summary(self) -> dict[str, Any]:
        """JSON-ready: the limit, the mode, how many records were truncated and the first few of them."""
        return {"limit": self.limit, "on_overflow": self.on_overflow, "truncated": len(self.truncated),
                "truncated_examples": list(self.truncated)[:5]}

    def note(self) -> str | None:
        """The one-line warning about the truncated records (None when there are none)."""
        if not self.truncated:
            return None
        most = max(need - kept for need, kept in self.truncated.values())
        shown = ", ".join(list(self.truncated)[:3]) + (", ..." if len(self.truncated) > 3 else "")
        return (f"{len(self.truncated)} question(s) longer than the model's context of {self.limit} tokens were cut "
                f"from the left to fit (up to {most} tokens each; {shown}); their scores saw only the end of the prompt")


_WINDOW: contextvars.ContextVar[ContextWindow | None] = contextvars.ContextVar("llm_calib_context_window", default=None)


@contextlib.contextmanager
def context_window(model: Any, on_overflow: str | None = None) -> Iterator[ContextWindow]:
    """Fit every sequence encoded in the block to ``model``'s context (:func:`model_context_length`):
    ``on_overflow`` ``"refuse"`` (the default) or ``"truncate"``. Inside a window of the same limit
    and mode (a comparison around its evaluations) the outer one is used and counts; a new window
    warns when it closes if it truncated anything (:meth:`ContextWindow.note`).

    Raises:
        ValueError: an unknown ``on_overflow``.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> with context_window(tiny_random_model()[0], "truncate") as window:
        ...     kept = fit_prompt(list(range(600)), 12, "record 'q0'")
        >>> len(kept), window.summary()["truncated"]
        (500, 1)
    """
    limit = model_context_length(model)
    current = _WINDOW.get()
    if current is not None and current.limit == limit and on_overflow in (None, current.on_overflow):
        yield current
        return
    window = ContextWindow(limit, on_overflow or "refuse")
    token = _WINDOW.set(window)
    try:
        yield window
    finally:
        _WINDOW.reset(token)
    note = window.note()
    if note is not None:
        warnings.warn(note, UserWarning, stacklevel=3)


def _refusal(where: str, need: int, prompt: int, answer: str, limit: int) -> ValueError:
    return ValueError(f"{where}: {need} tokens (prompt {prompt} + {answer}), more than the model's context of {limit} "
                      "tokens; shorten it, or cut prompts from the left with --context-overflow truncate "
                      "(context_overflow='truncate')")


def fit_prompt(prompt: Sequence[int], reserve: int, where: str) -> list[int]:
    """``prompt`` fitted to the active :func:`context_window` with ``reserve`` tokens after it (the
    longest answer generated, or trained on): as it is when it fits (or no window is active), else
    refused or cut from the left.

    Raises:
        ValueError: too long under ``"refuse"``, or ``reserve`` alone fills the context (nothing
            of the prompt would be left); the message names ``where`` and both lengths.

    Example:
        >>> fit_prompt([1, 2, 3], 4, "record 'q0'")  # no window: as it is
        [1, 2, 3]
    """
    window = _WINDOW.get()
    limit = None if window is None else window.limit
    need = len(prompt) + reserve
    if limit is None or need <= limit:
        return list(prompt)
    if reserve >= limit or window.on_overflow == "refuse":  # type: ignore[union-attr]
        raise _refusal(where, need, len(prompt), f"{reserve} of answer", limit)
    kept = list(prompt[len(prompt) - (limit - reserve):])
    window.truncated[where] = (need, len(kept) + reserve)  # type: ignore[union-attr]
    return kept


def fit_options(prompt: Sequence[int], options: Sequence[Sequence[int]], where: str,
                ) -> tuple[list[int], list[list[int]]]:
    """A multiple-choice question fitted to the active :func:`context_window`: each option is scored
    after the prompt, so the prompt and the longest option must fit. Too long is refused, or the
    prompt is cut from the left; an option that alone leaves no room for the prompt's last token
    is cut from the left too (as lm-eval cuts its continuations), so each option still follows the prompt.

    Raises:
        ValueError: too long under ``"refuse"``, naming ``where`` and the lengths.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> with context_window(tiny_random_model()[0], "truncate"):
        ...     prompt, options = fit_options(list(range(10)), [[1] * 600, [2] * 3], "record 'q1'")
        >>> len(prompt), [len(o) for o in options]
        (1, [511, 3])
    """
    window = _WINDOW.get()
    limit = None if window is None else window.limit
    longest = max((len(o) for o in options), default=0)
    need = len(prompt) + longest
    if limit is None or need <= limit:
        return list(prompt), [list(o) for o in options]
    if window.on_overflow == "refuse":  # type: ignore[union-attr]
        raise _refusal(where, need, len(prompt), f"longest option {longest}", limit)
    room = min(longest, limit - 1)  # the prompt keeps at least its last token: the first option token's context
    kept = list(prompt[len(prompt) - (limit - room):])
    window.truncated[where] = (need, len(kept) + room)  # type: ignore[union-attr]
    return kept, [list(o[max(len(o) - room, 0):]) for o in options]
