"""The public training loop of a calibration run, as small functions on two dataclasses.

:class:`Trainer` holds what a run does not change (model, losses, encoded data, θ's optimiser, the
objective); :class:`TrainState` what it changes (θ, the objective's state, history, selection). A run::

    run = resolve_run(config, train, heldout)        # the configuration resolved once
    trainer = build_trainer(model, tokenizer, train, heldout, run)
    state = init_state(trainer)                     # evaluates the initial model
    while not done(trainer, state):
        record = train_step(trainer, state, read=False)   # one step of the configured method
        state.history.append(record)
        if log_due(trainer, state.step):
            read_back(state)                            # the records since the last read, checked
        if evaluation_due(trainer, state.step):
            record.update(select(trainer, state, evaluate(trainer, state.theta)))

is what :func:`llm_calib.calm.trainer.calibrate` runs, with checkpoints (:func:`save_state`,
:func:`resume_state`) around it. Batches come from seeded streams (:mod:`llm_calib.calm.batch_order`).
A step reads nothing back to the host (on a GPU the queue of operations keeps running): its record
holds tensors until :func:`read_back` reads all the unread steps at once (``training.log_every``), checks
that they are finite and names the first step that was not.

The loop knows an objective only through :mod:`llm_calib.training_interface`: it makes a
:class:`RunContext` (the :class:`~llm_calib.training_interface.StepContext` of a step) and calls the
:class:`~llm_calib.training_interface.ObjectiveState` that the objective's ``start`` returned; λ, its
optimiser and CALM's solver live there (:class:`~llm_calib.objectives.calm.CalmState`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import hypergrad as hg
from llm_calib import distributed
from llm_calib.calm import batch_order
from llm_calib.calm.encoding import EncodedRecords, encode_records
from llm_calib.calm.lora import OUTPUT_LOG_SCALE, FunctionalLM, attach_lora
from llm_calib.calm.losses import CalmLosses, DataParallelLosses
from llm_calib.calm.run import ResolvedRun, check_resolved, set_records
from llm_calib.config.calibration import CalibrationConfig, SelectionSettings, flat_paths
from llm_calib.data.records import MultipleChoice, OpenQA
from llm_calib.files.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from llm_calib.formats.base import TaskFormat
from llm_calib.metrics.calibration import ece as ece_metric
from llm_calib.objectives.base import Objective
from llm_calib.training_interface import Batch, ObjectiveState

__all__ = ["MIN_GUARD_QUESTIONS", "RESUMABLE_CHANGES", "RunContext", "TrainState", "Trainer", "TrainingDiverged",
           "UnreadStep", "budget_refusal", "build_trainer", "check_not_empty", "check_selection_budget",
           "data_fingerprint", "done", "evaluate", "evaluation_due", "heldout_confidence", "init_state",
           "is_selectable", "keep_differentiated_units_gathered", "log_due", "parameter_summary",
           "parameter_tensors", "read_back", "replay_selection", "resume_state", "save_state", "select",
           "selection_budget", "selection_metric", "selection_note", "selection_update", "train_step",
           "warn_small_heldout"]

Records = Sequence[MultipleChoice] | Sequence[OpenQA] | EncodedRecords
"""Records of one kind, or their encoding (:class:`~llm_calib.calm.encoding.EncodedRecords`)."""



class TrainingDiverged(FloatingPointError):  # noqa: N818 (public name)
    """A loss or update became NaN/inf; the last good checkpoint is left untouched."""


@dataclass
class Trainer:
    """What a calibration run keeps fixed: model, losses, data, θ's optimiser, the objective.

    Attributes:
        config: the run's configuration (resolved: ``training.steps`` set).
        model: the peft model (its adapter weights are the deployed θ).
        lm: the functional view of ``model`` that the losses evaluate.
        losses: g, f, the baselines and the held-out monitor (:class:`~llm_calib.calm.losses.CalmLosses`,
            with the objective's logit adjustment, or none).
        train: encoded training questions (lower level).
        heldout: encoded held-out questions (model selection and the accuracy guard).
        unlabeled: encoded upper-level inputs; ``heldout`` itself unless others were given.
        pad_id: the tokenizer's padding id.
        theta_optimizer: θ's optimiser (:func:`~llm_calib.calm.run.theta_optimizer`).
        objective: the run's objective (default ``config.objective``); :func:`init_state` starts it.
        tokenizer: the model's tokenizer: open held-out questions are answered with it at each
            evaluation (``selection.open_metric: generated``); None where nothing is generated.
        heldout_format: the format that scores the held-out answers for selection (the run's upper
            format, with its open-answer confidence); None: ``heldout.format``.
    """

    config: CalibrationConfig
    model: Any
    lm: FunctionalLM
    losses: CalmLosses
    train: EncodedRecords
    heldout: EncodedRecords
    unlabeled: EncodedRecords
    pad_id: int
    theta_optimizer: Any
    objective: Objective | None = None
    tokenizer: Any = None
    heldout_format: TaskFormat | None = None

    def __post_init__(self) -> None:
        if self.objective is None:
            self.objective = self.config.objective
        if self.heldout_format is None:
            self.heldout_format = self.heldout.format

    def with_losses(self, losses: CalmLosses) -> Trainer:
        """A copy computing the losses with ``losses`` (e.g. a slow reference) on the same steps; call it
        before :func:`init_state` (the objective's state binds the losses it starts with)."""
        return dataclasses.replace(self, losses=losses)

    def fill_trunk_caches(self) -> int:
        """Cache the trunk of every question now (nothing without a trunk cache); return the count."""
        encodings = list({id(e): e for e in (self.train, self.heldout, self.unlabeled)}.values())
        for enc in encodings:
            enc.fill_trunk_cache(self.lm, self.pad_id)
        return sum(len(e.trunk_cache) for e in encodings)

    @property
    def adjustment(self) -> Any:
        """The logit adjustment λ (:class:`~llm_calib.adjustment.LogitAdjustment`); None when the objective trains none."""
        return self.losses.adjustment

    def train_batch(self, step: int) -> Batch:
        """This rank's training batch of ``step`` (0-based)."""
        return self._batch(self.train, self.config.training.batch_size, step, batch_order.TRAIN_STREAM)

    def unlabeled_batch(self, step: int) -> Batch:
        """This rank's batch of upper-level inputs of ``step`` (labels unused; open questions as their
        prompts alone: :meth:`EncodedRecords.upper_batch <llm_calib.calm.encoding.EncodedRecords.upper_batch>`)."""
        size = self.config.training.heldout_batch_size
        idx = batch_order.batch_indices(len(self.unlabeled.records), size, step, self.config.seed,
                                        batch_order.UPPER_STREAM)
        return self.unlabeled.upper_batch(batch_order.shard(idx), self.pad_id, self.lm,
                                          part_overhead=self.config.training.part_overhead)

    def _batch(self, data: EncodedRecords, size: int, step: int, stream: int) -> Batch:
        idx = batch_order.batch_indices(len(data.records), size, step, self.config.seed, stream)
        return data.batch(batch_order.shard(idx), self.pad_id, self.lm,
                          part_overhead=self.config.training.part_overhead)


@dataclass
class UnreadStep:
    """A step whose record still holds tensors where they were computed (see :func:`read_back`).

    Attributes:
        record: the step's record, the same dict as in ``TrainState.history``.
        theta_finite, lam_finite: 0-dim bool tensors: θ and λ after the step were finite.
        batch_ids: the ids of the step's training questions (for the message of a divergence).
    """

    record: dict[str, Any]
    theta_finite: Tensor
    lam_finite: Tensor
    batch_ids: list[str]


@dataclass
class TrainState:
    """What a calibration run changes, step by step (everything a checkpoint stores).

    Attributes:
        step: steps taken.
        theta: the current LoRA parameters θ (detached tensors).
        objective_state: the objective's state (:class:`~llm_calib.training_interface.ObjectiveState`:
            CALM's λ, its optimiser and the solver's state; a baseline's θ optimiser state).
        history: one record per step (see :func:`train_step`, :func:`select`).
        before: held-out metrics of the initial model.
        best: the selected step, its held-out ECE and the count of evaluations below the floor.
        best_theta, best_lam: θ and the objective's λ of the selected step (λ empty when it trains none).
        stopped_early: the accuracy guard stopped the run.
        unread: the steps since the last :func:`read_back` (not checkpointed: a checkpoint is written
            after reading them).
    """

    step: int
    theta: dict[str, Tensor]
    objective_state: ObjectiveState
    history: list[dict[str, float]]
    before: dict[str, float]
    best: dict[str, float]
    best_theta: dict[str, Tensor]
    best_lam: dict[str, Tensor]
    stopped_early: bool = False
    unread: list[UnreadStep] = dataclasses.field(default_factory=list)


class RunContext:
    """The :class:`~llm_calib.training_interface.StepContext` of a run at its current step.

    Args:
        trainer: the run (its losses, θ optimiser and upper-level batches).
        state: its state (the step count and θ, which an objective's step assigns).

    Example:
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> qs = builtin_multiple_choice(n_per_domain=4, domains=["capitals"])
        >>> from llm_calib.calm.run import resolve_run
        >>> run = resolve_run(CalibrationConfig(training={"heldout_batch_size": 2}), qs[:2], qs[2:])
        >>> trainer = build_trainer(model, tok, qs[:2], qs[2:], run)
        >>> context = RunContext(trainer, init_state(trainer, evaluate_before=False))
        >>> context.step, len(context.unlabeled_batch().ids)
        (0, 2)
    """

    def __init__(self, trainer: Trainer, state: TrainState) -> None:
        self._trainer, self._state = trainer, state
        self.losses = trainer.losses
        self.theta_optimizer = trainer.theta_optimizer

    @property
    def step(self) -> int:
        """The steps taken so far."""
        return self._state.step

    @property
    def theta(self) -> dict[str, Tensor]:
        """The current θ (assigning it updates the state)."""
        return self._state.theta

    @theta.setter
    def theta(self, value: dict[str, Tensor]) -> None:
        self._state.theta = value

    def unlabeled_batch(self) -> Batch:
        """This rank's upper-level batch of the step being taken."""
        return self._trainer.unlabeled_batch(self._state.step)


def _encode(tokenizer: Any, data: Records, fmt: TaskFormat) -> EncodedRecords:
    return data if isinstance(data, EncodedRecords) else encode_records(tokenizer, data, fmt=fmt)


_records = set_records


_SET_NAMES_AND_USES = {
    "train": ("training", "the lower-level (task) loss trains on it"),
    "heldout": ("held-out", "model selection and the accuracy guard score it"),
    "unlabeled": ("unlabelled", "the upper-level objective reads its inputs"),
    "eval": ("evaluation", "the report scores it"),
}


def check_not_empty(**sets: Records | None) -> None:
    """Raise a ValueError naming the first empty set among ``sets`` (None: not given, skipped).

    Args:
        **sets: records (or encodings) by role: ``train``, ``heldout``, ``unlabeled``, ``eval``.

    Raises:
        ValueError: ``"the held-out set (heldout) is empty: ..."``.

    Example:
        >>> check_not_empty(train=[1], heldout=[2], unlabeled=None)
        >>> check_not_empty(train=[1], heldout=[])
        Traceback (most recent call last):
        ...
        ValueError: the held-out set (heldout) is empty: model selection and the accuracy guard score it; pass at least one question
    """
    for role, data in sets.items():
        if data is not None and len(_records(data)) == 0:
            name, use = _SET_NAMES_AND_USES.get(role, (role, "the run needs it"))
            raise ValueError(f"the {name} set ({role}) is empty: {use}; pass at least one question")


def build_trainer(model: Any, tokenizer: Any, train: Records, heldout: Records, run: ResolvedRun, *,
                  unlabeled: Records | None = None) -> Trainer:
    """Attach LoRA to ``model`` (in place) and set up a run: encodings, λ's adjustment, losses.

    Seeds torch with the run's ``seed`` first. Under ``torchrun`` it also shards the frozen base
    (:func:`llm_calib.distributed.shard_frozen_base`) and uses :class:`~llm_calib.calm.losses.DataParallelLosses`.
    The arguments are those of :func:`~llm_calib.calm.trainer.calibrate_run`: ``run`` is the run resolved
    from its configuration and these sets (:func:`~llm_calib.calm.run.resolve_run`).

    Raises:
        ValueError: records of mixed kinds or another type (naming the record).

    Example:
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> qs = builtin_multiple_choice(n_per_domain=4, domains=["capitals"])
        >>> from llm_calib.calm.run import resolve_run
        >>> trainer = build_trainer(model, tok, qs[:2], qs[2:], resolve_run(None, qs[:2], qs[2:], qs), unlabeled=qs)
        >>> len(trainer.unlabeled), trainer.unlabeled is trainer.heldout
        (4, False)
    """
    check_not_empty(train=train, heldout=heldout, unlabeled=unlabeled)
    config, (fmt, upper) = check_resolved(run, "build_trainer").config, run.formats  # lower level; selection and upper level
    warn_small_heldout(len(_records(heldout)), config.selection)
    check_selection_budget(config.selection, config.training.steps, upper, len(_records(heldout)))  # before any work
    torch.manual_seed(config.seed)
    peft_model = attach_lora(model, config.lora, output_scale=config.lora.output_scale)
    if distributed.shard_frozen_base(peft_model):
        # FSDP2 allocates a unit's gathered weights at its first forward pass; inside
        # torch.inference_mode they would be inference tensors that training passes cannot save
        # for backward. So one token first, no-grad.
        with torch.no_grad():
            peft_model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=next(peft_model.parameters()).device))
    # Eval mode throughout; train_step switches on training mode only where the trained parts
    # need it (FunctionalLM.train_mode).
    peft_model.eval()
    lm = FunctionalLM(peft_model)
    objective = config.objective
    if config.training.compile:
        if objective.second_order or distributed.is_distributed():
            raise ValueError("training.compile: the compiled step takes first derivatives in one process; "
                             f"{'torchrun' if distributed.is_distributed() else 'this solver'} needs the eager "
                             "step (set training.compile false)")
        lm.compile_step()
    keep_differentiated_units_gathered(lm, objective.second_order)
    vocab = lm.head.out_features if hasattr(lm.head, "out_features") else lm.base.config.vocab_size
    train_enc = _encode(tokenizer, train, fmt)
    heldout_enc = _encode(tokenizer, heldout, upper)
    unlabeled_enc = heldout_enc if unlabeled is None else _encode(tokenizer, unlabeled, upper)
    sources = (train_enc, heldout_enc) if unlabeled is None else (train_enc, heldout_enc, unlabeled_enc)
    tokens = (t for src in sources for opts in src.options for o in opts for t in o)  # read by "answer_tokens" only
    adjustment = objective.logit_adjustment(vocab, tokens, fmt.auto_adjustment)
    loss_class = DataParallelLosses if distributed.is_distributed() else CalmLosses
    losses = loss_class(lm, adjustment, run.settings.normalize)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    trainer = Trainer(config, peft_model, lm, losses, train_enc, heldout_enc, unlabeled_enc, pad_id,
                      run.theta_optimizer, objective, tokenizer, upper)
    if distributed.is_distributed():
        # A forward pass through the sharded base is a collective: every rank must run the same
        # ones, which a lazily filled cache (each rank its own shard's chunks) would not.
        trainer.fill_trunk_caches()
    return trainer


