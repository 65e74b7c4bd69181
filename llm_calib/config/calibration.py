"""Configuration of a calibration run: :class:`CalibrationConfig`, a few nested dataclasses.

``CalibrationConfig(objective, lora, prompt, training, selection, checkpoint_every, seed)``: the
objective is a registered objective dataclass (:mod:`llm_calib.objectives`; CALM holds its bilevel
solver), the other parts are :class:`LoraSettings`, :class:`PromptSettings`,
:class:`TrainingSettings` and :class:`SelectionSettings`. Config files (YAML or JSON) hold the
same nesting, with the objective and its solver tagged by name::

    objective: {name: calm, solver: {name: bome, eta: 2.0}, adjustment: auto}
    lora: {rank: 8, top_layers: 6}
    training: {steps: 60, lr: 1.0e-3}

A key of the flat configuration before the nesting (``bome_eta``, ``steps``, ...) is an error
naming its new place (:data:`~llm_calib.config.flat_keys.FLAT_KEYS`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from llm_calib.config.checks import check_int, check_number, is_int
from llm_calib.config.choices import NORMALIZE_MODES, PROMPT_PRESETS, PROMPT_STYLES
from llm_calib.config.flat_keys import FLAT_KEYS, flat_key_location, flat_key_message
from llm_calib.objectives.registry import (
    BUILTIN_OBJECTIVES,
    BUILTIN_SOLVERS,
    objective_class,
    objective_from_dict,
    objective_names,
)
from llm_calib.registry import TASK_FORMATS

__all__ = [
    "CONFIG_PRESETS", "METHODS", "PAPER_LORA_MODULES", "PARTS", "SOLVERS",
    "CalibrationConfig", "LoraSettings", "ObjectiveSettings", "PromptSettings", "SelectionSettings", "TrainingSettings",
    "apply_preset", "flat_paths", "read_config_file",
]

METHODS = BUILTIN_OBJECTIVES
"""The built-in training objectives, CALM (bilevel) and the one-level baselines; ``objective``
also accepts any objective registered with :func:`~llm_calib.objectives.registry.register_objective`."""

SOLVERS = BUILTIN_SOLVERS
"""The built-in bilevel solvers of CALM (``objective.solver``): first-order BOME and F2SA, and
exact implicit differentiation after lower-level steps (see :mod:`llm_calib.objectives.calm`);
any solver registered with :func:`~llm_calib.objectives.registry.register_solver` is accepted too."""


class ObjectiveSettings(Protocol):
    """What the configuration reads of its ``objective``: the registered name and the settings as a
    dict (an :class:`~llm_calib.objectives.base.Objective` is one). The configuration imports no
    objective code: it finds the class of a name in :data:`~llm_calib.registry.OBJECTIVES`.
    """

    name: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        """The settings as a dict tagged with ``name``."""
        ...


def _default_objective() -> ObjectiveSettings:
    """CALM with its default settings (its module is imported by the registry on first use)."""
    return objective_class(BUILTIN_OBJECTIVES[0])()


@dataclass
class LoraSettings:
    """LoRA adapter settings (passed to :class:`peft.LoraConfig`).

    Attributes:
        rank: adapter rank ``r``.
        alpha: scaling ``lora_alpha``.
        dropout: ``lora_dropout`` (0 keeps training deterministic and resumable bit-for-bit).
        target_modules: module names to adapt (Llama-style attention and MLP projections).
        layers: indices of the decoder layers that get adapters; None: the top ``top_layers``.
        top_layers: with ``layers=None``, adapt the top this many layers (all of them when the
            model has fewer; None: every layer). Adapting only the top layers lets the frozen
            bottom be computed once per question (trunk caching), which makes a step several
            times cheaper; on SmolLM2-135M the top 6 of 30 calibrate as well as more.
        output_scale: also train the scale of the logits, as one scalar multiplying the final
            norm's weight (saved with the adapter; no inference overhead). The final RMSNorm fixes
            the scale of the hidden state the LM head projects, so without it LoRA can raise the
            entropy only by changing which answers the model prefers, which costs accuracy.
        output_scale_lr: learning rate of that log-scale (Adam).

    Example:
        >>> LoraSettings(rank=4).target_modules
        ('q_proj', 'v_proj')
        >>> LoraSettings().layer_indices(30), LoraSettings(top_layers=None).layer_indices(30)
        ([24, 25, 26, 27, 28, 29], None)
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    layers: tuple[int, ...] | None = None
    top_layers: int | None = 6
    output_scale: bool = True
    output_scale_lr: float = 3e-2

    def __post_init__(self) -> None:
        if self.top_layers is not None and (not is_int(self.top_layers) or self.top_layers < 1):
            raise ValueError(f"lora.top_layers must be an int >= 1 or null, got {self.top_layers!r}")
        self.alpha = check_number("lora.alpha", self.alpha)
        self.dropout = check_number("lora.dropout", self.dropout)
        self.output_scale_lr = check_number("lora.output_scale_lr", self.output_scale_lr, positive=True)
        if not isinstance(self.output_scale, bool):
            raise ValueError(f"lora.output_scale must be true or false, got {self.output_scale!r}")
        check_int("lora.rank", self.rank, minimum=1)
        if isinstance(self.target_modules, str) or not all(isinstance(m, str) for m in self.target_modules):
            raise ValueError(f"lora.target_modules must be a list of module names, got {self.target_modules!r}")
        if self.layers is not None and (isinstance(self.layers, str) or not all(is_int(i) for i in self.layers)):
            raise ValueError(f"lora.layers must be a list of layer indices or null, got {self.layers!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        self.target_modules = tuple(self.target_modules)
        if self.layers is not None:
            self.layers = tuple(int(i) for i in self.layers)

    def layer_indices(self, n_layers: int) -> list[int] | None:
        """The adapted layers of a model with ``n_layers`` decoder layers (None: all of them).

        Raises:
            ValueError: an index in ``layers`` outside ``0 .. n_layers - 1``.
        """
        if self.layers is not None:
            bad = [i for i in self.layers if not 0 <= i < n_layers]
            if bad:
                raise ValueError(f"lora.layers {bad} out of range for a model with {n_layers} layers (0..{n_layers - 1})")
            return list(self.layers)
        if self.top_layers is None or self.top_layers >= n_layers:
            return None
        return list(range(n_layers - self.top_layers, n_layers))



@dataclass
class PromptSettings:
    """How questions are put to the model, in training and in evaluation.

    Attributes:
        scorer: ``"option_likelihood"`` or ``"letter"`` (multiple choice; open questions are
            always trained on their reference answer's tokens).
        normalize: option scores summed (``"sum"``), averaged per token (``"mean"``), or divided by
            the option's length in characters (``"char"``, lm-eval's ``acc_norm``) or UTF-8 bytes
            (``"byte"``, ``acc_bytes``), in training, selection and evaluation alike (multiple
            choice; open-ended losses average over the answer's tokens).
        style: multiple-choice prompt style, ``"cloze"`` or ``"listed"`` (see
            :class:`llm_calib.prompts.templates.PromptFormat`); open questions always use the cloze style
            of the open-ended scorer.
        chat_template: wrap prompts in the model's chat template (None: when it has one).
        preset: multiple choice: a named prompt format of :data:`llm_calib.config.choices.PROMPT_PRESETS`
            (e.g. ``"lm_eval_arc"``, lm-eval's ARC prompt), as ``evaluate --prompt-preset``; its
            template replaces ``style``; ``template`` and ``chat_template`` override it. None
            (default): the prompt of ``style``.
        template: multiple choice: a question template with named fields (``{question}``,
            ``{options}``, ...; ``\\n`` is a newline), as ``evaluate --template``. None: none.
        target_delimiter: multiple choice: text between the prompt and each scored choice, as
            ``evaluate --target-delimiter``. None: the preset's, else ``" "``.
        choices: multiple choice: ``"text"`` or ``"letters"`` (score the option letters of a
            template that lists the options), as ``evaluate --choices``. None: the preset's, else text.
        system_message: multiple choice: the chat's system message, as ``evaluate
            --system-message``. None: the chat template's own default.
        answer_prefix: multiple choice: text after the generation prompt, before the scored answer,
            as ``evaluate --answer-prefix``. None: ``"The answer is:"``.
        fewshot: multiple choice: solved examples before each question, as ``evaluate --fewshot``,
            drawn from ``fewshot_split`` for training, selection and evaluation alike (the same
            question gets the same examples in each). 0: zero-shot.
        fewshot_split: the data spec the few-shot examples come from (needed with ``fewshot``).
        fewshot_seed: seed of the per-question draw of examples. None: 1234, as lm-eval.
        fewshot_sampler: ``"random"`` or ``"first_n"``. None: the preset's, else random.
        field_choices: the allowed values of ``scorer``, ``normalize`` and ``style``.
        open_examples: open questions: ``(question, answer)`` solved examples shown before every
            question in the plain-text short-answer prompt ``Q: ...\\nA: ...`` of
            :func:`llm_calib.prompts.templates.short_answer_format` (e.g. drawn from the training split with
            :func:`llm_calib.prompts.templates.draw_short_answer_examples`); trained answers then end with
            the newline greedy answers stop at. Empty (default): the chat prompt ``The answer is:``
            (see :func:`~llm_calib.prompts.resolution.open_prompt_format`). On the command line: a JSON list of pairs.

    The few-shot pool (the records of ``fewshot_split``, less the evaluated questions) is not a
    setting: the run loads it once when it is resolved (:func:`~llm_calib.calm.run.resolve_run`;
    ``llm-calib calibrate`` passes the pool it drew without the evaluated questions).

    Example:
        >>> PromptSettings(open_examples=[[" 2 + 2? ", "4"]]).open_examples
        (('2 + 2?', '4'),)
        >>> PromptSettings(fewshot=2, fewshot_split="builtin:capitals:n=10").fewshot_split
        'builtin:capitals:n=10'
    """

    field_choices: ClassVar[dict[str, tuple[str, ...]]] = {
        # the scorers: the formats' registry, read at each check (a format registered later is accepted);
        # its names are known without loading a format
        "scorer": TASK_FORMATS.names_view("multiple_choice"), "normalize": NORMALIZE_MODES, "style": PROMPT_STYLES,
    }
    format_fields: ClassVar[tuple[str, ...]] = (
        "template", "target_delimiter", "choices", "system_message", "answer_prefix", "fewshot", "fewshot_split",
        "fewshot_seed", "fewshot_sampler",
    )
    """The fields that override the :class:`~llm_calib.prompts.templates.PromptFormat` of ``preset`` or
    ``style`` (as ``evaluate``'s prompt flags), when set."""
    scorer: str = "option_likelihood"
    normalize: str = "sum"
    style: str = "cloze"
    chat_template: bool | None = None
    open_examples: tuple[tuple[str, str], ...] = ()
    preset: str | None = None
    template: str | None = None
    target_delimiter: str | None = None
    choices: str | None = None
    system_message: str | None = None
    answer_prefix: str | None = None
    fewshot: int = 0
    fewshot_split: str | None = None
    fewshot_seed: int | None = None
    fewshot_sampler: str | None = None

    def __post_init__(self) -> None:
        for name, allowed in self.field_choices.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"prompt.{name} must be one of {allowed}, got {value!r}")
        if self.preset is not None and self.preset not in PROMPT_PRESETS:
            raise ValueError(f"prompt.preset must be one of {tuple(PROMPT_PRESETS)} or null, got {self.preset!r}")
        for name in ("template", "target_delimiter", "system_message", "answer_prefix", "fewshot_split"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"prompt.{name} must be a string or null, got {value!r}")
            if value is not None and name in ("template", "target_delimiter", "answer_prefix"):  # a typed \n or \t: newline, tab
                setattr(self, name, value.replace("\\n", "\n").replace("\\t", "\t"))
        for name, allowed in (("choices", ("text", "letters")), ("fewshot_sampler", ("random", "first_n"))):
            if getattr(self, name) not in (None, *allowed):
                raise ValueError(f"prompt.{name} must be one of {allowed} or null, got {getattr(self, name)!r}")
        check_int("prompt.fewshot", self.fewshot, minimum=0)
        if self.fewshot_seed is not None:
            check_int("prompt.fewshot_seed", self.fewshot_seed)
        if self.fewshot and not self.fewshot_split:
            raise ValueError(f"prompt.fewshot={self.fewshot} needs prompt.fewshot_split (the data spec the examples "
                             "come from, e.g. arc_easy:../shared/data:train)")
        if self.chat_template is not None and not isinstance(self.chat_template, bool):
            raise ValueError(f"prompt.chat_template must be true, false or null, got {self.chat_template!r}")
        self.open_examples = _question_answer_pairs(self.open_examples)


