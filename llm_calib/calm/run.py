"""A calibration run resolved once: :func:`resolve_run` turns (configuration, records) into a :class:`ResolvedRun`.

Everything the configuration leaves to be worked out is worked out here, once: the prompt settings
(:func:`~llm_calib.prompts.resolution.resolve_prompt_settings`, the module that owns prompt
resolution), the task formats of the sets (:func:`run_formats`), θ's optimiser
(:func:`theta_optimizer`) and the budget (``training.epochs`` -> ``training.steps``).
:func:`~llm_calib.calm.trainer.calibrate`, :func:`~llm_calib.evaluation.compare.run_comparison` and
``llm-calib calibrate`` resolve the run and pass the :class:`ResolvedRun` on: below them no function
takes a :class:`~llm_calib.config.calibration.CalibrationConfig`. Nothing here writes into the
configuration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import hypergrad as hg
from llm_calib.calm.lora import OUTPUT_LOG_SCALE
from llm_calib.config.calibration import CalibrationConfig, LoraSettings
from llm_calib.formats import TaskFormat, format_for, records_family
from llm_calib.objectives.base import Objective
from llm_calib.prompts.resolution import ResolvedPromptSettings, resolve_prompt_settings

__all__ = ["ResolvedRun", "RunFormats", "check_resolved", "resolve_run", "run_formats", "set_records", "task_format",
           "theta_optimizer"]


def theta_optimizer(lora: LoraSettings, lr: float) -> hg.inner.Adam:
    """The Adam optimiser of θ at rate ``lr`` (LoRA weights; the output log-scale at ``lora.output_scale_lr``).

    Adam moves every coordinate by about ``lr`` per step, so the log-scale gets its own rate to travel
    a useful distance (log 2 for T = 2) in a few dozen steps.

    Example:
        >>> theta_optimizer(LoraSettings(), 1e-3).lr
        0.001
    """
    leaf_lr = {OUTPUT_LOG_SCALE: lora.output_scale_lr} if lora.output_scale else {}
    return hg.inner.Adam(lr=lr, leaf_lr=leaf_lr)


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


def task_format(records: Iterable[Any], settings: ResolvedPromptSettings, *, what: str = "records") -> TaskFormat:
    """The task format of a run's records under its resolved prompt ``settings``: where a run reads
    the kind of its records.

    Raises:
        ValueError: no records, records of both kinds or of another type (naming the record).

    Example:
        >>> from llm_calib.config.calibration import PromptSettings
        >>> from llm_calib.data import builtin_multiple_choice
        >>> settings = resolve_prompt_settings(PromptSettings(normalize="mean"))
        >>> fmt = task_format(builtin_multiple_choice(1, domains=["capitals"]), settings)
        >>> type(fmt).__name__, fmt.normalize
        ('OptionLikelihood', 'mean')
    """
    return format_for(records, **settings.format_options(), what=what)


class RunFormats(NamedTuple):
    """The task formats of a run's sets (see :func:`run_formats`).

    Attributes:
        lower: the format of the training records (the lower level's loss).
        upper: the format of the held-out and unlabelled records (model selection, the accuracy
            guard, the upper level and the temperature fit); ``lower`` itself when the kinds agree.
    """

    lower: TaskFormat
    upper: TaskFormat


def run_formats(train: Any, heldout: Any, settings: ResolvedPromptSettings, unlabeled: Any = None, *,
                names: tuple[str, str, str] = ("train", "heldout", "unlabeled")) -> RunFormats:
    """The formats of a run's training and held-out records, with the unlabelled ones checked.

    Each set is all of one kind. The held-out set may be of another kind than the training set
    where the training format serves it (:attr:`~llm_calib.formats.base.TaskFormat.upper_families`):
    open-ended (prompt, response) records train a lower level for a multiple-choice upper level
    (the paper's instruction-data lower level); multiple-choice training needs multiple-choice
    held-out records. The unlabelled records are of the held-out kind (the upper level scores
    what selection scores).

    Args:
        train, heldout: records, or their :class:`~llm_calib.calm.encoding.EncodedRecords`.
        settings: the run's resolved prompt settings (those of the formats).
        unlabeled: upper-level inputs (records or encodings), or None.
        names: how error messages name the three sets (e.g. ``"--train SPEC"``).

    Raises:
        ValueError: a set mixing kinds or holding something else, or held-out / unlabelled
            records of a kind the run cannot use, naming the set and the record.

    Example:
        >>> from llm_calib.data import OpenQA, builtin_multiple_choice
        >>> mc = builtin_multiple_choice(2, domains=["capitals"])
        >>> formats = run_formats([OpenQA("Say hi.", ("Hi!",), "chat", "c0")], mc, ResolvedPromptSettings.default(), mc)
        >>> formats.lower.layout, formats.upper.layout
        ('open', 'options')
    """
    def set_format(data: Any, what: str) -> TaskFormat:
        return data.format if isinstance(data, _Encoded) else task_format(data, settings, what=what)

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
        settings: the prompt settings resolved (:class:`~llm_calib.prompts.resolution.ResolvedPromptSettings`:
            ``scorer``, ``normalize``, ``prompt`` with its few-shot pool loaded, ``open_prompt``, ``answer_stop``).
        theta_optimizer: θ's optimiser (:func:`theta_optimizer`).
    """

    config: CalibrationConfig
    formats: RunFormats
    settings: ResolvedPromptSettings
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
        return dataclasses.replace(self, formats=RunFormats(scored(lower), scored(upper)))

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


def check_resolved(run: Any, where: str) -> ResolvedRun:
    """``run`` when it is a :class:`ResolvedRun`; else a TypeError naming ``where`` and how to make one.

    Example:
        >>> check_resolved(CalibrationConfig(), "build_trainer")
        Traceback (most recent call last):
        ...
        TypeError: build_trainer takes the run resolved from its configuration (llm_calib.calm.run.resolve_run(config, train, heldout)), got a CalibrationConfig
    """
    if not isinstance(run, ResolvedRun):
        raise TypeError(f"{where} takes the run resolved from its configuration "
                        f"(llm_calib.calm.run.resolve_run(config, train, heldout)), got a {type(run).__name__}")
    return run


def resolve_run(config: CalibrationConfig | None, train: Any, heldout: Any, unlabeled: Any = None, *,
                names: tuple[str, str, str] = ("train", "heldout", "unlabeled"),
                fewshot_pool: Sequence[Any] = (), confidence: Any = None) -> ResolvedRun:
    """Resolve a run once: its prompt and scorer settings, the formats of its sets, θ's optimiser, its budget.

    Args:
        config: the configuration (None: :class:`~llm_calib.config.calibration.CalibrationConfig()`); not changed.
        train, heldout, unlabeled: the run's sets (records or their encodings; ``unlabeled`` may be None),
            checked as :func:`run_formats` checks them.
        names: how error messages name the three sets.
        fewshot_pool: the few-shot examples of ``config.prompt.fewshot`` (empty: ``fewshot_split`` loaded
            whole; see :func:`~llm_calib.prompts.resolution.resolve_prompt_settings`).
        confidence: open questions: how held-out answers are scored for model selection
            (:class:`~llm_calib.confidence.kinds.OpenConfidence`; None: token confidence);
            see :meth:`ResolvedRun.with_confidence`.

    Raises:
        ValueError: a set of records the run cannot use (see :func:`run_formats`), or prompt settings
            that cannot be resolved.

    Example:
        >>> from llm_calib.data import builtin_multiple_choice
        >>> qs = builtin_multiple_choice(4, domains=["capitals"])
        >>> run = resolve_run(CalibrationConfig.from_dict({"preset": "paper"}), qs[:3], qs[3:])
        >>> run.config.training.steps, run.formats.lower.layout, run.settings.scorer   # 5 epochs of 3 questions
        (5, 'letter', 'letter')
    """
    config = config or CalibrationConfig()
    optimizer = theta_optimizer(config.lora, config.training.lr)
    settings = resolve_prompt_settings(config.prompt, fewshot_pool)
    formats = run_formats(train, heldout, settings, unlabeled, names=names)
    run = ResolvedRun(config.resolved(len(set_records(train))), formats, settings, optimizer)
    return run if confidence is None else run.with_confidence(confidence)
