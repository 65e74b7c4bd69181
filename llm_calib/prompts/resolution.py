"""Prompt resolution, in one place: which prompts a run or an evaluation puts to the model.

* :func:`resolve_prompt`: the multiple-choice prompt of a scorer, a preset, a saved result or a
  style, with the prompt fields given explicitly (``llm-calib evaluate``'s flags, a run's
  ``prompt`` settings);
* :func:`resolve_fewshot`: the few-shot pool a prompt names, loaded from its split without the
  evaluated questions (loading lives here, not in :mod:`llm_calib.prompts.templates`, so that
  prompt formatting does not depend on the data loaders);
* :func:`open_prompt_format`: the prompt of open questions under a run's prompt settings;
* :func:`resolve_prompt_settings`: a run's :class:`~llm_calib.config.calibration.PromptSettings`
  resolved once into a :class:`ResolvedPromptSettings` (scorer, normalisation, both prompts, the
  few-shot pool loaded), what the run's formats, encodings and evaluations are built from.
  :func:`~llm_calib.calm.run.resolve_run` is its one caller in the library.

Scorer names are looked up in :data:`~llm_calib.registry.TASK_FORMATS` when a prompt is resolved
(a scorer's default prompt is a property of its format).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llm_calib.config.calibration import PromptSettings
from llm_calib.prompts.templates import PromptFormat, preset, short_answer_format, with_fewshot
from llm_calib.registry import TASK_FORMATS, UnknownNameError

__all__ = ["ResolvedPromptSettings", "open_prompt_format", "prompt_overrides", "resolve_fewshot", "resolve_prompt",
           "resolve_prompt_settings"]


def resolve_prompt(scorer: str, overrides: Mapping[str, Any] | None = None, *, preset_name: str | None = None,
                   saved: Mapping[str, Any] | None = None, style: str | None = None,
                   chat_template: bool | None = None) -> PromptFormat:
    """The multiple-choice prompt of a run or an evaluation: the one place a prompt is resolved.

    The preset ``preset_name`` (with ``chat_template`` when given), else the prompt a saved result
    records (``saved``: :class:`~llm_calib.prompts.templates.PromptFormat` fields), else the scorer's prompt
    of ``style`` (the scorer's default style when None); then the ``overrides`` (prompt fields
    given explicitly: a template, few-shot settings, ...). The few-shot pool is not loaded here.

    Raises:
        ValueError: an unknown scorer or preset, or an invalid prompt field (from
            :class:`~llm_calib.prompts.templates.PromptFormat`).

    Example:
        >>> resolve_prompt("letter").style, resolve_prompt("option_likelihood", {"fewshot": 1}, style="listed").fewshot
        ('listed', 1)
        >>> resolve_prompt("option_likelihood", preset_name="lm_eval_arc").template
        'Question: {question}\\nAnswer:'
    """
    given = dict(overrides or {})
    if preset_name is not None:
        chat = {} if chat_template is None else {"chat_template": chat_template}
        return preset(preset_name, **given, **chat)
    if saved:
        return PromptFormat(**{**saved, **given})
    scorers = TASK_FORMATS.view("multiple_choice")
    if scorer not in scorers:
        raise UnknownNameError(f"scorer must be one of {tuple(scorers)}, got {scorer!r}")
    fmt = scorers[scorer]
    prompt = fmt.configured_prompt(fmt.default_prompt.style if style is None else style, chat_template)
    return dataclasses.replace(prompt, **given) if given else prompt


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
    from llm_calib.data import load as load_data

    pool = load_data(fmt.fewshot_split, on_error=on_error).records  # type: ignore[arg-type]
    return with_fewshot(fmt, pool, exclude)


def prompt_overrides(settings: PromptSettings) -> dict[str, Any]:
    """The :attr:`~llm_calib.config.calibration.PromptSettings.format_fields` that ``settings`` set, by name
    (``fewshot`` when > 0): what replaces the preset's or the style's
    :class:`~llm_calib.prompts.templates.PromptFormat` fields.

    Example:
        >>> prompt_overrides(PromptSettings(fewshot=2, fewshot_split="builtin:capitals:n=10"))
        {'fewshot': 2, 'fewshot_split': 'builtin:capitals:n=10'}
    """
    return {k: getattr(settings, k) for k in settings.format_fields
            if getattr(settings, k) is not None and not (k == "fewshot" and settings.fewshot == 0)}


def open_prompt_format(settings: PromptSettings) -> PromptFormat:
    """The prompt of open questions under a run's prompt ``settings``: what training
    (:func:`~llm_calib.calm.encoding.encode_records`) and the trunk-cached evaluator
    (:class:`~llm_calib.calm.fast_eval.SharedTrunkEval`) use (through :func:`resolve_prompt_settings`);
    pass it as ``prompt`` to :func:`~llm_calib.confidence.token.score_open_ended` to answer the same way.

    With ``settings.open_examples``: the few-shot short-answer prompt of
    :func:`~llm_calib.prompts.templates.short_answer_format` (plain text; ``chat_template`` is not used).
    Without: the scorer's reference prompt, ``PromptFormat(chat_template=settings.chat_template)``.

    Example:
        >>> open_prompt_format(PromptSettings()).answer_prefix
        'The answer is:'
        >>> open_prompt_format(PromptSettings(open_examples=[["2 + 2?", "4"]])).description
        'Q: 2 + 2?\\nA: 4\\n\\n'
    """
    if settings.open_examples:
        return short_answer_format(settings.open_examples)
    return PromptFormat(chat_template=settings.chat_template)


@dataclass(frozen=True)
class ResolvedPromptSettings:
    """A run's prompt settings resolved once (:func:`resolve_prompt_settings`): what its task
    formats, encodings and evaluations are built from, in place of the
    :class:`~llm_calib.config.calibration.PromptSettings` they were resolved from.

    Attributes:
        scorer: the multiple-choice scorer (a registered multiple-choice format).
        normalize: how option scores are normalised (:data:`~llm_calib.config.choices.NORMALIZE_MODES`).
        prompt: the multiple-choice prompt (:func:`resolve_prompt`), its few-shot pool loaded.
        open_prompt: the prompt of open questions (:func:`open_prompt_format`).
        answer_stop: open questions: train on the stop token after the answer (with ``open_examples``).

    Example:
        >>> s = ResolvedPromptSettings.default()
        >>> s.scorer, s.normalize, s.prompt.style, s.answer_stop
        ('option_likelihood', 'sum', 'cloze', False)
    """

    scorer: str
    normalize: str
    prompt: PromptFormat
    open_prompt: PromptFormat
    answer_stop: bool

    def format_options(self) -> dict[str, Any]:
        """The settings as keyword arguments of :func:`~llm_calib.formats.format_for` (and of
        :func:`~llm_calib.evaluation.evaluate.evaluate_records`, less ``answer_stop``).

        Example:
            >>> sorted(ResolvedPromptSettings.default().format_options())
            ['answer_stop', 'normalize', 'open_prompt', 'prompt', 'scorer']
        """
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def default(cls) -> ResolvedPromptSettings:
        """The default :class:`~llm_calib.config.calibration.PromptSettings`, resolved."""
        return resolve_prompt_settings(PromptSettings())


def resolve_prompt_settings(settings: PromptSettings, fewshot_pool: Sequence[Any] = ()) -> ResolvedPromptSettings:
    """Resolve a run's prompt ``settings`` once: the scorer, the normalisation, the multiple-choice
    prompt (:func:`resolve_prompt` from ``style``, or, with ``preset`` or any prompt setting
    ``evaluate`` has a flag for (``template``, ``target_delimiter``, ``choices``, ``system_message``,
    ``answer_prefix``, ``fewshot``...), the prompt ``evaluate`` builds from the same flags), the
    open-question prompt (:func:`open_prompt_format`) and ``answer_stop``.

    Few-shot examples come from ``fewshot_pool`` (``llm-calib calibrate`` draws it once, without the
    held-out and evaluated questions), or, when it is empty, from ``fewshot_split`` loaded here whole,
    so training, selection and evaluation show a question the same examples.

    Raises:
        ValueError: an unknown scorer or preset, or a few-shot split that cannot be loaded.

    Example:
        >>> s = resolve_prompt_settings(PromptSettings(scorer="letter"))
        >>> s.scorer, s.prompt.style, s.answer_stop
        ('letter', 'listed', False)
    """
    prompt = resolve_prompt(settings.scorer, prompt_overrides(settings), preset_name=settings.preset,
                            style=settings.style, chat_template=settings.chat_template)
    if prompt.fewshot:
        pool = tuple(fewshot_pool) or resolve_fewshot(prompt).fewshot_pool  # type: ignore[union-attr]
        prompt = dataclasses.replace(prompt, fewshot_pool=pool)
    return ResolvedPromptSettings(scorer=settings.scorer, normalize=settings.normalize, prompt=prompt,
                                  open_prompt=open_prompt_format(settings), answer_stop=bool(settings.open_examples))