@dataclass
class TrainingSettings:
    """The training budget and θ's step size.

    Attributes:
        steps: outer steps (one batch each); with ``epochs`` set, derived from it when the run
            starts (see :meth:`resolved`).
        epochs: None, or passes over the training set: ``steps`` becomes
            ``epochs * ceil(len(train) / batch_size)`` (the paper's budget is 5 epochs). An
            explicit ``steps`` given above a preset's ``epochs`` (in a file or a flag) replaces it.
        batch_size: training questions per step (inner batch; the global batch over all ranks).
        heldout_batch_size: unlabelled upper-level inputs per step (outer batch; CALM's f and the
            confidence penalty's entropy term; labels unused).
        lr: learning rate of θ (LoRA, Adam).
        log_every: steps between reads of the step records back to the host (the losses and
            diagnostics of the history, one read for all the steps since the last one) and the
            finiteness checks of those steps (also at every evaluation and checkpoint, and at the
            end). Between reads a step waits on nothing it computed (on a GPU the queue keeps
            running); a NaN or inf is still reported with the step that produced it. Changes no
            number of the run.
        compile: run the trained layers as graphs compiled by :func:`torch.compile` (fewer, fused
            kernels per step; first-order objectives, Llama-style decoders, no gradient
            checkpointing: :meth:`~llm_calib.calm.lora.FunctionalLM.compile_step`). The first steps
            compile (seconds to minutes); the numbers equal the eager step's to float round-off.
        part_overhead: what one more forward pass is worth, in padded tokens, when a batch of
            questions of different lengths is run in parts of similar length
            (:func:`~llm_calib.engine.packing.length_parts`); None (default): 64 on a CPU (measured),
            one pass per batch on a GPU (launch-bound: a pass costs more than the padding it saves).
            The numbers agree to float round-off either way.

    Example:
        >>> TrainingSettings(lr="1e-3").lr
        0.001
        >>> TrainingSettings(epochs=5, batch_size=16).resolved(40).steps   # 3 steps per epoch
        15
    """

    steps: int = 60
    batch_size: int = 8
    heldout_batch_size: int = 8
    lr: float = 1e-3
    epochs: int | None = None
    log_every: int = 10
    compile: bool = False
    part_overhead: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.compile, bool):
            raise ValueError(f"training.compile must be true or false, got {self.compile!r}")
        for name in ("steps", "batch_size", "heldout_batch_size", "log_every"):
            check_int(f"training.{name}", getattr(self, name), minimum=1)
        if self.part_overhead is not None:
            check_int("training.part_overhead", self.part_overhead, minimum=0)
        if self.epochs is not None:
            check_int("training.epochs", self.epochs, minimum=1)
        self.lr = check_number("training.lr", self.lr, positive=True)

    def resolved(self, n_train: int) -> TrainingSettings:
        """These settings for a training set of ``n_train`` questions: with ``epochs``, ``steps``
        set to ``epochs * ceil(n_train / batch_size)`` (``epochs`` kept, as a record); else unchanged.

        Raises:
            ValueError: ``n_train`` < 1 with ``epochs`` set.
        """
        if self.epochs is None:
            return self
        check_int("the training set size", n_train, minimum=1)
        return dataclasses.replace(self, steps=self.epochs * math.ceil(n_train / self.batch_size))