def keep_differentiated_units_gathered(lm: FunctionalLM, second_order: bool) -> list[str]:
    """Under ``torchrun`` for an objective that takes ``second_order`` derivatives (CALM with a solver whose
    :attr:`~llm_calib.objectives.calm.CalmSolver.second_order` is set): keep the FSDP2 units of the trained
    layers, the layers above them and the head gathered for the run (:func:`llm_calib.distributed.keep_gathered`):
    they are differentiated through twice; the layers below stay sharded.

    Returns:
        The units kept gathered; empty in one process or for a first-order method.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.config.calibration import LoraSettings
        >>> lm = FunctionalLM(attach_lora(tiny_random_model()[0], LoraSettings(rank=2)))
        >>> keep_differentiated_units_gathered(lm, CalibrationConfig(objective={"name": "calm", "solver": "implicit"}).objective.second_order)
        []
    """
    if not second_order or not distributed.is_distributed():
        return []
    layers = getattr(lm.decoder, "layers", None)
    trained = [int(m.group(1)) for n in lm.theta() if (m := re.search(r"layers\.(\d+)\.", n))]
    if layers is None or not trained:  # no layered decoder, or θ outside the layers: everything
        return distributed.keep_gathered([lm.base])
    return distributed.keep_gathered([*list(layers)[min(trained):], lm.head])


