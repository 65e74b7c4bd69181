"""A calibration run resolved once: :func:`resolve_run` turns (configuration, records) into a :class:`ResolvedRun`.

Everything the configuration leaves to be worked out is worked out here, once: the prompt
(:func:`resolve_prompt`, the one prompt resolver, which ``llm-calib evaluate`` uses too), the scorer
settings (:func:`format_settings`), the task formats of the sets (:func:`run_formats`), θ's
optimiser (:func:`theta_optimizer`) and the budget (``training.epochs`` -> ``training.steps``).
:func:`~llm_calib.calm.trainer.calibrate`, :func:`~llm_calib.evaluation.compare.run_comparison` and
``llm-calib calibrate`` pass the resolved run on; nothing here writes into the configuration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import hypergrad as hg
from llm_calib.calm.lora import OUTPUT_LOG_SCALE
from llm_calib.config.calibration import CalibrationConfig, open_prompt_format
from llm_calib.formats import MULTIPLE_CHOICE_FORMATS, TaskFormat, format_for, records_family
from llm_calib.objectives.base import Objective
from llm_calib.prompts.templates import PromptFormat, preset

__all__ = ["ResolvedRun", "RunFormats", "format_settings", "resolve_prompt", "resolve_run", "run_formats",
           "set_records", "task_format", "theta_optimizer"]


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
    fmt = MULTIPLE_CHOICE_FORMATS.get(scorer)
    if fmt is None:
        raise ValueError(f"scorer must be one of {tuple(MULTIPLE_CHOICE_FORMATS)}, got {scorer!r}")
    prompt = fmt.configured_prompt(fmt.default_prompt.style if style is None else style, chat_template)
    return dataclasses.replace(prompt, **given) if given else prompt


def format_settings(config: CalibrationConfig) -> dict[str, Any]:
    """The scorer settings of a configuration, as :func:`~llm_calib.formats.format_for` and
    :func:`~llm_calib.evaluation.evaluate.evaluate_records` take them: the one reader of its ``prompt`` part.

    The multiple-choice prompt follows ``style`` (listed for the letter scorer), or, with ``preset`` or
    any prompt setting ``evaluate`` has a flag for (``template``, ``target_delimiter``, ``choices``,
    ``system_message``, ``answer_prefix``, ``fewshot``...), the prompt ``evaluate`` builds from the same
    flags (:func:`resolve_prompt`). Few-shot examples come from ``config.prompt.fewshot_pool``, or,
    when it is empty, from ``fewshot_split`` loaded here (the configuration is not changed), so
    training, selection and evaluation show a question the same examples. Open questions use
    :func:`~llm_calib.config.calibration.open_prompt_format`.

    Example:
        >>> s = format_settings(CalibrationConfig(prompt=dict(scorer="letter")))
        >>> s["scorer"], s["prompt"].style, s["answer_stop"]
        ('letter', 'listed', False)
    """
    settings = config.prompt
    prompt = resolve_prompt(settings.scorer, settings.prompt_overrides(), preset_name=settings.preset,
                            style=settings.style, chat_template=settings.chat_template)
    if prompt.fewshot:
        pool = settings.fewshot_pool
        if not pool:
            from llm_calib.prompts.fewshot import resolve_fewshot

            pool = resolve_fewshot(prompt).fewshot_pool  # type: ignore[union-attr]
        prompt = dataclasses.replace(prompt, fewshot_pool=pool)
    return {
        "scorer": settings.scorer,
        "normalize": settings.normalize,
        "prompt": prompt,
        "open_prompt": open_prompt_format(config),
        "answer_stop": bool(settings.open_examples),
    }


def theta_optimizer(config: CalibrationConfig, lr: float | None = None) -> hg.inner.Adam:
    """The Adam optimiser of θ (LoRA weights; the output log-scale at ``config.lora.output_scale_lr``).

    Adam moves every coordinate by about ``lr`` per step, so the log-scale gets its own rate to travel
    a useful distance (log 2 for T = 2) in a few dozen steps. ``lr`` defaults to ``config.training.lr``.

    Example:
        >>> from llm_calib.config.calibration import TrainingSettings
        >>> theta_optimizer(CalibrationConfig(training=TrainingSettings(lr=1e-3))).lr
        0.001
    """
    leaf_lr = {OUTPUT_LOG_SCALE: config.lora.output_scale_lr} if config.lora.output_scale else {}
    return hg.inner.Adam(lr=config.training.lr if lr is None else lr, leaf_lr=leaf_lr)


@runtime_checkable
class _Encoded(Protocol):
    """Encoded records (:class:`~llm_calib.calm.encoding.EncodedRecords`): they carry their format."""

    records: Sequence[Any]
    format: TaskFormat
    trunk_cache: dict[int, Any]


def set_records(data: Any) -> Sequence[Any]:
    """The records of a set given as records or as their encoding.

    Example:
        >>> set_records([1, 2])
        [1, 2]
    """
    return data.records if isinstance(data, _Encoded) else data


def task_format(records: Iterable[Any], config: CalibrationConfig | None = None, *, what: str = "records",
                settings: Mapping[str, Any] | None = None) -> TaskFormat:
    """The task format of a run's records under its configuration (or its resolved ``settings``,
    :func:`format_settings`): where a run reads the kind of its records.

    Raises:
        ValueError: no records, records of both kinds or of another type (naming the record).

    Example:
        >>> from llm_calib.data import builtin_multiple_choice
        >>> fmt = task_format(builtin_multiple_choice(1, domains=["capitals"]), CalibrationConfig(prompt=dict(normalize="mean")))
        >>> type(fmt).__name__, fmt.normalize
        ('OptionLikelihood', 'mean')
    """
    if settings is None:
        settings = format_settings(config or CalibrationConfig())
    return format_for(records, **settings, what=what)


class RunFormats(NamedTuple):
    """The task formats of a run's sets (see :func:`run_formats`).

    Attributes:
        lower: the format of the training records (the lower level's loss).
        upper: the format of the held-out and unlabelled records (model selection, the accuracy
            guard, the upper level and the temperature fit); ``lower`` itself when the kinds agree.
    """

    lower: TaskFormat
    upper: TaskFormat


def run_formats(train: Any, heldout: Any, config: CalibrationConfig | None = None, unlabeled: Any = None, *,
                names: tuple[str, str, str] = ("train", "heldout", "unlabeled"),
                settings: Mapping[str, Any] | None = None) -> RunFormats:
    """The formats of a run's training and held-out records, with the unlabelled ones checked.

    Each set is all of one kind. The held-out set may be of another kind than the training set
    where the training format serves it (:attr:`~llm_calib.formats.base.TaskFormat.upper_families`):
    open-ended (prompt, response) records train a lower level for a multiple-choice upper level
    (the paper's instruction-data lower level); multiple-choice training needs multiple-choice
    held-out records. The unlabelled records are of the held-out kind (the upper level scores
    what selection scores).

    Args:
        train, heldout: records, or their :class:`~llm_calib.calm.encoding.EncodedRecords`.
        config: the run's configuration (the prompt settings of the formats).
        unlabeled: upper-level inputs (records or encodings), or None.
        names: how error messages name the three sets (e.g. ``"--train SPEC"``).
        settings: the configuration's :func:`format_settings`, when already resolved.

    Raises:
        ValueError: a set mixing kinds or holding something else, or held-out / unlabelled
            records of a kind the run cannot use, naming the set and the record.

    Example:
        >>> from llm_calib.data import OpenQA, builtin_multiple_choice
        >>> mc = builtin_multiple_choice(2, domains=["capitals"])
        >>> formats = run_formats([OpenQA("Say hi.", ("Hi!",), "chat", "c0")], mc, CalibrationConfig(), mc)
        >>> formats.lower.layout, formats.upper.layout
        ('open', 'options')
    """
    if settings is None:
        settings = format_settings(config or CalibrationConfig())

    def set_format(data: Any, what: str) -> TaskFormat:
        return data.format if isinstance(data, _Encoded) else task_format(data, what=what, settings=settings)

    lower = set_format(train, names[0])
    held = set_records(heldout)
    family = heldout.format.family if isinstance(heldout, _Encoded) else records_family(held, what=names[1])
    if family == lower.family or family not in lower.upper_families:
        lower.check(held, what=names[1])  # the same kind, or the error naming the record of another kind
        upper = lower if not isinstance(heldout, _Encoded) else heldout.format
    else:
        upper = set_format(heldout, names[1])
    if unlabeled is not None:
        upper.check(set_records(unlabeled), what=names[2])
    return RunFormats(lower, upper)


@dataclass(frozen=True)
class ResolvedRun:
    """A calibration run as :func:`resolve_run` worked it out, passed on instead of the configuration.

    Attributes:
        config: the configuration, with ``training.epochs`` resolved to ``training.steps`` (what
            results and checkpoints record).
        formats: the task formats of the training and the held-out sets (:class:`RunFormats`).
        settings: the scorer settings (:func:`format_settings`): ``scorer``, ``normalize``,
            ``prompt`` (few-shot pool loaded), ``open_prompt`` and ``answer_stop``.
        theta_optimizer: θ's optimiser (:func:`theta_optimizer`).
    """

    config: CalibrationConfig
    formats: RunFormats
    settings: dict[str, Any]
    theta_optimizer: hg.inner.Adam

    def with_confidence(self, confidence: Any) -> ResolvedRun:
        """The same run scoring open answers with ``confidence``
        (:class:`~llm_calib.confidence.kinds.OpenConfidence`; None: token): the held-out answers of model
        selection (``selection.open_metric: generated``) are scored as the report scores them.

        Example:
            >>> from llm_calib.confidence.kinds import OpenConfidence
            >>> from llm_calib.data import builtin_open_questions
            >>> qs = builtin_open_questions(2, ["capitals"])
            >>> run = resolve_run(CalibrationConfig(), qs[:1], qs[1:]).with_confidence(OpenConfidence("semantic"))
            >>> run.formats.upper.confidence.kind
            'semantic'
        """
        def scored(fmt: TaskFormat) -> TaskFormat:
            return dataclasses.replace(fmt, confidence=confidence) if fmt.family == "open" else fmt

        lower, upper = self.formats
        formats = RunFormats(scored(lower), upper if upper is lower and lower.family != "open" else scored(upper))
        return dataclasses.replace(self, formats=formats, settings={**self.settings, "confidence": confidence})

    @property
    def objective(self) -> Objective:
        """The run's objective (``config.objective``)."""
        return self.config.objective

    def with_objective(self, objective: Objective) -> ResolvedRun:
        """The same run training ``objective`` (as :func:`~llm_calib.evaluation.compare.run_comparison` trains each method).

        Example:
            >>> from llm_calib.data import builtin_multiple_choice
            >>> from llm_calib.objectives.lora_ce import LoraCE
            >>> qs = builtin_multiple_choice(2, domains=["capitals"])
            >>> resolve_run(CalibrationConfig(), qs[:1], qs[1:]).with_objective(LoraCE()).objective.name
            'lora_ce'
        """
        return dataclasses.replace(self, config=dataclasses.replace(self.config, objective=objective))


def resolve_run(config: CalibrationConfig | None, train: Any, heldout: Any, unlabeled: Any = None, *,
                names: tuple[str, str, str] = ("train", "heldout", "unlabeled"), confidence: Any = None) -> ResolvedRun:
    """Resolve a run once: its prompt and scorer settings, the formats of its sets, θ's optimiser, its budget.

    Args:
        config: the configuration (None: :class:`~llm_calib.config.calibration.CalibrationConfig()`); not changed.
        train, heldout, unlabeled: the run's sets (records or their encodings; ``unlabeled`` may be None),
            checked as :func:`run_formats` checks them.
        names: how error messages name the three sets.
        confidence: open questions: how held-out answers are scored for model selection
            (:class:`~llm_calib.confidence.kinds.OpenConfidence`; None: token confidence);
            see :meth:`ResolvedRun.with_confidence`.

    Raises:
        ValueError: a set of records the run cannot use (see :func:`run_formats`).

    Example:
        >>> from llm_calib.data import builtin_multiple_choice
        >>> qs = builtin_multiple_choice(4, domains=["capitals"])
        >>> run = resolve_run(CalibrationConfig.from_dict({"preset": "paper"}), qs[:3], qs[3:])
        >>> run.config.training.steps, run.formats.lower.layout, run.settings["scorer"]   # 5 epochs of 3 questions
        (5, 'letter', 'letter')
    """
    config = config or CalibrationConfig()
    optimizer = theta_optimizer(config)
    settings = format_settings(config)
    formats = run_formats(train, heldout, unlabeled=unlabeled, names=names, settings=settings)
    run = ResolvedRun(config.resolved(len(set_records(train))), formats, settings, optimizer)
    return run if confidence is None else run.with_confidence(confidence)