@dataclass
class SelectionSettings:
    """Held-out evaluation during training, the accuracy guard and the choice of the returned parameters.

    Attributes:
        eval_every: steps between held-out evaluations (early stopping, progress).
        guard_accuracy: only parameters whose held-out accuracy is at least this fraction of
            the initial model's can be selected; training stops (and rolls back to the best
            selectable parameters) after ``guard_patience`` consecutive evaluations below it.
        guard_patience: consecutive evaluations below the accuracy floor before stopping.
        open_metric: open questions: what each held-out evaluation measures. ``generated``: the
            held-out questions are answered as the report answers them (greedy answers and their
            token-confidence ECE; under semantic confidence N sampled answers and their Sem-ECE),
            and the accuracy guard reads those answers' accuracy; ``teacher_forced``: a cheaper
            proxy read off one forward pass over the reference answers, no generation.
            Multiple-choice runs ignore it (their held-out ECE is exact).
        sample_budget: open questions under semantic confidence with ``generated``: the most
            answers selection may sample over a run (evaluations x held-out questions x samples);
            a larger run stops before training with the numbers and what to lower.

    Example:
        >>> SelectionSettings(guard_accuracy=1.5)
        Traceback (most recent call last):
        ...
        ValueError: selection.guard_accuracy must be in [0, 1], got 1.5
        >>> SelectionSettings(open_metric="proxy")
        Traceback (most recent call last):
        ...
        ValueError: selection.open_metric must be one of ('generated', 'teacher_forced'), got 'proxy'
    """

    eval_every: int = 10
    guard_accuracy: float = 0.95
    guard_patience: int = 2
    open_metric: str = "generated"
    sample_budget: int = 100_000

    field_choices: ClassVar[dict[str, tuple[str, ...]]] = {"open_metric": ("generated", "teacher_forced")}

    def __post_init__(self) -> None:
        check_int("selection.eval_every", self.eval_every, minimum=1)
        check_int("selection.guard_patience", self.guard_patience, minimum=1)
        check_int("selection.sample_budget", self.sample_budget, minimum=1)
        for name, allowed in self.field_choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"selection.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        self.guard_accuracy = check_number("selection.guard_accuracy", self.guard_accuracy)
        if not 0.0 <= self.guard_accuracy <= 1.0:
            raise ValueError(f"selection.guard_accuracy must be in [0, 1], got {self.guard_accuracy}")