MIN_GUARD_QUESTIONS = 500
"""Held-out questions below which :func:`build_trainer` warns that model selection is noisy."""


def warn_small_heldout(n: int, selection: SelectionSettings) -> bool:
    """Warn when ``n`` held-out questions make the accuracy guard noisy; return whether it warned.

    The guard's accuracies have a standard error of up to ``0.5 / sqrt(n)`` (0.041 at 150
    questions) against a margin of ``1 - guard_accuracy`` times the accuracy (0.025 at 0.5).

    Raises:
        ValueError: ``n`` is 0 (the held-out set is empty).

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     warn_small_heldout(150, SelectionSettings()), warn_small_heldout(600, SelectionSettings())
        (True, False)
    """
    if n <= 0:
        check_not_empty(heldout=[])  # raises: names the empty held-out set (no division by zero)
    if n >= MIN_GUARD_QUESTIONS or selection.guard_accuracy <= 0:
        return False
    warnings.warn(
        f"{n} held-out questions: model selection and the accuracy guard (guard_accuracy="
        f"{selection.guard_accuracy}) compare accuracies with a standard error of up to {0.5 / math.sqrt(n):.3f}; "
        f"use at least {MIN_GUARD_QUESTIONS} held-out questions (unlabelled upper-level inputs can be passed "
        "separately with unlabeled=)", UserWarning, stacklevel=3)
    return True


