"""The few-shot pool of a prompt format, loaded from the split it names.

A :class:`~llm_calib.prompts.templates.PromptFormat` with ``fewshot > 0`` names the split its solved
examples come from (``fewshot_split``, a data spec); :func:`resolve_fewshot` loads it with
:func:`llm_calib.data.load` and hands it to :func:`~llm_calib.prompts.templates.with_fewshot`, which removes
the evaluated questions. (Loading lives here, not in :mod:`llm_calib.prompts.templates`, so that prompt
formatting does not depend on the data loaders.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llm_calib.data import load as load_data
from llm_calib.prompts.templates import PromptFormat, with_fewshot

__all__ = ["resolve_fewshot"]


def resolve_fewshot(
    fmt: PromptFormat | None, exclude: Sequence[Any] = (), *, on_error: str = "raise"
) -> PromptFormat | None:
    """Load ``fmt.fewshot_split`` as the few-shot pool, without the ``exclude`` records.

    A format without few-shot examples, or one that already has a pool, is returned as it is
    (a given pool is still filtered by ``exclude``).

    Args:
        fmt: the prompt format, or None.
        exclude: the evaluated records (never used as examples).
        on_error: ``"raise"`` or ``"skip"`` bad rows of the few-shot split.

    Returns:
        The format with ``fewshot_pool`` filled.

    Raises:
        ValueError: ``fewshot > 0`` without ``fewshot_split`` or pool, or too few examples.

    Example:
        >>> fmt = resolve_fewshot(PromptFormat(fewshot=2, fewshot_split="builtin:capitals:n=10"))
        >>> len(fmt.fewshot_pool)
        10
    """
    if fmt is None or fmt.fewshot == 0:
        return fmt
    if fmt.fewshot_pool:
        return with_fewshot(fmt, fmt.fewshot_pool, exclude)
    if not fmt.fewshot_split:
        raise ValueError(
            f"PromptFormat.fewshot={fmt.fewshot} needs fewshot_split (a data spec of the split "
            "the examples come from, e.g. arc_easy:../shared/data:train)"
        )
    pool = load_data(fmt.fewshot_split, on_error=on_error).records  # type: ignore[arg-type]
    return with_fewshot(fmt, pool, exclude)