PARTS: dict[str, type] = {
    "lora": LoraSettings, "prompt": PromptSettings, "training": TrainingSettings, "selection": SelectionSettings,
}
"""The settings parts of :class:`CalibrationConfig` besides the objective, by field name."""

PAPER_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a Llama-style decoder block (Llama, Mistral, Qwen2, SmolLM2): the
paper's "LoRA on all linear layers" (the LM head excluded)."""

CONFIG_PRESETS: dict[str, dict[str, Any]] = {
    "paper": {
        "objective": {"name": "calm", "solver": {"name": "bome"}, "adjustment": "vector"},
        "lora": {"rank": 64, "alpha": 32.0, "target_modules": list(PAPER_LORA_MODULES), "layers": None,
                 "top_layers": None, "output_scale": False},
        "prompt": {"scorer": "letter", "style": "listed"},
        "training": {"epochs": 5, "batch_size": 16, "heldout_batch_size": 16},
    },
}
"""Named starting points of a :class:`CalibrationConfig` (``preset:`` in a config file,
``llm-calib calibrate --preset``), as the nested dicts of :meth:`CalibrationConfig.to_dict`;
whatever the file or the flags set replaces the preset's value.

``paper``: the protocol of the CALM paper (arXiv 2608.07419): CALM with BOME, the per-vocabulary
multiplicative and additive λ (``adjustment: vector``), LoRA r = 64, α = 32 on every linear layer
of every decoder layer (no trained output scale: the paper trains LoRA only), batches of 16, 5
epochs over the training set, the options listed in the prompt and scored by their letters. The
paper quantises the base (QLoRA): add ``--load-in-4bit`` on a GPU. Everything else (learning
rates, BOME's settings, held-out selection and the accuracy guard) is llm-calib's default: the
paper's values for them are not recorded here. See :doc:`/methods/calm`."""