def evaluate(trainer: Trainer, theta: dict[str, Tensor] | None = None, batch_size: int = 16) -> dict[str, float]:
    """Held-out metrics of the deployed model (no adjustment), computed in inference mode.

    Multiple choice: the option metrics (exact). Open questions: under ``selection.open_metric:
    generated`` (the default) the held-out questions are answered as the report answers them
    (the held-out format's :meth:`~llm_calib.formats.open_ended.OpenEnded.score`: greedy answers and their
    token confidence, or N samples and their semantic confidence), and ``accuracy``, ``ece`` and
    ``confidence`` are those answers'; the teacher-forced proxy is recorded beside them
    (``teacher_forced_*``). Under ``teacher_forced`` the proxy is the metric.

    Args:
        trainer: the run.
        theta: load these LoRA parameters into the model first (default: as it is).
        batch_size: questions per forward pass (open questions: per generation batch).

    Returns:
        ``accuracy``, ``ece`` (10 bins) and ``confidence`` (mean) of what selection reads; ``nll``
        and ``entropy`` from :meth:`CalmLosses.monitor <llm_calib.calm.losses.CalmLosses.monitor>`
        (open questions: of the reference answers, teacher-forced); open questions also
        ``teacher_forced_accuracy``, ``teacher_forced_ece`` and ``teacher_forced_confidence``.
    """
    if theta is not None:
        trainer.lm.load_theta(theta)
    data = trainer.heldout
    parts = []
    with torch.inference_mode():
        for start in range(0, len(data.records), batch_size):
            batch = data.batch(range(start, min(start + batch_size, len(data.records))), trainer.pad_id, trainer.lm,
                               part_overhead=trainer.config.training.part_overhead)
            parts.append(trainer.losses.monitor(batch))
    stats = {k: torch.cat([part[k] for part in parts]) for k in parts[0]}
    conf, correct = stats["confidence"], stats["correct"]
    out = {"accuracy": float(correct.mean()), "ece": float(ece_metric(conf.numpy(), correct.numpy(), n_bins=10)),
           "nll": float(stats["nll"].mean()), "entropy": float(stats["entropy"].mean()),
           "confidence": float(conf.mean())}
    fmt = trainer.heldout_format
    if fmt.family != "open":
        return out
    proxy = {f"teacher_forced_{k}": out[k] for k in ("accuracy", "ece", "confidence")}
    if trainer.config.selection.open_metric != "generated":
        return {**out, **proxy}
    if trainer.tokenizer is None:
        raise ValueError("selection.open_metric 'generated' answers the held-out questions: the trainer needs the "
                         "tokenizer (build_trainer passes it), or set selection.open_metric to 'teacher_forced'")
    with torch.inference_mode():
        scored = fmt.score(trainer.model, trainer.tokenizer, data.records, batch_size=batch_size)
    m = scored.summary(n_bins=10, ci=False)
    return {**out, "accuracy": float(m["accuracy"]), "ece": float(m["ece"]), "confidence": float(m["mean_confidence"]),
            **proxy}


def selection_metric(selection: SelectionSettings, heldout_format: TaskFormat) -> str:
    """How a run's held-out ECE is measured, in words (reports, notes).

    Example:
        >>> from llm_calib.formats import OpenEnded, OptionLikelihood
        >>> selection_metric(SelectionSettings(), OpenEnded())
        'ECE of the greedy answers (token confidence)'
        >>> selection_metric(SelectionSettings(), OptionLikelihood())   # of the option probabilities, exact
        'ECE'
    """
    if heldout_format.family != "open":
        return "ECE"
    if selection.open_metric != "generated":
        return "teacher-forced proxy ECE (reference answers, no generation)"
    confidence = getattr(heldout_format, "confidence", None)
    kind = "token" if confidence is None else confidence.kind
    if kind == "semantic":
        return f"Sem-ECE of {confidence.samples} sampled answers (semantic confidence)"
    return f"ECE of the greedy answers ({kind} confidence)"


def selection_budget(selection: SelectionSettings, steps: int, heldout_format: TaskFormat,
                     questions: int) -> dict[str, Any]:
    """What a run's held-out evaluations will generate, before it trains.

    Args:
        selection: the run's selection settings.
        steps: its training steps.
        heldout_format: the format that scores the held-out answers (:attr:`Trainer.heldout_format`).
        questions: held-out questions.

    Returns:
        ``metric`` (:func:`selection_metric`), ``evaluations`` (at most: the initial model, every
        ``selection.eval_every`` steps and the last, and the selected parameters once more at the end),
        ``questions``, and for open questions answered by generation ``answers``: the answers generated
        over the run at most (samples under semantic confidence, with ``samples_per_question``).

    Example:
        >>> from llm_calib.confidence.kinds import OpenConfidence
        >>> from llm_calib.formats import OpenEnded
        >>> budget = selection_budget(SelectionSettings(), 20, OpenEnded(), 60)
        >>> budget["evaluations"], budget["answers"]
        (4, 240)
        >>> selection_budget(SelectionSettings(), 20, OpenEnded(confidence=OpenConfidence("semantic")), 60)["answers"]
        2400
    """
    every = selection.eval_every
    evaluations = 2 + steps // every + (1 if steps % every else 0)
    out: dict[str, Any] = {"metric": selection_metric(selection, heldout_format), "evaluations": evaluations,
                           "questions": questions}
    if heldout_format.family == "open" and selection.open_metric == "generated":
        confidence = getattr(heldout_format, "confidence", None)
        per_question = confidence.samples if confidence is not None and confidence.kind == "semantic" else 1
        out["answers"] = evaluations * questions * per_question
        if per_question > 1:
            out["samples_per_question"] = per_question
    return out


