"""A CALM step any training loop can call: :class:`CalmStep`.

The shape is torch's optimiser's, not optax's ``init``/``update``: θ lives in the user's
``nn.Module`` (the peft adapters), which a PyTorch loop, ``save_pretrained`` and the Trainer read
in place, so an object that updates the module and owns the rest of the run's state (λ, the
solver's state, λ's optimiser), saved by ``state_dict`` / ``load_state_dict``, fits where an
optimiser already sits. A pure ``update(state, batch) -> state`` would make every loop thread θ
through and copy it back into the module each step. The step itself is
:class:`~llm_calib.objectives.calm.CalmState`'s, the one :func:`llm_calib.calibrate` takes: same
losses, solver and λ update, so a loop feeding it the same batches trains the same θ and λ.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

import hypergrad as hg
from llm_calib import distributed
from llm_calib.calm.encoding import TRUNK_CHUNK, EncodedRecords
from llm_calib.calm.lora import FunctionalLM, attach_lora
from llm_calib.calm.losses import CalmLosses, DataParallelLosses
from llm_calib.calm.run import theta_optimizer as config_theta_optimizer
from llm_calib.calm.training import TrainingDiverged, parameter_summary
from llm_calib.config.calibration import CalibrationConfig
from llm_calib.engine.packing import pack_prompts
from llm_calib.formats import OpenEnded, TaskFormat
from llm_calib.integrations.batches import (
    LabelledSequence,
    labelled_sequences,
    pack_labelled,
    prompt_sequences,
)
from llm_calib.integrations.collators import QUESTIONS_KEY
from llm_calib.objectives.calm import Calm, CalmState
from llm_calib.training_interface import Batch

__all__ = ["CalmStep", "MicroBatches", "TrainerAdam", "attach_adapters"]


def attach_adapters(model: Any, config: CalibrationConfig | None = None) -> Any:
    """The model llm-calib wraps: LoRA adapters of ``config.lora`` (and its output scale) attached as
    :func:`llm_calib.calibrate` attaches them, after seeding torch with ``config.seed`` (the same
    initial θ).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> peft_model = attach_adapters(tiny_random_model()[0])
        >>> sorted({n.rsplit(".", 3)[-3] for n, p in peft_model.named_parameters() if p.requires_grad})
        ['lora_A', 'lora_B']
    """
    config = config or CalibrationConfig()
    torch.manual_seed(config.seed)
    return attach_lora(model, config.lora, output_scale=config.lora.output_scale)


@dataclasses.dataclass(frozen=True)
class TrainerAdam(hg.inner.Adam):
    """:class:`hypergrad.inner.Adam` stepping θ as a ``transformers.Trainer``'s AdamW (weight decay 0) does:
    every gradient first scaled to a global L2 norm of at most ``max_grad_norm`` (0: not clipped), and
    the step scaled by the learning-rate schedule's current factor (:meth:`set_scale`).

    The schedule's factor and the last gradient's norm before clipping (:attr:`last_norm`, for logs)
    are shared with the copies a solver derives (``dataclasses.replace``) for its inner steps.

    Example:
        >>> opt = TrainerAdam(lr=0.1, max_grad_norm=1.0)
        >>> w, _ = opt.update({"x": torch.zeros(2)}, {"x": torch.tensor([3.0, 4.0])}, opt.init({"x": torch.zeros(2)}))
        >>> float(opt.last_norm), [round(v, 4) for v in w["x"].tolist()]
        (5.0, [-0.1, -0.1])
        >>> opt.set_scale(0.5)
        >>> w, _ = opt.update({"x": torch.zeros(1)}, {"x": torch.tensor([1.0])}, opt.init({"x": torch.zeros(1)}))
        >>> round(w["x"].item(), 4)
        -0.05
    """

    max_grad_norm: float = 0.0
    shared: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def last_norm(self) -> Tensor | None:
        """The global norm of the last gradient before clipping (None before the first update)."""
        return self.shared.get("norm")

    def set_scale(self, scale: float) -> None:
        """Scale every step size (``lr`` and each ``leaf_lr``) by ``scale`` >= 0 from the next update on."""
        if not scale >= 0:
            raise ValueError(f"the learning-rate scale must be >= 0, got {scale!r}")
        self.shared["scale"] = float(scale)

    def update(self, w: dict[str, Tensor], grad: dict[str, Tensor], state: dict[str, Tensor]) -> Any:
        """Clip ``grad`` to :attr:`max_grad_norm`, then one Adam step scaled by the schedule's factor."""
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grad.values()]))
        self.shared["norm"] = norm.detach()
        if self.max_grad_norm > 0:
            factor = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            grad = {k: g * factor.to(g.dtype) for k, g in grad.items()}
        new_w, new_state = super().update(w, grad, state)
        scale = self.shared.get("scale", 1.0)
        if scale != 1.0:  # w + scale * (Adam's step); exactly Adam's own update at the schedule's factor 1
            new_w = {k: w[k] + scale * (new_w[k] - w[k]) for k in w}
        return new_w, new_state