def apply_preset(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a config mapping) laid over the preset its ``preset`` key names (:data:`CONFIG_PRESETS`).

    Mappings merge key by key, except an objective or solver tagged with another ``name`` than the
    preset's, which replaces it whole. A ``training.steps`` in ``data`` without ``training.epochs``
    replaces the preset's epochs (an explicit budget wins). Without ``preset`` ``data`` is returned.

    Raises:
        ValueError: an unknown preset name.

    Example:
        >>> cfg = apply_preset({"preset": "paper", "lora": {"rank": 16}, "training": {"steps": 3}})
        >>> cfg["lora"]["rank"], cfg["lora"]["alpha"], cfg["training"]["steps"], cfg["training"]["epochs"]
        (16, 32.0, 3, None)
    """
    name = data.get("preset")
    if name is None:
        return data
    if name not in CONFIG_PRESETS:
        raise ValueError(f"preset must be one of {tuple(CONFIG_PRESETS)} or null, got {name!r}")
    out = _merge(CONFIG_PRESETS[name], data)
    training = data.get("training")
    if isinstance(training, dict) and "steps" in training and "epochs" not in training:
        out["training"]["epochs"] = None
    return out


def _merge(base: Any, over: Any) -> Any:
    """``over`` laid on ``base`` (copies): mappings key by key; a mapping tagged with another
    ``name``, or any other value, replaces the base's."""
    if isinstance(over, str) and isinstance(base, dict) and "name" in base:
        over = {"name": over}  # an objective or solver given by name alone
    if not (isinstance(base, dict) and isinstance(over, dict)):
        return copy.deepcopy(over)
    if "name" in over and "name" in base and over["name"] != base["name"]:
        return copy.deepcopy(over)
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(base[key], value) if key in base else copy.deepcopy(value)
    return out