def check_selection_budget(selection: SelectionSettings, steps: int, heldout_format: TaskFormat,
                           questions: int) -> dict[str, Any]:
    """:func:`selection_budget`, refused when semantic selection would sample more than ``selection.sample_budget``.

    Raises:
        ValueError: the numbers, and what to lower.

    Example:
        >>> from llm_calib.confidence.kinds import OpenConfidence
        >>> from llm_calib.formats import OpenEnded
        >>> check_selection_budget(SelectionSettings(sample_budget=1000), 200,
        ...                        OpenEnded(confidence=OpenConfidence("semantic")), 60)
        Traceback (most recent call last):
        ...
        ValueError: semantic model selection would sample 13200 answers (22 evaluations x 60 held-out questions x 10 samples), over selection.sample_budget 1000: evaluate less often (selection.eval_every, --eval-every), use fewer held-out questions or samples (--samples), raise --sample-budget, or select on the greedy answers' ECE (--confidence token) or the teacher-forced proxy (--open-metric teacher_forced)
    """
    budget = selection_budget(selection, steps, heldout_format, questions)
    limit = selection.sample_budget
    if budget.get("samples_per_question", 1) > 1 and budget["answers"] > limit:
        raise ValueError(
            f"semantic model selection would sample {budget['answers']} answers ({budget['evaluations']} evaluations x "
            f"{budget['questions']} held-out questions x {budget['samples_per_question']} samples), over "
            f"selection.sample_budget {limit}: evaluate less often (selection.eval_every, --eval-every), use fewer "
            "held-out questions or samples (--samples), raise --sample-budget, or select on the greedy answers' "
            "ECE (--confidence token) or the teacher-forced proxy (--open-metric teacher_forced)")
    return budget


def init_state(trainer: Trainer, *, evaluate_before: bool = True) -> TrainState:
    """The state at step 0: θ from the model, λ at the identity, fresh optimisers.

    Args:
        trainer: the run.
        evaluate_before: score the initial model (the guard's reference); without it ``before``
            holds NaNs and :func:`select` never selects (for timing steps).

    Example:
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> qs = builtin_multiple_choice(n_per_domain=4, domains=["capitals"])
        >>> from llm_calib.calm.run import resolve_run
        >>> run = resolve_run(CalibrationConfig(training={"batch_size": 2, "heldout_batch_size": 2}), qs[:2], qs[2:])
        >>> trainer = build_trainer(model, tok, qs[:2], qs[2:], run)
        >>> state = init_state(trainer)
        >>> record = train_step(trainer, state)
        >>> state.step, sorted(k for k in ("g", "phi", "q", "unlabeled_entropy") if k in record)
        (1, ['g', 'phi', 'q', 'unlabeled_entropy'])
    """
    nan = dict.fromkeys(("accuracy", "ece", "nll", "entropy", "confidence"), math.nan)
    theta = trainer.lm.theta()
    state = TrainState(step=0, theta=theta, objective_state=None, history=[], before=nan,  # type: ignore[arg-type]
                       best={}, best_theta={k: v.clone() for k, v in theta.items()}, best_lam={})
    state.objective_state = trainer.objective.start(RunContext(trainer, state))
    state.best_lam = {k: v.detach().clone() for k, v in state.objective_state.lam.items()}
    if evaluate_before:
        state.before = evaluate(trainer)
    state.best = {"ece": state.before["ece"], "step": 0}
    return state


def parameter_tensors(theta: dict[str, Tensor], lam: dict[str, Tensor]) -> dict[str, Tensor]:
    """:func:`parameter_summary` as 0-dim tensors where θ and λ are (float64; nothing read back to the host).

    Example:
        >>> parameter_tensors({}, {"b": torch.tensor([1.0, -3.0])})
        {'lambda_b_mean': tensor(-1., dtype=torch.float64), 'lambda_b_absmax': tensor(3., dtype=torch.float64)}
    """
    out = {}
    if OUTPUT_LOG_SCALE in theta:
        out[OUTPUT_LOG_SCALE] = theta[OUTPUT_LOG_SCALE].detach().double().reshape(())
    for name, value in lam.items():
        v = value.detach().double()
        out[f"lambda_{name}_mean"] = v.mean()
        out[f"lambda_{name}_absmax"] = v.abs().max()
    return out


def parameter_summary(theta: dict[str, Tensor], lam: dict[str, Tensor]) -> dict[str, float]:
    """A step's trajectory diagnostics: the output log-scale, λ's mean and largest absolute entry.

    Example:
        >>> parameter_summary({}, {"b": torch.tensor([1.0, -3.0])})
        {'lambda_b_mean': -1.0, 'lambda_b_absmax': 3.0}
    """
    tensors = parameter_tensors(theta, lam)
    return dict(zip(tensors, torch.stack(list(tensors.values())).tolist(), strict=True)) if tensors else {}


def train_step(trainer: Trainer, state: TrainState, *, read: bool = True) -> dict[str, Any]:
    """Take step ``state.step + 1`` of ``trainer.objective``; update ``state`` in place.

    The step is the objective state's (:class:`~llm_calib.training_interface.ObjectiveState`), given the
    run's :class:`RunContext`. CALM: the solver's joint step of θ and λ's direction, then one projected
    Adam step of λ; one-level objectives: one Adam step of θ on their loss.

    Args:
        trainer: the run.
        state: its state.
        read: read the record back to the host (floats) and check it now (:func:`read_back`). Without it the
            step reads nothing back (on a GPU the queue keeps running): the record's values stay 0-dim
            tensors, the step waits in ``state.unread`` until the next :func:`read_back`, which turns them
            into floats in place and raises for a non-finite step.

    Returns:
        The step's record (not yet appended to ``state.history``): ``step`` (1-based), the
        objective's losses (CALM: ``g``, ``unlabeled_entropy`` and the solver's diagnostics;
        baselines: ``loss``), then :func:`parameter_summary` of the new θ and λ.

    Raises:
        TrainingDiverged: a loss or update is NaN/inf (names the step and the batch); with ``read=False``
            only what the objective's step raises itself.
    """
    inner = trainer.train_batch(state.step)
    try:
        with trainer.lm.train_mode():
            record = state.objective_state.step(RunContext(trainer, state), inner)
    except (hg.NonFiniteError, FloatingPointError) as err:
        raise TrainingDiverged(_diverged(state.step + 1, str(err), inner.ids)) from err
    state.step += 1
    lam = state.objective_state.lam
    record = {"step": state.step, **record, **parameter_tensors(state.theta, lam)}
    state.unread.append(UnreadStep(record, hg.tree.tree_all_finite(state.theta), hg.tree.tree_all_finite(lam),
                                   list(inner.ids)))
    if read:
        read_back(state)
    return record


