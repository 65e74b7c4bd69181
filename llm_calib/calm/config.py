"""Configuration of a calibration run (a dataclass; YAML/JSON round-trips)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llm_calib.adjustment import ADJUSTMENT_KINDS
from llm_calib.objectives.registry import (
    BUILTIN_OBJECTIVES,
    BUILTIN_SOLVERS,
    objective_names,
    solver_names,
)
from llm_calib.prompts import PromptFormat, short_answer_format

__all__ = [
    "CHOICES", "METHODS", "SOLVERS", "CalibrationConfig", "LoraSettings", "field_help", "open_prompt_format",
    "read_config_file",
]

METHODS = BUILTIN_OBJECTIVES
"""The built-in training objectives, CALM (bilevel) and the one-level baselines; ``method`` also
accepts any objective registered with :func:`~llm_calib.objectives.registry.register_objective`."""

SOLVERS = BUILTIN_SOLVERS
"""The built-in bilevel solvers of ``method="calm"``: first-order BOME and F2SA, and exact implicit
differentiation after lower-level steps (see :mod:`llm_calib.objectives.calm`); ``solver`` also
accepts any solver registered with :func:`~llm_calib.objectives.registry.register_solver`."""


CHOICES: dict[str, tuple[str, ...]] = {
    "method": METHODS,
    "solver": SOLVERS,
    "adjustment": ("auto", *ADJUSTMENT_KINDS),
    "scorer": ("option_likelihood", "letter"),
    "normalize": ("sum", "mean"),
    "prompt_style": ("cloze", "listed"),
    "bome_barrier": ("value", "gradient"),
}
"""The allowed values of each string field of :class:`CalibrationConfig` (``method`` and ``solver``:
the built-in ones; registered objectives and solvers are accepted too)."""

_REGISTERED = {"method": objective_names, "solver": solver_names}

_FLOAT_FIELDS = (
    "lr", "lam_lr", "bome_eta", "f2sa_sigma", "label_smoothing", "penalty_beta",
    "max_log_scale", "max_bias", "guard_accuracy", "output_scale_lr", "cg_damping", "cg_tol",
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(name: str, value: Any) -> float:
    """``value`` as a float; numeric strings are accepted because YAML 1.1 reads ``1e-3`` as one."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"{name} must be a number, got {value!r}")


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

    def __post_init__(self) -> None:
        if self.top_layers is not None and (not _is_int(self.top_layers) or self.top_layers < 1):
            raise ValueError(f"lora.top_layers must be an int >= 1 or null, got {self.top_layers!r}")
        self.alpha = _number("lora.alpha", self.alpha)
        self.dropout = _number("lora.dropout", self.dropout)
        if not _is_int(self.rank) or self.rank < 1:
            raise ValueError(f"lora.rank must be an int >= 1, got {self.rank!r}")
        if isinstance(self.target_modules, str) or not all(isinstance(m, str) for m in self.target_modules):
            raise ValueError(f"lora.target_modules must be a list of module names, got {self.target_modules!r}")
        if self.layers is not None and (isinstance(self.layers, str) or not all(_is_int(i) for i in self.layers)):
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
class CalibrationConfig:
    """Everything that defines a calibration run.

    Attributes:
        method: the objective: ``"calm"`` (bilevel), or a baseline: ``"lora_ce"`` (plain
            fine-tuning), ``"label_smoothing"``, ``"confidence_penalty"`` (CE − β·entropy); or
            the name of an objective registered with
            :func:`~llm_calib.objectives.registry.register_objective`.
        solver: ``"bome"`` (default), ``"f2sa"`` or ``"implicit"`` (exact hypergradients after
            lower-level steps, :class:`hypergrad.AlternatingImplicit`) for
            ``method="calm"``.
        adjustment: λ variant: ``"auto"`` (default: where the prediction is made, see
            :func:`llm_calib.calm.methods.resolve_adjustment`), token level ``"vector"``,
            ``"temperature"``, ``"answer_tokens"``, or option level ``"option_temperature"``,
            ``"option_length"`` (option-likelihood multiple choice; see :mod:`llm_calib.adjustment`).
        scorer: ``"option_likelihood"`` or ``"letter"`` (multiple choice; open questions are
            always trained on their reference answer's tokens).
        normalize: option scores summed (``"sum"``) or length-normalised (``"mean"``) (multiple
            choice; open-ended losses average over the answer's tokens).
        lora: adapter settings.
        output_scale: also train the scale of the logits, as one scalar multiplying the final
            norm's weight (saved with the adapter; no inference overhead). The final RMSNorm fixes
            the scale of the hidden state the LM head projects, so without it LoRA can raise the
            entropy only by changing which answers the model prefers, which costs accuracy.
        output_scale_lr: learning rate of that log-scale (Adam).
        steps: outer steps (one batch each).
        batch_size: training questions per step (inner batch; the global batch over all ranks).
        heldout_batch_size: unlabelled upper-level inputs per step (outer batch; CALM's f and the
            confidence penalty's entropy term; labels unused).
        lr: learning rate of θ (LoRA).
        lam_lr: learning rate of λ (Adam).
        inner_steps: BOME's T / F2SA's inner steps / the implicit solver's lower-level steps per step.
        inner_lr: step size of the solver's inner steps: BOME's T plain-SGD steps that define
            the value function, F2SA's T Adam steps of each iterate. None (default): BOME 5e-2,
            F2SA θ's rate ``lr`` (see :func:`llm_calib.objectives.calm.inner_lr`).
        bome_eta: BOME's barrier coefficient η (default 2: with the gradient barrier θ's step
            weighs the task loss about as much as the flat confidence penalty does; at 0.5 the
            entropy term dominated and held-out accuracy fell below the guard).
        bome_barrier: BOME's barrier, ``"value"`` (φ = η q) or ``"gradient"`` (default, φ = η‖∇q‖²,
            which keeps the lower-level loss decreasing at every step), see :class:`hypergrad.BOME`.
        f2sa_sigma: F2SA's penalty weight σ.
        cg_maxiter: ``solver="implicit"``: conjugate-gradient iterations per hypergradient
            (warm-started from the previous step's solution).
        cg_damping: ``solver="implicit"``: damping μ of the Hessian, (H + μI) v = ∇_θ f (LoRA's
            lower level is not convex; μ > 0 keeps the system positive definite).
        cg_tol: ``solver="implicit"``: relative residual at which CG stops early.
        label_smoothing: ε for the label-smoothing baseline.
        penalty_beta: β for the confidence-penalty baseline.
        max_log_scale, max_bias: bounds on λ.
        guard_accuracy: only parameters whose held-out accuracy is at least this fraction of
            the initial model's can be selected; training stops (and rolls back to the best
            selectable parameters) after ``guard_patience`` consecutive evaluations below it.
        guard_patience: consecutive evaluations below the accuracy floor before stopping.
        eval_every: steps between held-out evaluations (early stopping, progress).
        checkpoint_every: steps between checkpoints (0 disables).
        seed: seed for data order and initialisation.
        prompt_style, chat_template: prompt format (see :class:`llm_calib.prompts.PromptFormat`);
            open questions always use the cloze style of the open-ended scorer.
        open_examples: open questions: ``(question, answer)`` solved examples shown before every
            question in the plain-text short-answer prompt ``Q: ...\\nA: ...`` of
            :func:`llm_calib.prompts.short_answer_format` (e.g. drawn from the training split with
            :func:`llm_calib.prompts.draw_short_answer_examples`); trained answers then end with
            the newline greedy answers stop at. Empty (default): the chat prompt ``The answer is:``
            (see :func:`open_prompt_format`). On the command line: a JSON list of pairs.

    Example:
        >>> cfg = CalibrationConfig(steps=10)
        >>> CalibrationConfig.from_dict(cfg.to_dict()) == cfg
        True
    """

    method: str = "calm"
    solver: str = "bome"
    adjustment: str = "auto"
    scorer: str = "option_likelihood"
    normalize: str = "sum"
    lora: LoraSettings = field(default_factory=LoraSettings)
    output_scale: bool = True
    output_scale_lr: float = 3e-2
    steps: int = 60
    batch_size: int = 8
    heldout_batch_size: int = 8
    lr: float = 1e-3
    lam_lr: float = 5e-2
    inner_steps: int = 5
    inner_lr: float | None = None
    bome_eta: float = 2.0
    bome_barrier: str = "gradient"
    f2sa_sigma: float = 0.1
    cg_maxiter: int = 10
    cg_damping: float = 1e-2
    cg_tol: float = 1e-3
    label_smoothing: float = 0.1
    penalty_beta: float = 0.5
    max_log_scale: float = 3.0
    max_bias: float = 10.0
    guard_accuracy: float = 0.95
    guard_patience: int = 2
    eval_every: int = 10
    checkpoint_every: int = 0
    seed: int = 0
    prompt_style: str = "cloze"
    chat_template: bool | None = None
    open_examples: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):
            known = {f.name for f in dataclasses.fields(LoraSettings)}
            unknown = sorted(set(self.lora) - known)
            if unknown:
                raise ValueError(f"unknown lora key(s) {unknown}; valid keys: {sorted(known)}")
            self.lora = LoraSettings(**self.lora)
        if not isinstance(self.lora, LoraSettings):
            raise ValueError(f"lora must be a mapping of LoRA settings, got {self.lora!r}")
        for name in _FLOAT_FIELDS:
            setattr(self, name, _number(name, getattr(self, name)))
        if self.inner_lr is not None:
            self.inner_lr = _number("inner_lr", self.inner_lr)
            if not self.inner_lr > 0:
                raise ValueError(f"inner_lr must be > 0 or null, got {self.inner_lr!r}")
        for name in ("method", "solver", "adjustment", "scorer", "normalize", "prompt_style", "bome_barrier"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        if self.chat_template is not None and not isinstance(self.chat_template, bool):
            raise ValueError(f"chat_template must be true, false or null, got {self.chat_template!r}")
        for name in ("seed", "checkpoint_every"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an int, got {getattr(self, name)!r}")
        for name, allowed in CHOICES.items():
            if name in _REGISTERED:
                allowed = _REGISTERED[name]()
            if (value := getattr(self, name)) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        for name in ("steps", "batch_size", "heldout_batch_size", "inner_steps", "eval_every", "guard_patience", "cg_maxiter"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.output_scale, bool):
            raise ValueError(f"output_scale must be true or false, got {self.output_scale!r}")
        for name in ("lr", "lam_lr", "bome_eta", "f2sa_sigma", "max_log_scale", "output_scale_lr", "cg_tol"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if not 0.0 <= self.guard_accuracy <= 1.0:
            raise ValueError(f"guard_accuracy must be in [0, 1], got {self.guard_accuracy}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        for name in ("max_bias", "penalty_beta", "cg_damping"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        self.open_examples = _question_answer_pairs(self.open_examples)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (also valid YAML for :meth:`from_file`)."""
        d = dataclasses.asdict(self)
        d["open_examples"] = [list(pair) for pair in self.open_examples]
        d["lora"]["target_modules"] = list(self.lora.target_modules)
        if self.lora.layers is not None:
            d["lora"]["layers"] = list(self.lora.layers)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CalibrationConfig:
        """Build from a dict, rejecting unknown keys by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown calibration config key(s) {unknown}; valid keys: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_file(cls, path: str | Path) -> CalibrationConfig:
        """Load from a ``.yaml``/``.yml`` or ``.json`` file (see :func:`read_config_file`)."""
        data = read_config_file(path)
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from err


def _question_answer_pairs(value: Any) -> tuple[tuple[str, str], ...]:
    """``open_examples`` as a tuple of stripped ``(question, answer)`` pairs (lists accepted)."""
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"open_examples must be a list of [question, answer] pairs, got {value!r}")
    pairs = []
    for i, pair in enumerate(value):
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                or not all(isinstance(t, str) and t.strip() for t in pair)):
            raise ValueError(f"open_examples[{i}] must be a [question, answer] pair of two non-empty strings, "
                             f"got {pair!r}")
        pairs.append((pair[0].strip(), pair[1].strip()))
    return tuple(pairs)


def open_prompt_format(config: CalibrationConfig) -> PromptFormat:
    """The prompt of open questions under ``config``: the one place training
    (:func:`~llm_calib.calm.encoding.encode_records`) and the trunk-cached evaluator
    (:class:`~llm_calib.calm.fast_eval.SharedTrunkEval`) get it from; pass it as ``prompt`` to
    :func:`~llm_calib.scoring.open_ended.score_open_ended` to answer the same way.

    With ``config.open_examples``: the few-shot short-answer prompt of
    :func:`~llm_calib.prompts.short_answer_format` (plain text; ``chat_template`` is not used).
    Without: the scorer's reference prompt, ``PromptFormat(chat_template=config.chat_template)``.

    Example:
        >>> open_prompt_format(CalibrationConfig()).answer_prefix
        'The answer is:'
        >>> open_prompt_format(CalibrationConfig(open_examples=[["2 + 2?", "4"]])).description
        'Q: 2 + 2?\\nA: 4\\n\\n'
    """
    if config.open_examples:
        return short_answer_format(config.open_examples)
    return PromptFormat(chat_template=config.chat_template)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping stored in a ``.yaml``/``.yml`` or ``.json`` config file, not yet validated.

    The keys a file sets matter to callers that layer settings (defaults < file < flags), so
    this returns them as written; :meth:`CalibrationConfig.from_dict` validates them.

    Raises:
        ValueError: the file is not valid YAML/JSON or does not hold a mapping (names the file).
        OSError: the file cannot be read.

    Example:
        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "run.yaml"
        >>> _ = path.write_text("steps: 5\\nlora: {rank: 2}\\n")
        >>> read_config_file(path)
        {'steps': 5, 'lora': {'rank': 2}}
    """
    path = Path(path)
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: not valid YAML: {err}") from err
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config must be a mapping of keys to values")
    return data


def field_help(cls: type) -> dict[str, str]:
    """One line of help per field of a config dataclass, read from its ``Attributes:`` docstring.

    Fields documented together (``max_log_scale, max_bias: ...``) share their text.

    Example:
        >>> field_help(LoraSettings)["rank"]
        'adapter rank ``r``.'
    """
    out: dict[str, str] = {}
    lines = (cls.__doc__ or "").splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return out
    indent, names = None, []
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        if depth < indent:
            break
        if depth == indent and ":" in line:
            head, text = line.strip().split(":", 1)
            names = [n.strip() for n in head.split(",")]
            for n in names:
                out[n] = text.strip()
        else:
            for n in names:
                out[n] += " " + line.strip()
    return out