class MicroBatches(tuple):
    """The micro-batches of one step: each loss of the step is their question-weighted mean.

    A loss over micro-batches computes each one's value and gradients in turn and keeps only the
    sums (gradient accumulation: the memory of one micro-batch), so it is first-order only.

    Example:
        >>> MicroBatches(()).total
        0
    """

    __slots__ = ()

    @property
    def total(self) -> int:
        """Questions in all micro-batches."""
        return sum(b.packed.batch_size for b in self)


class _Accumulate(torch.autograd.Function):
    """The weighted sum of a loss over micro-batches; gradients accumulated in the forward pass."""

    @staticmethod
    def forward(ctx: Any, loss: Callable[..., Tensor], keys: tuple[tuple[str, ...], tuple[str, ...]],
                micro: MicroBatches, *values: Tensor) -> Tensor:
        needs = ctx.needs_input_grad[3:]
        theta_keys, lam_keys = keys
        with torch.enable_grad():
            leaves = [v.detach().requires_grad_(bool(n)) for v, n in zip(values, needs, strict=True)]
            theta = dict(zip(theta_keys, leaves[: len(theta_keys)], strict=True))
            lam = dict(zip(lam_keys, leaves[len(theta_keys):], strict=True)) or None
            wanted = [leaf for leaf, n in zip(leaves, needs, strict=True) if n]
            total: Tensor | None = None
            sums: list[Tensor | None] = [None] * len(wanted)
            for batch in micro:
                value = loss(theta, lam, batch) * (batch.packed.batch_size / micro.total)
                grads = torch.autograd.grad(value, wanted, allow_unused=True) if wanted else ()
                sums = [s if g is None else g if s is None else s + g for s, g in zip(sums, grads, strict=True)]
                total = value.detach() if total is None else total + value.detach()
        it = iter(sums)
        ctx.grads = [next(it) if n else None for n in needs]
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> Any:
        return (None, None, None, *[None if g is None else grad_out * g for g in ctx.grads])


def _accumulated(loss: Callable[..., Tensor], theta: dict[str, Tensor], lam: dict[str, Tensor] | None,
                 micro: MicroBatches) -> Tensor:
    values = [*theta.values(), *(lam or {}).values()]
    if not (torch.is_grad_enabled() and any(v.requires_grad for v in values)):
        return sum(loss(theta, lam, b) * (b.packed.batch_size / micro.total) for b in micro)  # type: ignore[return-value]
    return _Accumulate.apply(loss, (tuple(theta), tuple(lam or {})), micro, *values)