def _diverged(step: int, what: str, ids: Sequence[str]) -> str:
    return (f"step {step}: {what}; batch ids {list(ids[:8])}{'...' if len(ids) > 8 else ''}. "
            "No checkpoint was written for this step; lower the learning rates or check the data.")


def read_back(state: TrainState) -> None:
    """Read the records of ``state.unread`` back to the host, all with one read, and check them.

    Each record's 0-dim tensors become floats in place (the dicts in ``state.history`` too); its 0-dim bool
    tensors are checks (``solver_step_finite``: the solver's own finiteness flag), dropped from the record.

    Raises:
        TrainingDiverged: at the first unread step with a NaN or inf value, a failed check, or a
            non-finite θ or λ after it (naming the step, what was non-finite and the step's batch ids);
            ``state.unread`` is left as it was.
    """
    if not state.unread:
        return
    keys, columns = [], []
    for entry in state.unread:
        names = [k for k, v in entry.record.items() if isinstance(v, Tensor)]
        keys.append(names)
        columns.append(torch.stack([*(entry.record[k].detach().double().reshape(()) for k in names),
                                    entry.theta_finite.double(), entry.lam_finite.double()]))
    values = torch.cat(columns).tolist()  # the one read
    offset = 0
    for entry, names in zip(state.unread, keys, strict=True):
        row = values[offset : offset + len(names) + 2]
        offset += len(names) + 2
        read = dict(zip(names, row, strict=False))
        checks = {k for k in names if entry.record[k].dtype == torch.bool}
        bad = [k for k in names if k not in checks and not math.isfinite(read[k])]
        failed = [k for k in names if k in checks and not read[k]]
        what = ""
        if bad:
            what = ", ".join(f"{k} is {read[k]}" for k in bad) + " (non-finite)"
        elif failed:
            what = f"the solver's step is non-finite ({', '.join(failed)} is False)"
        elif not row[-2]:
            what = _non_finite_tree(state.theta, "updated LoRA parameters")
        elif not row[-1]:
            what = _non_finite_tree(state.objective_state.lam, "updated λ")
        if what:
            step = int(entry.record["step"])
            raise TrainingDiverged(_diverged(step, what, entry.batch_ids)) from hg.NonFiniteError(what)
        for k in names:
            if k in checks:
                del entry.record[k]
            else:
                entry.record[k] = read[k]
    state.unread.clear()


def _non_finite_tree(tree: dict[str, Tensor], what: str) -> str:
    """``check_finite``'s message for ``tree`` (which entry, how many values) while it is still non-finite."""
    try:
        hg.tree.check_finite(tree, what)
    except hg.NonFiniteError as err:
        return str(err)
    return f"{what}: non-finite value(s) after the step"


def log_due(trainer: Trainer, step: int) -> bool:
    """True when the loop reads the records back after ``step``: every ``training.log_every`` steps, at
    every evaluation (:func:`evaluation_due`) and at the last step."""
    return step % trainer.config.training.log_every == 0 or evaluation_due(trainer, step)


def evaluation_due(trainer: Trainer, step: int) -> bool:
    """True when the held-out set is scored after ``step`` (every ``selection.eval_every`` and the last)."""
    config = trainer.config
    return step % config.selection.eval_every == 0 or step == config.training.steps


def done(trainer: Trainer, state: TrainState) -> bool:
    """True when the run has taken ``config.training.steps`` steps or the accuracy guard stopped it."""
    return state.stopped_early or state.step >= trainer.config.training.steps


def is_selectable(accuracy: float, reference_accuracy: float, selection: SelectionSettings) -> bool:
    """The accuracy floor of model selection: ``accuracy >= guard_accuracy * reference_accuracy``.

    Example:
        >>> guard = SelectionSettings(guard_accuracy=0.9)
        >>> is_selectable(0.45, 0.5, guard), is_selectable(0.44, 0.5, guard)
        (True, False)
    """
    return accuracy + 1e-12 >= selection.guard_accuracy * reference_accuracy


def select(trainer: Trainer, state: TrainState, metrics: dict[str, float]) -> dict[str, float]:
    """Model selection and the accuracy guard after an evaluation of ``state.theta``.

    Selectable parameters (:func:`is_selectable` against the initial accuracy) with the lowest
    held-out ECE so far become the selected ones; ``guard_patience`` consecutive evaluations below
    the floor set ``state.stopped_early``. The rule is :func:`selection_update`'s, which
    :func:`replay_selection` applies to a recorded history.

    Returns:
        The evaluation's entries for the step's record: ``heldout_<metric>``.
    """
    best, chosen, stop = selection_update(state.best, metrics["accuracy"], metrics["ece"], state.before["accuracy"],
                                          state.step, trainer.config.selection)
    state.best = best
    if chosen:
        state.best_theta = {k: v.clone() for k, v in state.theta.items()}
        state.best_lam = {k: v.detach().clone() for k, v in state.objective_state.lam.items()}
    if stop:
        state.stopped_early = True
    return {f"heldout_{k}": v for k, v in metrics.items()}


def selection_update(best: dict[str, float], accuracy: float, ece: float, reference_accuracy: float, step: int,
                     selection: SelectionSettings) -> tuple[dict[str, float], bool, bool]:
    """One evaluation's effect on model selection: THE rule of :func:`select` and :func:`replay_selection`.

    Args:
        best: the selection so far: ``ece``, ``step`` and ``violations`` (consecutive evaluations below
            the accuracy floor).
        accuracy, ece: the evaluation's held-out accuracy and ECE.
        reference_accuracy: the initial model's held-out accuracy (the guard's reference).
        step: the evaluated step.
        selection: the run's selection settings (the guard).

    Returns:
        ``(best, chosen, stop)``: the new selection, whether this evaluation became the selected one,
        and whether the accuracy guard stops the run here.

    Example:
        >>> best = {"ece": 0.2, "step": 0}
        >>> selection_update(best, 0.5, 0.1, 0.5, 10, SelectionSettings())
        ({'ece': 0.1, 'step': 10, 'violations': 0}, True, False)
        >>> selection_update(best, 0.4, 0.0, 0.5, 10, SelectionSettings())   # below the floor 0.475
        ({'ece': 0.2, 'step': 0, 'violations': 1}, False, False)
    """
    chosen = is_selectable(accuracy, reference_accuracy, selection) and ece < best["ece"]
    new = {"ece": ece, "step": step, "violations": 0} if chosen else dict(best)
    below = accuracy < selection.guard_accuracy * reference_accuracy
    new["violations"] = best.get("violations", 0) + 1 if below else 0
    return new, chosen, new["violations"] >= selection.guard_patience