@dataclass
class CalibrationConfig:
    """Everything that defines a calibration run, in a few parts.

    Attributes:
        objective: the training objective and its settings: :class:`~llm_calib.objectives.calm.Calm`
            (bilevel; default, with its solver :class:`~llm_calib.objectives.calm.Bome`,
            :class:`~llm_calib.objectives.calm.F2SA` or
            :class:`~llm_calib.objectives.calm.ImplicitSolver`), or a one-level baseline:
            :class:`~llm_calib.objectives.lora_ce.LoraCE` (plain fine-tuning),
            :class:`~llm_calib.objectives.label_smoothing.LabelSmoothing`,
            :class:`~llm_calib.objectives.confidence_penalty.ConfidencePenalty` (CE − β·entropy);
            or an objective registered with
            :func:`~llm_calib.objectives.registry.register_objective`. In a file: a mapping tagged
            with its ``name``.
        lora: adapter settings (:class:`LoraSettings`, with the trained output scale).
        prompt: prompt and scorer (:class:`PromptSettings`).
        training: budget and θ's learning rate (:class:`TrainingSettings`).
        selection: held-out evaluation and accuracy guard (:class:`SelectionSettings`).
        checkpoint_every: steps between checkpoints (0 disables).
        seed: seed for data order and initialisation.
        preset: the :data:`CONFIG_PRESETS` entry the run started from (a record; the other
            fields hold the resolved values). :meth:`from_dict` lays the given keys over it.

    Example:
        >>> from llm_calib.objectives.calm import F2SA, Calm
        >>> cfg = CalibrationConfig(objective=Calm(solver=F2SA(sigma=0.2)), training=TrainingSettings(steps=10))
        >>> CalibrationConfig.from_dict(cfg.to_dict()) == cfg
        True
        >>> cfg.to_dict()["objective"]["solver"]
        {'name': 'f2sa', 'sigma': 0.2, 'inner_steps': 5, 'inner_lr': None}
        >>> CalibrationConfig.from_dict({"bome_eta": 1.0})
        Traceback (most recent call last):
        ...
        ValueError: `bome_eta` is now `objective.solver.eta` (objective.name: calm, solver.name: bome)
    """

    objective: ObjectiveSettings = field(default_factory=_default_objective)
    lora: LoraSettings = field(default_factory=LoraSettings)
    prompt: PromptSettings = field(default_factory=PromptSettings)
    training: TrainingSettings = field(default_factory=TrainingSettings)
    selection: SelectionSettings = field(default_factory=SelectionSettings)
    checkpoint_every: int = 0
    seed: int = 0
    preset: str | None = None

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in CONFIG_PRESETS:
            raise ValueError(f"preset must be one of {tuple(CONFIG_PRESETS)} or null, got {self.preset!r}")
        if isinstance(self.objective, (str, dict)):
            self.objective = objective_from_dict(self.objective)
        name = getattr(type(self.objective), "name", None)
        if not isinstance(name, str) or not callable(getattr(self.objective, "to_dict", None)):
            raise ValueError(f"objective must be a registered objective ({', '.join(objective_names())}), "
                             f"got {self.objective!r}")
        if not isinstance(self.objective, objective_class(name)):  # registered under its name
            raise ValueError(f"objective must be a registered objective ({', '.join(objective_names())}), "
                             f"got {self.objective!r}")
        for name, cls in PARTS.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, _part_from_dict(name, cls, value))
            elif not isinstance(value, cls):
                raise ValueError(f"{name} must be a mapping of {cls.__name__} fields, got {value!r}")
        check_int("checkpoint_every", self.checkpoint_every, minimum=0)
        check_int("seed", self.seed, minimum=0)  # numpy's generators take no negative seed

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (also valid YAML for :meth:`from_file`); the objective and its
        solver tagged with their ``name``."""
        out: dict[str, Any] = {"objective": self.objective.to_dict()}
        for name in PARTS:
            out[name] = {k: _plain(v) for k, v in dataclasses.asdict(getattr(self, name)).items()}
        out["checkpoint_every"], out["seed"], out["preset"] = self.checkpoint_every, self.seed, self.preset
        return out

    def resolved(self, n_train: int) -> CalibrationConfig:
        """This configuration for a training set of ``n_train`` questions: ``training.steps``
        derived from ``training.epochs`` when set (:meth:`TrainingSettings.resolved`).

        Example:
            >>> CalibrationConfig.from_dict({"preset": "paper"}).resolved(32).training.steps
            10
        """
        training = self.training.resolved(n_train)
        return self if training is self.training else dataclasses.replace(self, training=training)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CalibrationConfig:
        """Build from a dict, rejecting unknown keys by name and old flat keys by their new path;
        with a ``preset`` key, the dict's values are laid over the preset's (:func:`apply_preset`).

        Raises:
            ValueError: an old flat key (see :data:`~llm_calib.config.flat_keys.FLAT_KEYS`), an unknown key, or an invalid value.
        """
        if not isinstance(data, dict):
            raise ValueError(f"the calibration config must be a mapping, got {data!r}")
        data = apply_preset(data)
        flat = [k for k in data if k in FLAT_KEYS]
        if flat:
            raise ValueError("; ".join(flat_key_message(k) for k in flat))
        return _part_from_dict("calibration config", cls, data)

    @classmethod
    def from_file(cls, path: str | Path) -> CalibrationConfig:
        """Load from a ``.yaml``/``.yml`` or ``.json`` file (see :func:`read_config_file`); errors
        name the file (and, for an old flat key of a YAML file, its line)."""
        data = read_config_file(path)
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{flat_key_location(path, data)}: {err}") from err


def flat_paths(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config dict (:meth:`CalibrationConfig.to_dict`) as ``{dotted path: value}``, to name
    the fields two configurations differ in.

    Example:
        >>> flat_paths({"objective": {"name": "calm", "solver": {"name": "bome"}}, "seed": 0})
        {'objective.name': 'calm', 'objective.solver.name': 'bome', 'seed': 0}
    """
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_paths(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _plain(value: Any) -> Any:
    """Tuples (also nested) as lists, for JSON."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _part_from_dict(name: str, cls: type, data: dict[str, Any]) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {name} key(s) {unknown}; valid keys: {sorted(known)}")
    return cls(**data)


def _question_answer_pairs(value: Any) -> tuple[tuple[str, str], ...]:
    """``open_examples`` as a tuple of stripped ``(question, answer)`` pairs (lists accepted)."""
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"prompt.open_examples must be a list of [question, answer] pairs, got {value!r}")
    pairs = []
    for i, pair in enumerate(value):
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                or not all(isinstance(t, str) and t.strip() for t in pair)):
            raise ValueError(f"prompt.open_examples[{i}] must be a [question, answer] pair of two non-empty strings, "
                             f"got {pair!r}")
        pairs.append((pair[0].strip(), pair[1].strip()))
    return tuple(pairs)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping stored in a ``.yaml``/``.yml`` or ``.json`` config file, not yet validated.

    The keys a file sets matter to callers that layer settings (defaults < file < flags), so
    this returns them as written; :meth:`CalibrationConfig.from_dict` validates them. The one
    change: a relative path in ``prompt.fewshot_split`` is read from the file's directory (made
    absolute), so the file names the same data whatever the working directory.

    Raises:
        ValueError: the file is not valid YAML/JSON, sets a key twice in one mapping, or does not hold a mapping, or its
            ``prompt.fewshot_split`` is malformed or names a path that does not exist (names the
            file and the field).
        OSError: the file cannot be read.

    Example:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "run.yaml"
        >>> _ = path.write_text("training: {steps: 5}\\nlora: {rank: 2}\\n")
        >>> read_config_file(path)
        {'training': {'steps': 5}, 'lora': {'rank': 2}}
    """
    path = Path(path)
    from llm_calib.config.unique_keys import load_json_unique, load_yaml_unique

    text = path.read_text()
    # a key given twice is an error naming its line: YAML and JSON would silently keep the last
    if path.suffix in (".yaml", ".yml"):
        data = load_yaml_unique(text, path) or {}
    else:
        data = load_json_unique(text, path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config must be a mapping of keys to values")
    return _fewshot_split_from_file(data, path)


def _fewshot_split_from_file(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """``data`` with its ``prompt.fewshot_split`` path made absolute against the directory of the
    config file ``path`` it was read from."""
    from llm_calib.data.spec import SpecError, absolute_spec, parse_spec

    prompt = data.get("prompt")
    spec = prompt.get("fewshot_split") if isinstance(prompt, dict) else None
    if not isinstance(spec, str):
        return data  # none, or not a string: from_dict names the error
    try:
        resolved = absolute_spec(spec, path.parent)
        target = parse_spec(resolved).path
    except SpecError as err:
        raise ValueError(f"{path}: prompt.fewshot_split: {err}") from err
    if target is not None and not target.exists():
        raise ValueError(f"{path}: prompt.fewshot_split {spec!r}: {target} does not exist (a relative path "
                         "is read from the config file's directory)")
    return {**data, "prompt": {**prompt, "fewshot_split": resolved}}