class _MicroBatchLosses(CalmLosses):
    """:class:`~llm_calib.calm.losses.CalmLosses` that also take :class:`MicroBatches`."""

    def inner(self, theta: dict[str, Tensor], lam: dict[str, Tensor], batch: Any) -> Tensor:
        if isinstance(batch, MicroBatches):
            return _accumulated(lambda t, l, b: CalmLosses.inner(self, t, l, b), theta, lam, batch)
        return CalmLosses.inner(self, theta, lam, batch)

    def outer(self, theta: dict[str, Tensor], lam: dict[str, Tensor] | None, batch: Any) -> Tensor:
        if isinstance(batch, MicroBatches):
            return _accumulated(lambda t, l, b: CalmLosses.outer(self, t, l, b), theta, None, batch)
        return CalmLosses.outer(self, theta, lam, batch)


class _DataParallelMicroBatchLosses(DataParallelLosses, _MicroBatchLosses):
    """Means over ranks (:class:`~llm_calib.calm.losses.DataParallelLosses`) of micro-batched losses."""


class _Context:
    """The :class:`~llm_calib.training_interface.StepContext` of a :class:`CalmStep`."""

    def __init__(self, losses: CalmLosses, theta: dict[str, Tensor], theta_optimizer: Any) -> None:
        self.step = 0
        self.theta = theta
        self.losses = losses
        self.theta_optimizer = theta_optimizer
        self.upper: Any = None

    def unlabeled_batch(self) -> Any:
        return self.upper


def _check_trainable(model: Any) -> None:
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if not hasattr(model, "peft_config") or not trainable:
        why = ("it is not a peft model" if not hasattr(model, "peft_config")
               else "no parameter requires grad (loaded for inference? PeftModel.from_pretrained(..., is_trainable=True))")
        raise ValueError(f"CalmStep: {type(model).__name__} has no trainable adapters ({why}); CALM trains adapters "
                         "on a frozen base: wrap the model with peft.get_peft_model(model, LoraConfig(...)) or "
                         "llm_calib.integrations.attach_adapters(model)")