def replay_selection(history: Sequence[dict[str, float]], before: dict[str, float], selection: SelectionSettings, *,
                     metric: str = "ece", accuracy: str = "accuracy") -> dict[str, Any]:
    """The step model selection picks from a recorded history, by the rule of :func:`select`.

    The evaluations are the records holding ``heldout_<metric>`` and ``heldout_<accuracy>``, in
    order; ``before`` holds the initial model's ``<metric>`` and ``<accuracy>``. Naming another
    metric answers "which step would selection on it have picked" for a run that recorded it
    (e.g. ``teacher_forced_ece``, the proxy every open run records); evaluations after the
    accuracy guard would have stopped the run are not candidates.

    Returns:
        ``step`` (0: the initial model), its ``ece``, and ``stopped_at`` (the step the guard stops at, or None).

    Example:
        >>> hist = [{"step": 10, "heldout_ece": 0.30, "heldout_accuracy": 0.5, "heldout_teacher_forced_ece": 0.05,
        ...          "heldout_teacher_forced_accuracy": 0.5},
        ...         {"step": 20, "heldout_ece": 0.08, "heldout_accuracy": 0.49, "heldout_teacher_forced_ece": 0.30,
        ...          "heldout_teacher_forced_accuracy": 0.5}]
        >>> before = {"ece": 0.14, "accuracy": 0.5, "teacher_forced_ece": 0.14, "teacher_forced_accuracy": 0.5}
        >>> replay_selection(hist, before, SelectionSettings())["step"]
        20
        >>> replay_selection(hist, before, SelectionSettings(), metric="teacher_forced_ece",
        ...                  accuracy="teacher_forced_accuracy")["step"]
        10
    """
    best: dict[str, float] = {"ece": before[metric], "step": 0}
    for record in history:
        if f"heldout_{metric}" not in record or f"heldout_{accuracy}" not in record:
            continue
        step = int(record["step"])
        best, _, stop = selection_update(best, record[f"heldout_{accuracy}"], record[f"heldout_{metric}"],
                                         before[accuracy], step, selection)
        if stop:
            return {"step": int(best["step"]), "ece": best["ece"], "stopped_at": step}
    return {"step": int(best["step"]), "ece": best["ece"], "stopped_at": None}


def selection_note(history: Sequence[dict[str, float]], before: dict[str, float], selected_step: int,
                   selection: SelectionSettings, metric: str = "ECE") -> str | None:
    """One line saying why model selection kept the initial model (step 0), and what to try.

    None when a trained step was selected or nothing was trained. ``history``: the run's records
    (evaluations carry ``heldout_accuracy``, ``heldout_ece``); ``before``: the initial metrics;
    ``metric``: how the note names the held-out ECE (:func:`selection_metric`).

    Example:
        >>> hist = [{"step": 5, "heldout_accuracy": 0.542, "heldout_ece": 0.1}]
        >>> print(selection_note(hist, {"accuracy": 0.583, "ece": 0.2}, 0, SelectionSettings()))
        guard: held-out accuracy 0.542 < 0.554 (guard_accuracy 0.95 x initial 0.583) at every evaluation; the initial model was kept (step 0). Try more steps (--steps), a lower learning rate (--lr) or a lower --guard-accuracy.
    """
    evaluations = [r for r in history if "heldout_accuracy" in r and r.get("step", 0) > 0]
    if selected_step != 0 or not evaluations:
        return None
    advice = "Try more steps (--steps), a lower learning rate (--lr) or a lower --guard-accuracy."
    floor = selection.guard_accuracy * before["accuracy"]
    ok = [r for r in evaluations if is_selectable(r["heldout_accuracy"], before["accuracy"], selection)]
    if not ok:
        best = max(r["heldout_accuracy"] for r in evaluations)
        return (f"guard: held-out accuracy {best:.3f} < {floor:.3f} (guard_accuracy {selection.guard_accuracy:g} "
                f"x initial {before['accuracy']:.3f}) at every evaluation; the initial model was kept (step 0). {advice}")
    best_row = min(ok, key=lambda r: r["heldout_ece"])
    return (f"selection: no evaluation lowered the held-out {metric} below the initial {before['ece']:.3f} (best "
            f"{best_row['heldout_ece']:.3f} at step {int(best_row['step'])}); the initial model was kept (step 0). {advice}")


# --------------------------------------------------------------------------- checkpoints

RESUMABLE_CHANGES = ("training.steps", "training.log_every", "training.compile", "checkpoint_every")
"""Fields a resumed run may change; any other difference would splice two runs into one."""


def data_fingerprint(train: Records, heldout: Records, unlabeled: Records | None = None) -> dict[str, Any]:
    """Counts and a hash of the records, to recognise the data a checkpoint saw.

    Example:
        >>> from llm_calib.data import builtin_multiple_choice
        >>> qs = builtin_multiple_choice(n_per_domain=2, domains=["capitals"])
        >>> data_fingerprint(qs[:1], qs[1:])["train"]
        1
    """
    digest = hashlib.sha256()
    parts = [_records(train), _records(heldout)] + ([] if unlabeled is None else [_records(unlabeled)])
    for part in parts:
        for r in part:
            digest.update(repr(r).encode())
        digest.update(b"|")
    out = {"train": len(parts[0]), "heldout": len(parts[1]), "sha256": digest.hexdigest()[:16]}
    if unlabeled is not None:
        out["unlabeled"] = len(parts[2])
    return out


_STATE_TREES = {"theta/": "theta", "best_theta/": "best_theta", "best_lam/": "best_lam"}
"""The loop's tensors of a checkpoint: key prefix -> the :class:`TrainState` field holding them. The
objective state's come under its own prefixes (CALM: ``lam/``, ``method/``; a baseline: ``theta_opt/``)."""


