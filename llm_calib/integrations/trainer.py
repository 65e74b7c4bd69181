"""CALM inside ``transformers.Trainer``: :class:`CalmTrainer` (and :class:`CalmTrainerMixin` for its subclasses).

Why a subclass (of a mixin) and not callbacks: a CALM step needs the step's whole batch, an
unlabelled batch and two losses, and steps θ itself; callbacks see neither batches nor losses and
cannot replace the backward pass and the optimiser step. The subclass changes the few extension
points the Trainer documents for this and keeps everything else (data loading and sharding,
accumulation windows, schedules, logging callbacks, checkpoints, resuming, evaluation scheduling):

* ``training_step`` collects the micro-batches of a window and, at its last one, takes one
  :class:`~llm_calib.integrations.CalmStep` on them (under the Trainer's bf16 autocast) with the
  step's unlabelled batch; the returned loss is the step's g;
* ``create_optimizer`` puts a :class:`CalmOptimizer` in the optimiser slot: it carries the
  learning rate the scheduler sets (θ's step is scaled by it) and the whole CALM state, so the
  Trainer's own ``optimizer.pt`` in every checkpoint holds θ, λ, the solver's and λ's optimiser
  state, and ``resume_from_checkpoint`` restores them; its ``step`` does nothing;
* ``log`` adds the CALM statistics of the steps since the last log (``calm/g``,
  ``calm/unlabeled_entropy``, λ's mean and largest entry, ...) to the Trainer's logs, so
  TensorBoard / W&B callbacks show them;
* ``evaluate`` reports llm-calib's held-out monitor (``eval_accuracy``, ``eval_ece``,
  ``eval_nll``, ``eval_entropy``, ``eval_confidence``), gathered over ranks;
* the training sampler draws the seeded batches :func:`llm_calib.calibrate` draws, so the same
  data, seed and settings give the same run; ``save_model`` (the final save) also writes a model card.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from llm_calib.calm import batch_order
from llm_calib.calm.run import theta_optimizer as config_theta_optimizer
from llm_calib.config.calibration import CalibrationConfig
from llm_calib.integrations.batches import labelled_prompts, prompt_batch
from llm_calib.integrations.collators import (
    QUESTIONS_KEY,
    MultipleChoiceCollator,
    OpenAnswerCollator,
    PromptCollator,
)
from llm_calib.integrations.model_card import calibration_table, write_model_card
from llm_calib.integrations.step import CalmStep, TrainerAdam
from llm_calib.metrics.calibration import ece as ece_metric
from llm_calib.objectives.base import settings_to_dict

try:
    from transformers import Trainer
except ImportError as err:  # pragma: no cover - transformers is in the llm extra
    raise ImportError("llm_calib.integrations.trainer needs transformers: pip install 'llm-calib[llm]'") from err

__all__ = ["ADAM_OPTIMIZERS", "CalibrationOrderSampler", "CalmOptimizer", "CalmTrainer", "CalmTrainerMixin",
           "check_training_arguments"]

ADAM_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw", "adam")
"""``TrainingArguments.optim`` values a CALM run takes: θ steps with Adam (weight decay 0), like these."""


def check_training_arguments(args: Any) -> None:
    """Refuse the ``TrainingArguments`` a CALM step cannot honour, one line naming the feature.

    Raises:
        ValueError: DeepSpeed, FSDP, fp16, ``torch_compile``, NEFTune, label smoothing, weight
            decay, an optimiser other than Adam(W), or ``nn.DataParallel`` over several GPUs.

    Example:
        >>> from transformers import TrainingArguments
        >>> check_training_arguments(TrainingArguments("out", report_to="none"))
        >>> check_training_arguments(TrainingArguments("out", optim="adafactor", report_to="none"))
        Traceback (most recent call last):
        ...
        ValueError: CalmTrainer does not support TrainingArguments(optim='adafactor'): CALM steps θ with Adam (the solver's θ optimiser); use optim='adamw_torch' (weight_decay=0)
    """
    optim = str(getattr(getattr(args, "optim", "adamw_torch"), "value", getattr(args, "optim", "adamw_torch")))
    problems = [
        (bool(getattr(args, "deepspeed", None)), "deepspeed=...", "CALM takes its functional step on the unsharded "
         "adapters; run plain data parallel (torchrun) instead"),
        (bool(getattr(args, "fsdp", None)), f"fsdp={args.fsdp!r}", "CALM takes its functional step on the "
         "unsharded adapters; run plain data parallel (torchrun) instead"),
        (bool(getattr(args, "fp16", False)), "fp16=True", "the CALM step takes no loss scaling; use bf16=True"),
        (bool(getattr(args, "torch_compile", False)), "torch_compile=True", "the CALM step calls the model "
         "functionally, outside the compiled forward"),
        (getattr(args, "neftune_noise_alpha", None) is not None, f"neftune_noise_alpha={args.neftune_noise_alpha}",
         "noise on the embeddings would change the bilevel problem"),
        (bool(getattr(args, "label_smoothing_factor", 0.0)), f"label_smoothing_factor={args.label_smoothing_factor}",
         "CALM's lower level is its own cross-entropy under λ"),
        (bool(getattr(args, "weight_decay", 0.0)), f"weight_decay={args.weight_decay}", "CALM steps θ with Adam "
         "without weight decay; set weight_decay=0"),
        (optim not in ADAM_OPTIMIZERS, f"optim={optim!r}",
         "CALM steps θ with Adam (the solver's θ optimiser); use optim='adamw_torch' (weight_decay=0)"),
        (getattr(args, "n_gpu", 1) > 1, f"n_gpu={getattr(args, 'n_gpu', 1)} (nn.DataParallel)", "launch one process "
         "per GPU with torchrun or accelerate instead"),
    ]
    for bad, feature, why in problems:
        if bad:
            raise ValueError(f"CalmTrainer does not support TrainingArguments({feature}): {why}")


class CalibrationOrderSampler(torch.utils.data.Sampler[int]):
    """The order of :func:`llm_calib.calibrate`'s training batches, as a sampler.

    Per epoch, the global batch of each step is :func:`~llm_calib.calm.batch_order.batch_indices`
    (a per-epoch permutation seeded by ``seed``, cut into batches of ``batch_size``, a remainder
    dropped); the sampler yields those batches one after the other. A DataLoader of
    ``batch_size / (accumulation x ranks)`` per process then hands every step exactly those questions.

    Example:
        >>> s = CalibrationOrderSampler(10, 4, seed=0)
        >>> len(s), list(s)[:4] == batch_order.batch_indices(10, 4, 0, 0, batch_order.TRAIN_STREAM)
        (8, True)
    """

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order :meth:`__iter__` yields (the Trainer sets it)."""
        self.epoch = int(epoch)

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per epoch."""
        return max(1, self.n // self.batch_size)

    def __len__(self) -> int:
        return self.steps_per_epoch * min(self.batch_size, self.n)

    def __iter__(self) -> Iterator[int]:
        first = self.epoch * self.steps_per_epoch
        for step in range(first, first + self.steps_per_epoch):
            yield from batch_order.batch_indices(self.n, self.batch_size, step, self.seed, batch_order.TRAIN_STREAM)


class CalmOptimizer(torch.optim.Optimizer):
    """The Trainer's optimiser slot during a CALM run.

    It holds the adapters as its parameters so that the Trainer's scheduler sets their learning rate
    (θ's step is scaled by it), and its state is the :class:`~llm_calib.integrations.CalmStep`'s, so
    the Trainer's checkpoints save and restore θ, λ and the solvers' state. :meth:`step` does nothing:
    the CALM step has already updated θ in ``training_step``.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.integrations import attach_adapters
        >>> opt = CalmOptimizer(CalmStep(attach_adapters(tiny_random_model()[0])), lr=1e-3)
        >>> sorted(opt.state_dict())
        ['calm', 'param_groups']
    """

    def __init__(self, calm: CalmStep, lr: float) -> None:
        params = [p for p in calm.model.parameters() if p.requires_grad]
        super().__init__(params, {"lr": lr})
        self.calm = calm

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Nothing: the CALM step ran in the Trainer's ``training_step``."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """The learning rates of the parameter group and the CALM state (:meth:`CalmStep.state_dict`)."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"param_groups": groups, "calm": self.calm.state_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s learning rates and CALM state.

        Raises:
            ValueError: an optimiser state that a CALM run did not write (another optimiser's checkpoint).
        """
        if "calm" not in state_dict:
            raise ValueError("resume_from_checkpoint: the checkpoint's optimizer.pt holds no CALM state (it was "
                             "written by another optimiser, not by CalmTrainer); start this run without resuming")
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=False):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.calm.load_state_dict(state_dict["calm"])


def _mean_records(records: Sequence[dict[str, float]]) -> dict[str, float]:
    """Means of the steps' losses and diagnostics; λ's and the scale's statistics of the last step."""
    last = records[-1]
    out = {}
    for key in last:
        if key == "step":
            continue
        if key.startswith("lambda_") or key == "output_log_scale":
            out[key] = float(last[key])
        else:
            values = [r[key] for r in records if key in r]
            out[key] = float(sum(values) / len(values))
    return out


class CalmTrainerMixin:
    """What turns a ``transformers.Trainer`` (or a subclass, e.g. TRL's ``SFTTrainer``) into a CALM trainer.

    Use it first in the bases: ``class MyTrainer(CalmTrainerMixin, SomeTrainer)``; :class:`CalmTrainer`
    is ``CalmTrainerMixin`` over ``Trainer``. It takes the Trainer's arguments plus the keyword-only
    CALM options below.

    Keyword Args:
        calm_config: the CALM settings (:class:`~llm_calib.config.calibration.CalibrationConfig`: ``objective``
            with its solver, ``lam_lr``, ``adjustment``; ``lora.output_scale_lr``; the prompt of the
            default multiple-choice collators). θ's learning rate, Adam's betas and epsilon, the
            schedule and ``max_grad_norm`` come from the ``TrainingArguments``.
        upper_dataset: unlabelled upper-level inputs (prompts, or multiple-choice questions without
            answers). None: the evaluation set's inputs, its labels ignored (what
            :func:`llm_calib.calibrate` does without ``unlabeled``).
        upper_collator: collates ``upper_dataset`` (default: a :class:`~llm_calib.integrations.MultipleChoiceCollator`
            or :class:`~llm_calib.integrations.OpenAnswerCollator` without labels when ``data_collator``
            is one, else a :class:`~llm_calib.integrations.PromptCollator` of the tokenizer).
        upper_batch_size: upper-level inputs per step, over all ranks (default: the step's
            training batch, ``per_device_train_batch_size x gradient_accumulation_steps x ranks``).
        calm_sampler: draw training batches in :func:`llm_calib.calibrate`'s seeded order (default
            True); False: the Trainer's own sampler.

    Raises:
        ValueError: a Trainer feature CALM does not support (:func:`check_training_arguments`), an
            optimiser or ``compute_loss_func`` given, no upper-level inputs, or an
            ``upper_batch_size`` that ranks and gradient accumulation do not divide; one line each.
    """

    calm_config: CalibrationConfig

    def __init__(self, *args: Any, calm_config: CalibrationConfig | None = None, upper_dataset: Any = None,
                 upper_collator: Any = None, upper_batch_size: int | None = None, calm_sampler: bool = True,
                 **kwargs: Any) -> None:
        given_optimizer = kwargs.get("optimizers", (None, None))[0] is not None or kwargs.get("optimizer_cls_and_kwargs")
        if given_optimizer:
            raise ValueError("CalmTrainer: do not pass optimizers / optimizer_cls_and_kwargs: the CALM step is θ's "
                             "optimiser (its Adam takes TrainingArguments' learning_rate, adam_beta1/2, adam_epsilon)")
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("CalmTrainer: do not pass compute_loss_func: CALM's losses (g under λ, f on the upper "
                             "level) replace the Trainer's loss")
        self.calm_config = calm_config or CalibrationConfig()
        super().__init__(*args, **kwargs)
        check_training_arguments(self.args)
        self.calm: CalmStep | None = None
        self.calm_sampler = calm_sampler
        self._pending: list[Any] = []
        self._records: list[dict[str, float]] = []
        self._theta_optimizer: TrainerAdam | None = None
        self.upper_labels_ignored = upper_dataset is None
        self.upper_dataset = self.eval_dataset if upper_dataset is None else upper_dataset
        if isinstance(self.upper_dataset, Mapping):  # several evaluation sets: the first one's inputs
            self.upper_dataset = next(iter(self.upper_dataset.values()))
        if self.upper_dataset is None:
            raise ValueError("CalmTrainer needs unlabelled upper-level inputs: pass upper_dataset= (prompts, or "
                             "questions without answers), or eval_dataset= (its inputs are used, labels ignored)")
        self.upper_collator = upper_collator or self._default_upper_collator()
        accumulation, ranks = self.args.gradient_accumulation_steps, max(1, self.args.world_size)
        step_batch = self.args.per_device_train_batch_size * accumulation * ranks
        self.upper_batch_size = step_batch if upper_batch_size is None else int(upper_batch_size)
        if self.upper_batch_size < 1 or self.upper_batch_size % (accumulation * ranks):
            raise ValueError(f"upper_batch_size={self.upper_batch_size} must be a positive multiple of "
                             f"gradient_accumulation_steps x processes = {accumulation} x {ranks}: every micro-batch "
                             "of every rank holds the same number of upper-level inputs")

    # ------------------------------------------------------------------ set-up

    def _default_upper_collator(self) -> Any:
        labels = None if self.upper_labels_ignored else False
        collator = self.data_collator
        if isinstance(collator, MultipleChoiceCollator):
            return MultipleChoiceCollator(collator.tokenizer, self.calm_config, labels=labels)
        if isinstance(collator, OpenAnswerCollator):
            return OpenAnswerCollator(collator.tokenizer, self.calm_config, labels=labels)
        if self.upper_labels_ignored:
            return collator  # the evaluation set's own collation; its prompts are cut before the first label
        if self.processing_class is None or not hasattr(self.processing_class, "pad_token_id"):
            raise ValueError("CalmTrainer: pass upper_collator= to collate upper_dataset (or processing_class=, the "
                             "tokenizer, for llm_calib.integrations.PromptCollator)")
        return PromptCollator(self.processing_class, labels=False)

    def _remove_unused_columns(self, dataset: Any, description: str | None = None) -> Any:
        """Keep a ``datasets.Dataset``'s question columns for llm-calib's collators (they are not model inputs)."""
        if isinstance(self.data_collator, (MultipleChoiceCollator, OpenAnswerCollator)):
            return dataset
        return super()._remove_unused_columns(dataset, description)  # type: ignore[misc]

    def _seed(self) -> int:
        return int(self.args.data_seed if getattr(self.args, "data_seed", None) is not None else self.args.seed)

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        """:class:`CalibrationOrderSampler` of the step's global batch (``calm_sampler=False``: the Trainer's)."""
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if not self.calm_sampler or dataset is None or not hasattr(dataset, "__len__"):
            return super()._get_train_sampler(train_dataset)  # type: ignore[misc]
        args = self.args
        step_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size)
        return CalibrationOrderSampler(len(dataset), step_batch, self._seed())

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """The :class:`CalmOptimizer` of this run's :class:`~llm_calib.integrations.CalmStep` (made here,
        after the Trainer has switched on gradient checkpointing)."""
        if self.optimizer is None:
            self.optimizer = CalmOptimizer(self.calm_step(), self.args.learning_rate)
        return self.optimizer

    def calm_step(self) -> CalmStep:
        """The run's :class:`~llm_calib.integrations.CalmStep` (made on first use)."""
        if self.calm is None:
            args = self.args
            base = config_theta_optimizer(self.calm_config.lora, args.learning_rate)
            self._theta_optimizer = TrainerAdam(lr=base.lr, leaf_lr=dict(base.leaf_lr),
                                                betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                                                max_grad_norm=float(args.max_grad_norm or 0.0))
            collator = self.data_collator
            task_format = getattr(collator, "format", None)
            accumulation = args.gradient_accumulation_steps
            if accumulation > 1 and self.calm_config.objective.second_order:
                raise ValueError(f"gradient_accumulation_steps={accumulation} needs a first-order solver (bome, f2sa): "
                                 f"the {self.calm_config.objective.solver.name} solver differentiates the whole batch twice")
            model = self.accelerator.unwrap_model(self.model) if hasattr(self, "accelerator") else self.model
            self.calm = CalmStep(model, self.calm_config, task_format=task_format,
                                 theta_optimizer=self._theta_optimizer)
            self._fill_trunk_caches()
        return self.calm

    def _fill_trunk_caches(self) -> None:
        """Cache the trunks set by set in chunks of 16, as :func:`llm_calib.calibrate` does (the same numbers)."""
        calm = self.calm
        if calm is None or not (calm.trunk_cache and calm.lm.caches_trunk):
            return
        from llm_calib.calm.encoding import TRUNK_CHUNK

        sets = [(self.train_dataset, self.data_collator, False)]
        evals = self.eval_dataset.values() if isinstance(self.eval_dataset, Mapping) else [self.eval_dataset]
        sets += [(e, self.data_collator, False) for e in evals if e is not None]
        if not self.upper_labels_ignored:
            sets.append((self.upper_dataset, self.upper_collator, True))
        for data, collate, upper in sets:
            if data is None or not hasattr(data, "__len__") or not hasattr(data, "__getitem__"):
                continue
            for start in range(0, len(data), TRUNK_CHUNK):
                examples = [data[i] for i in range(start, min(start + TRUNK_CHUNK, len(data)))]
                batch = collate(examples)
                calm.cache_trunks(self._upper_input(batch) if upper else batch)

    # ------------------------------------------------------------------ the step

    def _upper_input(self, batch: Any) -> Any:
        """An upper-level batch as the CALM step takes it (from a labelled set: its prompts alone)."""
        if self.upper_labels_ignored and isinstance(batch, Mapping) and QUESTIONS_KEY not in batch \
                and batch.get("labels") is not None:
            calm = self.calm_step()
            prompts = labelled_prompts(batch, what="upper-level batch (from eval_dataset)")
            if all(len(p) == 1 for p in prompts):
                raise ValueError("upper level from eval_dataset: its labels cover whole sequences (every token after the "
                                 "first), so it holds no prompts to read; pass upper_dataset= (prompt-only rows), or "
                                 "label completions only (TRL: prompt/completion data, or assistant_only_loss=True)")
            return prompt_batch(prompts, calm.pad_id)
        return batch

    def _upper_micro_batches(self, step: int) -> list[Any]:
        """This rank's upper-level micro-batches of ``step`` (0-based): calibrate's seeded stream, sharded."""
        n = len(self.upper_dataset)
        idx = batch_order.shard(batch_order.batch_indices(n, self.upper_batch_size, step, self._seed(),
                                                    batch_order.UPPER_STREAM))
        parts = self.args.gradient_accumulation_steps
        size = len(idx) // parts
        if size < 1:
            raise ValueError(f"the upper-level set has {n} inputs, fewer than gradient_accumulation_steps x processes "
                             f"= {parts * max(1, self.args.world_size)}")
        chunks = [idx[i * size : (i + 1) * size] for i in range(parts)]
        return [self._upper_input(self.upper_collator([self.upper_dataset[i] for i in chunk])) for chunk in chunks]

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Tensor:
        """Collect the window's micro-batches; at its last one, take one CALM step and return its g."""
        self._pending.append(inputs)
        device = self.args.device
        if not self.accelerator.gradient_state.sync_gradients:
            return torch.zeros((), device=device)
        micro, self._pending = self._pending, []
        calm = self.calm_step()
        lr = self.optimizer.param_groups[0]["lr"]
        self._theta_optimizer.set_scale(lr / self.args.learning_rate)
        upper = self._upper_micro_batches(self.state.global_step)
        with self.accelerator.autocast():
            record = calm.step(micro if len(micro) > 1 else micro[0], upper if len(upper) > 1 else upper[0])
        self._records.append(record)
        return torch.tensor(float(record["g"]), device=device)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, with the CALM statistics of the steps since the last training log
        (``calm/<name>``; the Trainer's ``grad_norm``, which no backward pass fills, becomes θ's
        update direction's norm before clipping)."""
        if "loss" in logs and self._records:
            calm = _mean_records(self._records)
            self._records = []
            if "grad_norm" in logs:
                if "theta_grad_norm" in calm:
                    logs["grad_norm"] = calm["theta_grad_norm"]
                else:
                    del logs["grad_norm"]
            logs.update({f"calm/{k}": v for k, v in calm.items() if k != "theta_grad_norm"})
        super().log(logs, *args, **kwargs)  # type: ignore[misc]

    # ------------------------------------------------------------------ evaluation

    def calibration_stats(self, eval_dataset: Any = None) -> tuple[dict[str, Tensor], list[str]]:
        """Per-question held-out statistics of the current model on ``eval_dataset`` (default: the
        evaluation set), gathered over ranks: ``confidence``, ``correct``, ``nll``, ``entropy``, and
        each question's domain (multiple-choice records' ``domain``; else ``"eval"``)."""
        calm = self.calm_step()
        loader = self.get_eval_dataloader(eval_dataset)
        stats: dict[str, list[Tensor]] = {}
        domains: list[str] = []
        with torch.inference_mode(), self.accelerator.autocast():
            for batch in loader:
                one = calm.evaluate(batch)
                for key, value in one.items():
                    stats.setdefault(key, []).append(self.accelerator.gather_for_metrics(value.to(self.args.device)).cpu())
                enc = batch.get(QUESTIONS_KEY) if isinstance(batch, Mapping) else None
                names = [r.domain for r in enc.records] if enc is not None else ["eval"] * len(one["confidence"])
                domains += list(self.accelerator.gather_for_metrics(names, use_gather_object=True))
        if not stats:
            raise ValueError("CalmTrainer.evaluate: the evaluation set is empty")
        return {k: torch.cat(v).double() for k, v in stats.items()}, domains

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """llm-calib's held-out monitor of the current model (what :func:`llm_calib.calibrate` records
        at each evaluation): ``<prefix>_accuracy``, ``_ece`` (10 bins), ``_nll``, ``_entropy`` and
        ``_confidence``; logged and passed to the callbacks (a dict of sets: one prefix each).

        Open questions are scored teacher-forced on their reference answers (calibrate's
        ``selection.open_metric="teacher_forced"``), not on generated answers: score the saved
        adapter with ``llm-calib evaluate --adapter`` for the generated answers' calibration."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(dataset, Mapping):
            metrics: dict[str, float] = {}
            for name, one in dataset.items():
                metrics.update(self.evaluate(one, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        stats, _ = self.calibration_stats(dataset)
        conf, correct = stats["confidence"], stats["correct"]
        values = {"accuracy": float(correct.mean()), "ece": float(ece_metric(conf.numpy(), correct.numpy(), n_bins=10)),
                  "nll": float(stats["nll"].mean()), "entropy": float(stats["entropy"].mean()),
                  "confidence": float(conf.mean())}
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in values.items()}
        self.log(dict(metrics))
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ------------------------------------------------------------------ saving

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's save; the final (non-checkpoint) save also writes a model card (``README.md``)
        with the method, the data and the per-domain calibration table measured now on the evaluation set."""
        super().save_model(output_dir, _internal_call)  # type: ignore[misc]
        if _internal_call:
            return
        table = None
        if self.eval_dataset is not None:
            evals = self.eval_dataset if isinstance(self.eval_dataset, Mapping) else {"eval": self.eval_dataset}
            rows = []
            for name, data in evals.items():
                stats, domains = self.calibration_stats(data)
                if len(evals) > 1 or all(d == "eval" for d in domains):
                    domains = [name] * len(domains)
                rows += calibration_table(stats, domains)
            table = rows
        if self.args.should_save:
            model = self.accelerator.unwrap_model(self.model)
            base = getattr(getattr(model, "peft_config", {}).get("default", None), "base_model_name_or_path", None)
            objective = settings_to_dict(self.calm_config.objective)
            write_model_card(output_dir or self.args.output_dir, base_model=base, method={"objective": objective},
                             data=self._data_description(), table=table,
                             training={"steps": self.state.global_step, "learning_rate": self.args.learning_rate,
                                       "batch_size": self.args.per_device_train_batch_size
                                       * self.args.gradient_accumulation_steps * max(1, self.args.world_size),
                                       "upper_batch_size": self.upper_batch_size, "seed": self._seed()})

    def _data_description(self) -> dict[str, str]:
        def describe(data: Any) -> str:
            if data is None:
                return "none"
            if isinstance(data, Sequence) and data and all(hasattr(r, "domain") for r in data[:1000]):
                domains = sorted({r.domain for r in data})
                return f"{len(data)} {type(data[0]).__name__} records ({', '.join(domains[:8])}{', ...' if len(domains) > 8 else ''})"
            name = getattr(getattr(data, "info", None), "dataset_name", None) or type(data).__name__
            return f"{name} ({len(data)} examples)" if hasattr(data, "__len__") else str(name)

        evals = self.eval_dataset if isinstance(self.eval_dataset, Mapping) else {"eval": self.eval_dataset}
        out = {"train (lower level)": describe(self.train_dataset)}
        out.update({f"{k} (evaluation)": describe(v) for k, v in evals.items()})
        out["upper level"] = ("the evaluation set's inputs, labels ignored" if self.upper_labels_ignored
                              else describe(self.upper_dataset))
        return out


class CalmTrainer(CalmTrainerMixin, Trainer):
    """``transformers.Trainer`` taking CALM steps: the Trainer's arguments plus ``calm_config``,
    ``upper_dataset``, ``upper_collator``, ``upper_batch_size`` and ``calm_sampler``
    (:class:`CalmTrainerMixin`).

    Example:
        >>> import tempfile
        >>> from transformers import PrinterCallback, TrainingArguments
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.integrations import MultipleChoiceCollator, attach_adapters
        >>> model, tok = tiny_random_model()
        >>> qs = builtin_multiple_choice(4, domains=["capitals"])
        >>> args = TrainingArguments(tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=2,
        ...                          learning_rate=1e-2, report_to="none", save_strategy="no", disable_tqdm=True)
        >>> trainer = CalmTrainer(model=attach_adapters(model), args=args, train_dataset=qs[:2], eval_dataset=qs[2:],
        ...                       data_collator=MultipleChoiceCollator(tok))
        >>> trainer.remove_callback(PrinterCallback)  # the logs are not printed here
        >>> trainer.train().global_step, sorted(trainer.evaluate())
        (2, ['eval_accuracy', 'eval_confidence', 'eval_ece', 'eval_entropy', 'eval_nll'])
    """