class CalmStep:
    """One CALM update of θ (the model's trainable adapters) and λ per :meth:`step`.

    Each call runs the configured solver's joint step of θ and λ's direction on a labelled batch
    (lower level g: cross-entropy under λ-adjusted predictions) and an unlabelled batch (upper
    level f: minus the deployed model's entropy), then one Adam step of λ within its bounds, and
    writes the new θ into the model's parameters. Do not also step an optimiser of θ: this is it.

    Batches: a Hugging Face causal-LM batch (``input_ids``, ``attention_mask``, ``labels`` with
    -100 where nothing is predicted; :mod:`llm_calib.integrations.batches`), a
    :class:`~llm_calib.integrations.MultipleChoiceCollator` batch, or a list of either (the
    micro-batches of one step). Unlabelled batches: prompts (no ``labels``), or a
    ``MultipleChoiceCollator(labels=False)`` batch. Under ``torchrun`` every rank passes its equal
    shard of the global batch and takes the identical step.

    Args:
        model: a peft model: the user's (``get_peft_model(model, LoraConfig(...))``) or
            :func:`attach_adapters`' (LoRA and the output scale as :func:`llm_calib.calibrate` trains them).
            Trainable adapter weights in half precision become float32 (master weights).
        config: the CALM settings: ``objective`` (a :class:`~llm_calib.objectives.calm.Calm`: solver,
            ``lam_lr``, ``adjustment``, bounds), ``training.lr`` (θ) and ``lora.output_scale_lr``.
        task_format: the format of the labelled batches: :class:`~llm_calib.formats.OpenEnded` (the
            default: causal-LM batches) or a ``MultipleChoiceCollator``'s ``format``; it decides λ's
            ``adjustment="auto"`` and the option-score normalisation.
        theta_optimizer: θ's :mod:`hypergrad.inner` optimiser (default:
            :func:`~llm_calib.calm.run.theta_optimizer` of ``config``).
        accumulation_steps: split every batch given whole into this many micro-batches (gradient
            accumulation: the memory of one; first-order solvers).
        answer_token_ids: the tokens of ``adjustment="answer_tokens"``.
        trunk_cache: cache the frozen bottom layers' hidden states of each question (models whose
            adapters sit on the top layers only; llm-calib's default LoRA).

    Raises:
        ValueError: a model without trainable adapters, an objective other than CALM, or
            ``answer_tokens`` without token ids; one line each.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.integrations import OpenAnswerCollator
        >>> model, tok = tiny_random_model()
        >>> calm = CalmStep(attach_adapters(model))
        >>> train = OpenAnswerCollator(tok)([{"question": "Capital of France?", "answers": ["Paris"]}])
        >>> upper = OpenAnswerCollator(tok, labels=False)([{"question": "Capital of Peru?"}])
        >>> record = calm.step(train, upper)
        >>> calm.steps_taken, sorted(k for k in record if k in ("g", "q", "unlabeled_entropy"))
        (1, ['g', 'q', 'unlabeled_entropy'])
    """

    def __init__(self, model: Any, config: CalibrationConfig | None = None, *, task_format: TaskFormat | None = None,
                 theta_optimizer: Any = None, accumulation_steps: int = 1,
                 answer_token_ids: Sequence[int] | None = None, trunk_cache: bool = True) -> None:
        config = config or CalibrationConfig()
        if not isinstance(config.objective, Calm):
            raise ValueError(f"CalmStep trains CALM: config.objective must be calm, got {config.objective.name!r}")
        if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
        _check_trainable(model)
        for param in model.parameters():  # the adapters' master weights (θ, Adam's moments) in float32
            if param.requires_grad and param.dtype in (torch.float16, torch.bfloat16):
                param.data = param.data.float()
        self.config = config
        self.objective: Calm = config.objective
        if accumulation_steps > 1 and self.objective.second_order:
            raise ValueError(f"accumulation_steps={accumulation_steps} needs a first-order solver (bome, f2sa): the "
                             f"{self.objective.solver.name} solver differentiates the whole batch twice")
        self.model = model
        self.lm = FunctionalLM(model)
        self.task_format = task_format or OpenEnded()
        self.accumulation_steps = accumulation_steps
        self.trunk_cache = trunk_cache
        pad = getattr(getattr(self.lm.base, "config", None), "pad_token_id", None)
        self.pad_id = int(pad) if isinstance(pad, int) else 0
        vocab = self.lm.head.out_features if hasattr(self.lm.head, "out_features") else self.lm.base.config.vocab_size
        kind = self.task_format.auto_adjustment if self.objective.adjustment == "auto" else self.objective.adjustment
        if kind == "answer_tokens" and not answer_token_ids:
            raise ValueError("adjustment 'answer_tokens' needs answer_token_ids (the tokens λ adjusts)")
        adjustment = self.objective.logit_adjustment(vocab, answer_token_ids or (), self.task_format.auto_adjustment)
        self.task_format.check_adjustment(adjustment)
        loss_class = _DataParallelMicroBatchLosses if distributed.is_distributed() else _MicroBatchLosses
        self.losses = loss_class(self.lm, adjustment, getattr(self.task_format, "normalize", "sum"))
        theta = self.lm.theta()
        if distributed.is_distributed():  # every rank starts from rank 0's θ (as DDP broadcasts its parameters)
            for value in theta.values():
                torch.distributed.broadcast(value, src=0)
            self.lm.load_theta(theta)
        self.theta_optimizer = theta_optimizer if theta_optimizer is not None else config_theta_optimizer(config.lora, config.training.lr)
        self._context = _Context(self.losses, theta, self.theta_optimizer)
        self.state: CalmState = self.objective.start(self._context)
        self._trunks: dict[Any, Tensor] = {}

    # --------------------------------------------------------------------------- state

    @property
    def steps_taken(self) -> int:
        """CALM steps taken (restored by :meth:`load_state_dict`)."""
        return self._context.step

    @property
    def theta(self) -> dict[str, Tensor]:
        """The current θ (detached; the model's adapters hold the same values)."""
        return self._context.theta

    @property
    def lam(self) -> dict[str, Tensor]:
        """The current λ."""
        return self.state.lam

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs (θ, λ, the solver's and λ-optimiser's state, the step count),
        as tensors and plain values: ``torch.save`` it, ``torch.load(..., weights_only=True)`` reads it.

        Example:
            >>> from llm_calib.models import tiny_random_model
            >>> sorted(CalmStep(attach_adapters(tiny_random_model()[0])).state_dict())
            ['adjustment', 'lam', 'lam_optimizer', 'solver_state', 'steps', 'theta']
        """
        trees, meta = self.state.checkpoint()
        adjustment = self.losses.adjustment
        return {
            "steps": self.steps_taken,
            "theta": {k: v.detach().clone() for k, v in self.theta.items()},
            "lam": {k: v.detach().clone() for k, v in trees["lam/"].items()},
            "solver_state": _clone_tree(trees["method/"]),
            "lam_optimizer": meta["lam_optimizer"],
            "adjustment": {"kind": adjustment.kind, "vocab_size": adjustment.vocab_size},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state (and write its θ into the model).

        Raises:
            ValueError: a state of another model or adjustment (θ or λ entries that differ in name
                or shape); names the first one.
        """
        missing = sorted({"steps", "theta", "lam", "solver_state", "lam_optimizer"} - set(state))
        if missing:
            raise ValueError(f"CalmStep.load_state_dict: not a CalmStep state (missing {missing})")
        for what, mine, theirs in (("θ", self.theta, state["theta"]), ("λ", self.lam, state["lam"])):
            if set(mine) != set(theirs):
                odd = sorted(set(mine) ^ set(theirs))[0]
                raise ValueError(f"CalmStep.load_state_dict: the state's {what} does not fit this step ({odd!r} is in "
                                 "one and not the other): it was saved from another model, adapter or adjustment")
            for k, v in theirs.items():
                if tuple(v.shape) != tuple(mine[k].shape):
                    raise ValueError(f"CalmStep.load_state_dict: {what} entry {k!r} has shape {tuple(v.shape)} in the "
                                     f"state, {tuple(mine[k].shape)} here")
        device = self.lm.device
        theta = {k: v.detach().to(device=device, dtype=self.theta[k].dtype).clone() for k, v in state["theta"].items()}
        self._context.theta = theta
        self.lm.load_theta(theta)
        solver = _to_device(state["solver_state"], device)
        self.state.restore({"lam/": _to_device(state["lam"], device), "method/": solver},
                           {"lam_optimizer": state["lam_optimizer"]})
        self._context.step = int(state["steps"])

    # --------------------------------------------------------------------------- batches

    def batch(self, data: Any, *, upper: bool = False) -> Batch | MicroBatches:
        """The CALM batch of ``data`` (see the class; a list: its micro-batches), with cached trunks.

        Raises:
            ValueError: a batch that is neither kind, labels all -100 in a sequence, labels in an
                upper-level batch, or ``accumulation_steps`` that does not divide the batch.
        """
        what = "upper-level batch" if upper else "labelled batch"
        if isinstance(data, (list, tuple)) and not isinstance(data, MicroBatches):
            parts = [self._questions(d, what) for d in data]
            return MicroBatches(self._build(kind, items, upper) for kind, items in parts)
        kind, items = self._questions(data, what)
        k = self.accumulation_steps
        if k == 1:
            return self._build(kind, items, upper)
        if len(items) % k:
            raise ValueError(f"{what}: accumulation_steps={k} does not divide its {len(items)} questions: every "
                             f"micro-batch must hold the same number; use a batch size divisible by {k}")
        size = len(items) // k
        return MicroBatches(self._build(kind, items[i * size : (i + 1) * size], upper) for i in range(k))

    def _questions(self, data: Any, what: str) -> tuple[str, Any]:
        if isinstance(data, Batch):
            return "batch", [data]
        if isinstance(data, Mapping) and QUESTIONS_KEY in data:
            data = data[QUESTIONS_KEY]
        if isinstance(data, EncodedRecords):
            return "encoded", [(data, i) for i in range(len(data))]
        if what.startswith("upper"):
            return "prompts", prompt_sequences(data, what=what)
        return "labelled", labelled_sequences(data, what=what)

    def _build(self, kind: str, items: list[Any], upper: bool) -> Batch:
        if kind == "batch":
            if len(items) != 1:
                raise ValueError("a prepared Batch cannot be split into micro-batches; pass a list of them")
            return items[0]
        if kind == "encoded":
            enc, idx = items[0][0], [i for _, i in items]
            if not upper and enc.format != self.task_format:
                raise ValueError(f"labelled batch: its questions are {enc.format.description} ({type(enc.format).__name__}) "
                                 f"but this CalmStep was made for {type(self.task_format).__name__}: pass "
                                 "task_format=collator.format to CalmStep")
            self._fill_encoded(enc, idx)
            return enc.batch(idx, self.pad_id, self.lm if self._caching() else None)
        if not upper and self.task_format.layout != "open":
            raise ValueError(f"labelled batch: a causal-LM batch (open answers) but this CalmStep was made for "
                             f"{type(self.task_format).__name__}; multiple-choice questions come through "
                             "MultipleChoiceCollator")
        if kind == "prompts":
            packed = pack_prompts(items, self.pad_id)
            trunk = self._sequence_trunks(items, packed)
            return Batch(packed, torch.zeros(len(items), dtype=torch.long), [f"prompt{i}" for i in range(len(items))],
                         OpenEnded(), trunk)
        packed = pack_labelled(items, self.pad_id)
        trunk = self._sequence_trunks([s.tokens for s in items], packed)
        return Batch(packed, torch.zeros(len(items), dtype=torch.long), [f"seq{i}" for i in range(len(items))],
                     self.task_format, trunk)

    def _caching(self) -> bool:
        return self.trunk_cache and self.lm.caches_trunk

    def _fill_encoded(self, enc: EncodedRecords, indices: Sequence[int]) -> None:
        if not self._caching():
            return
        keys = {i: (enc.prompts[i], enc.options[i]) for i in indices}
        missing = [i for i in dict.fromkeys(indices) if keys[i] not in self._trunks and i not in enc.trunk_cache]
        for start in range(0, len(missing), TRUNK_CHUNK):
            chunk = missing[start : start + TRUNK_CHUNK]
            hidden = self.lm.trunk_hidden(enc.pack(chunk, self.pad_id))
            for row, i in enumerate(chunk):
                self._trunks[keys[i]] = hidden[row, : enc.length(i)].clone()
        for i in indices:
            enc.trunk_cache.setdefault(i, self._trunks.get(keys[i]))

    def _sequence_trunks(self, seqs: list[tuple[int, ...]], packed: Any) -> Tensor | None:
        if not self._caching():
            return None
        missing = [s for s in dict.fromkeys(seqs) if s not in self._trunks]
        for start in range(0, len(missing), TRUNK_CHUNK):
            chunk = missing[start : start + TRUNK_CHUNK]
            hidden = self.lm.trunk_hidden(pack_prompts(chunk, self.pad_id))
            for row, s in enumerate(chunk):
                self._trunks[s] = hidden[row, : len(s)].clone()
        L = packed.input_ids.shape[1]
        return torch.stack([torch.nn.functional.pad(self._trunks[s], (0, 0, 0, L - len(s))) for s in seqs])

    @property
    def cached_trunks(self) -> int:
        """How many questions' trunks are cached."""
        return len(self._trunks)

    def cache_trunks(self, data: Any) -> int:
        """Compute the trunks of ``data``'s questions not cached yet, together (in chunks of
        :data:`~llm_calib.calm.encoding.TRUNK_CHUNK`); return how many were cached before.

        :func:`llm_calib.calibrate` computes each question's trunk in the chunk of 16 consecutive
        questions of its set; filling the cache set by set in the same chunks reproduces its numbers
        exactly (a question computed alone can differ in the last bits). No-op without trunk caching.
        """
        before = len(self._trunks)
        if not self._caching():
            return 0
        kind, items = self._questions(data, "batch")
        if kind == "encoded":
            self._fill_encoded(items[0][0], [i for _, i in items])
        elif kind in ("labelled", "prompts"):
            seqs = [s.tokens if isinstance(s, LabelledSequence) else s for s in items]
            self._sequence_trunks(seqs, pack_prompts(seqs, self.pad_id))
        return before

    # --------------------------------------------------------------------------- the step

    def step(self, batch: Any, upper_batch: Any) -> dict[str, float]:
        """One CALM step on a labelled ``batch`` and an unlabelled ``upper_batch``; θ is written into the model.

        Returns:
            The step's record: ``step`` (1-based), ``g``, ``unlabeled_entropy``, the solver's
            diagnostics (BOME: ``q``, ``phi``, ``grad_q_norm``), and λ's mean and largest absolute
            entry (``lambda_<name>_mean``, ``lambda_<name>_absmax``), the output log-scale when trained.

        Raises:
            ~llm_calib.calm.training.TrainingDiverged: a loss or update became NaN/inf.
            ValueError: bad batches (see :meth:`batch`), or under ``torchrun`` shards of different sizes.
        """
        inner = self.batch(batch)
        outer = self.batch(upper_batch, upper=True)
        if distributed.is_distributed():
            _check_equal_shards(inner, outer)
        self._context.upper = outer
        try:
            with self.lm.train_mode(), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*use_reentrant.*")
                record = self.state.step(self._context, inner)
            hg.tree.check_finite(self._context.theta, "updated adapter parameters")
        except (hg.NonFiniteError, FloatingPointError) as err:
            raise TrainingDiverged(f"CALM step {self.steps_taken + 1}: {err}; lower the learning rates or check "
                                   "the batch") from err
        finally:
            self._context.upper = None
        self._context.step += 1
        self.lm.load_theta(self._context.theta)
        out = {"step": self.steps_taken, **record, **parameter_summary(self.theta, self.lam)}
        norm = getattr(self.theta_optimizer, "last_norm", None)
        if norm is not None:
            out["theta_grad_norm"] = float(norm)
        return out

    def evaluate(self, batch: Any) -> dict[str, Tensor]:
        """Per-question held-out statistics of the deployed model on a labelled ``batch``
        (``confidence``, ``correct``, ``nll``, ``entropy``; float64 on the CPU), as llm-calib's
        held-out monitor reads them (multiple choice: exact; causal-LM batches: teacher-forced)."""
        data = self.batch(batch)
        parts = list(data) if isinstance(data, MicroBatches) else [data]
        stats = [self.losses.monitor(b) for b in parts]
        return {k: torch.cat([s[k] for s in stats]) for k in stats[0]}


def _check_equal_shards(inner: Any, outer: Any) -> None:
    sizes = [b.packed.batch_size if isinstance(b, Batch) else b.total for b in (inner, outer)]
    most = distributed.max_over_ranks([*sizes, *(-s for s in sizes)])
    if most[0] != -most[2] or most[1] != -most[3]:
        raise ValueError(f"under torchrun every rank passes an equal shard of the global batch; this rank has "
                         f"{sizes[0]} labelled and {sizes[1]} upper-level questions, other ranks between "
                         f"{-most[2]}-{most[0]} and {-most[3]}-{most[1]}")


def _clone_tree(tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {k: _clone_tree(v) for k, v in tree.items()}
    return tree.detach().clone() if isinstance(tree, Tensor) else tree


def _to_device(tree: Any, device: torch.device) -> Any:
    if isinstance(tree, Mapping):
        return {k: _to_device(v, device) for k, v in tree.items()}
    return tree.to(device) if isinstance(tree, Tensor) else tree