def _tree_to_flat(prefix: str, tree: dict[str, Any], out: dict[str, Tensor]) -> None:
    for k, v in tree.items():
        if isinstance(v, dict):
            _tree_to_flat(f"{prefix}{k}/", v, out)
        elif isinstance(v, Tensor):
            out[f"{prefix}{k}"] = v


def _flat_to_tree(prefix: str, flat: dict[str, Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if not key.startswith(prefix):
            continue
        parts = key[len(prefix) :].split("/")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def save_state(directory: str | Path, trainer: Trainer, state: TrainState, data: dict[str, Any] | None) -> Path:
    """Write ``state`` as checkpoint ``state.step``, with the config and ``data`` (a :func:`data_fingerprint`).

    Reads the unread steps first (:func:`read_back`): a checkpoint holds no unchecked step.

    Raises:
        TrainingDiverged: an unread step was not finite (nothing is written).
    """
    read_back(state)
    tensors: dict[str, Tensor] = {}
    objective_trees, objective_meta = state.objective_state.checkpoint()
    trees = {**{prefix: getattr(state, name) for prefix, name in _STATE_TREES.items()}, **objective_trees}
    for prefix, tree in trees.items():
        _tree_to_flat(prefix, tree or {}, tensors)  # save_checkpoint stores detached copies
    meta = {"step": state.step, "history": state.history, "best": state.best, "before": state.before,
            "stopped_early": state.stopped_early, **objective_meta,
            "rng": torch.get_rng_state(),
            "run": {"config": trainer.config.to_dict(), "data": data, "selection": heldout_confidence(trainer)}}
    return save_checkpoint(directory, state.step, tensors, meta)


def heldout_confidence(trainer: Trainer) -> dict[str, Any] | None:
    """The confidence settings open held-out answers are scored with for selection (None: multiple choice,
    the teacher-forced proxy, or token confidence by default), as checkpoints record them."""
    fmt = trainer.heldout_format
    if fmt.family != "open" or trainer.config.selection.open_metric != "generated":
        return None
    confidence = getattr(fmt, "confidence", None)
    return None if confidence is None or confidence.kind == "token" else confidence.to_dict()


def _check_resumable(path: Path, saved: dict[str, Any] | None, config: dict[str, Any], data: dict[str, Any],
                     selection: dict[str, Any] | None = None) -> None:
    """Raise unless the checkpoint's recorded run (``saved``) matches this run's ``config`` (as a dict), ``data``
    and the confidence its model selection scores open held-out answers with (``selection``)."""
    if saved is None:  # checkpoints written before configs were recorded
        return
    if saved.get("selection") != selection:
        raise ValueError(f"cannot resume from {path}: its model selection scored the held-out answers with "
                         f"{saved.get('selection') or 'token confidence'}, this run with {selection or 'token confidence'} "
                         "(--confidence and its settings must match), or start a new run")
    now, then = flat_paths(config), flat_paths(saved["config"])
    changed = sorted(k for k in set(now) | set(then) if k not in RESUMABLE_CHANGES and now.get(k) != then.get(k))
    if changed:
        diffs = "; ".join(f"{k}: checkpoint {then.get(k)!r}, now {now.get(k)!r}" for k in changed)
        raise ValueError(f"cannot resume from {path}: the configuration differs ({diffs}). Use the checkpoint's "
                         f"configuration, or start a new run (calibrate: another --out, or --restart to "
                         f"delete the earlier run's checkpoints).")
    if saved["data"] != data:
        raise ValueError(f"cannot resume from {path}: it was trained on other data (checkpoint: "
                         f"{saved['data']['train']} train / {saved['data']['heldout']} held-out records, hash "
                         f"{saved['data']['sha256']}; now {data['train']} / {data['heldout']}, hash {data['sha256']}).")


def budget_refusal(checkpoint: str | Path, trained: int, steps: int) -> str:
    """Why a run of ``steps`` steps cannot resume from ``checkpoint``, which has ``trained`` more
    (the result would be trained longer than it records), and what to do instead.

    Example:
        >>> budget_refusal("ckpt-00000004", 4, 2)  # doctest: +ELLIPSIS
        'cannot resume from ckpt-00000004: it has trained 4 steps, more than training.steps (--steps) 2; ...'
    """
    return (f"cannot resume from {checkpoint}: it has trained {trained} steps, more than training.steps (--steps) "
            f"{steps}; resume with --steps {trained} or more, or start over with --restart (which deletes the "
            "checkpoints) or another --out")


def resume_state(directory: str | Path, trainer: Trainer, state: TrainState, data: dict[str, Any]) -> Path | None:
    """Load the newest checkpoint in ``directory`` into ``state`` (and torch's RNG).

    Returns:
        The checkpoint loaded, or None when there is none.

    Raises:
        ValueError: the checkpoint comes from another configuration (but for
            :data:`RESUMABLE_CHANGES`) or other ``data``, or it has trained more steps than
            ``training.steps`` now allows (the result would be trained longer than recorded); the
            message names the fields, or both step counts.
    """
    ckpt = latest_checkpoint(directory)
    if ckpt is None:
        return None
    tensors, meta = load_checkpoint(ckpt)
    _check_resumable(ckpt, meta.get("run"), trainer.config.to_dict(), data, heldout_confidence(trainer))
    steps = trainer.config.training.steps
    if int(meta["step"]) > steps:
        raise ValueError(budget_refusal(ckpt, int(meta["step"]), steps))
    tensors = {k: v.to(trainer.lm.device) for k, v in tensors.items()}
    for prefix, name in _STATE_TREES.items():
        setattr(state, name, _flat_to_tree(prefix, tensors))
    prefixes = {key.split("/", 1)[0] + "/" for key in tensors} - set(_STATE_TREES)
    state.objective_state.restore({prefix: _flat_to_tree(prefix, tensors) for prefix in prefixes}, meta)
    state.history, state.best, state.step, state.before = meta["history"], meta["best"], meta["step"], meta["before"]
    torch.set_rng_state(meta["rng"])
    state.stopped_early = bool(meta.get("stopped_early", False))
    return ckpt
