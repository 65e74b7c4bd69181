"""``calibrate``: CALM (BOME or F2SA from :mod:`hypergrad`) and the one-level baselines, end to end.

One code path trains every method on the same data order, budget and seed; model selection keeps
the lowest held-out ECE above the accuracy guard (see :doc:`/methods/calm`). :func:`calibrate`
is a short sequence of the stages in :mod:`llm_calib.calm.training`.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor
from tqdm.auto import tqdm

from llm_calib import distributed
from llm_calib.calm import training
from llm_calib.calm.lora import peft_deprecations_silenced
from llm_calib.calm.run import ResolvedRun, check_resolved, resolve_run
from llm_calib.calm.training import Records, TrainingDiverged
from llm_calib.config.calibration import CalibrationConfig
from llm_calib.engine.context import context_window
from llm_calib.prompts.templates import prompt_dict

__all__ = ["BASE_MODEL_FILE", "CalibrationResult", "TrainingDiverged", "base_model_record", "calibrate", "calibrate_run"]

BASE_MODEL_FILE = "base_model.json"
"""The file of a saved :class:`CalibrationResult` recording its base model (:func:`base_model_record`)."""


@dataclass
class CalibrationResult:
    """The outcome of :func:`calibrate`.

    Attributes:
        model: the calibrated peft model (selected adapter weights loaded), deployed as is.
        lam: the logit adjustment λ of the selected step (not needed at inference; CALM only).
        history: per step, the record of :func:`~llm_calib.calm.training.train_step` and, at
            evaluations, the held-out metrics.
        metrics: held-out metrics before and after training (``"before"``, ``"after"``).
        config: the run's configuration.
        timings: wall-clock seconds per phase.
        base: :func:`base_model_record` (empty for results saved before it was recorded).
        notes: one line each: why selection kept the initial model, and what to try.
        selection: how model selection measured the held-out split
            (:func:`~llm_calib.calm.training.selection_budget`: the metric, evaluations, answers generated).
    """

    model: Any
    lam: dict[str, Tensor]
    history: list[dict[str, float]]
    metrics: dict[str, dict[str, float]]
    config: CalibrationConfig
    timings: dict[str, float] = field(default_factory=dict)
    base: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    selection: dict[str, Any] = field(default_factory=dict)

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``adapter/``, ``lambda.safetensors``, ``config.json``, ``history.json``,
        ``metrics.json`` and (when known) :data:`BASE_MODEL_FILE` into ``directory``.

        Every file is written atomically (the adapter to a temporary folder renamed into place), so
        a failed save (a full disk) leaves no truncated file that a later ``--resume`` would trust;
        ``metrics.json``, which marks the result finished, is written last."""
        import shutil
        import tempfile

        from safetensors.torch import save_file

        from llm_calib.files.atomic import atomic_path, ordinary_modes, write_json_atomic

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").unlink(missing_ok=True)  # an older result's: the folder is not finished until the end
        staging = Path(tempfile.mkdtemp(dir=out, prefix=".adapter.", suffix=".tmp"))
        try:
            self.model.save_pretrained(str(staging))
            ordinary_modes(staging)  # mkdtemp makes 0700, safetensors writes the adapter weights 0600
            if (out / "adapter").exists():
                shutil.rmtree(out / "adapter")
            os.replace(staging, out / "adapter")
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        with atomic_path(out / "lambda.safetensors") as tmp:
            save_file({k: v.detach().contiguous().cpu() for k, v in self.lam.items()}, str(tmp))
        write_json_atomic(out / "config.json", self.config.to_dict())
        write_json_atomic(out / "history.json", self.history)
        if self.base:
            write_json_atomic(out / BASE_MODEL_FILE, self.base)
        from llm_calib.version import __version__

        saved = {"metrics": self.metrics, "timings": self.timings, "notes": list(self.notes), "selection": self.selection,
                 "llm_calib_version": __version__}
        write_json_atomic(out / "metrics.json", saved)
        return out

    @staticmethod
    def problem(directory: str | os.PathLike[str]) -> str | None:
        """What is wrong with the saved result in ``directory`` (a file missing, cut short or not
        valid JSON: a copy cut short, a disk error), or None when it loads. Reads the records and
        the safetensors headers, not the tensors.

        Example:
            >>> import tempfile
            >>> CalibrationResult.problem(tempfile.mkdtemp())
            'adapter/adapter_model.safetensors: missing'
        """
        from llm_calib.files.atomic import read_json
        from llm_calib.files.checkpoint import safetensors_problem

        src = Path(directory)
        for name in ("adapter/adapter_model.safetensors", "lambda.safetensors"):
            if name == "lambda.safetensors" and not (src / name).exists():
                continue  # a method without λ
            found = safetensors_problem(src / name)
            if found is not None:
                return f"{name}: {found}"
        for name in ("adapter/adapter_config.json", "config.json", "history.json", "metrics.json"):
            try:
                read_json(src / name)
            except FileNotFoundError:
                return f"{name}: missing"
            except (OSError, ValueError) as err:
                return f"{name}: {err}"
        return None

    @classmethod
    def load(cls, directory: str | os.PathLike[str], base_model: Any) -> CalibrationResult:
        """Load a saved result onto ``base_model`` (the same base the adapter was trained on)."""
        from peft import PeftModel
        from safetensors.torch import load_file

        from llm_calib.files.atomic import read_json

        src = Path(directory)
        if not (src / "adapter").is_dir():
            raise FileNotFoundError(f"{src}: no adapter/ directory (not a saved CalibrationResult)")
        with peft_deprecations_silenced():
            model = PeftModel.from_pretrained(base_model, str(src / "adapter"))
        model.eval()
        lam = load_file(str(src / "lambda.safetensors")) if (src / "lambda.safetensors").exists() else {}
        config = CalibrationConfig.from_dict(read_json(src / "config.json"))
        history = read_json(src / "history.json")
        saved = read_json(src / "metrics.json")
        base = read_json(src / BASE_MODEL_FILE) if (src / BASE_MODEL_FILE).is_file() else {}
        return cls(model, lam, history, saved["metrics"], config, saved.get("timings", {}), base,
                   saved.get("notes", []), saved.get("selection", {}))


def base_model_record(model: Any, run: ResolvedRun) -> dict[str, Any]:
    """What a result records of its base model and prompt (:data:`BASE_MODEL_FILE`) under a resolved
    run (:func:`~llm_calib.calm.run.resolve_run`).

    Returns:
        JSON-ready ``model`` (``config._name_or_path`` or None), ``dtype`` (the compute dtype),
        ``quantization`` (``"4-bit NF4"``, ... or None; :func:`~llm_calib.engine.options.loaded_precision`),
        ``fingerprint`` (:func:`~llm_calib.models.model_fingerprint` of its files, which lets a copy
        or a moved folder of the base be recognised; None without local files), ``prompt``
        (:func:`~llm_calib.prompts.templates.prompt_dict`), ``scorer`` and ``normalize``.

    Example:
        >>> from llm_calib.calm.run import resolve_run
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.models import tiny_random_model
        >>> qs = builtin_multiple_choice(n_per_domain=1, domains=["capitals"])
        >>> rec = base_model_record(tiny_random_model()[0], resolve_run(CalibrationConfig(), qs, qs))
        >>> rec["model"], rec["dtype"], rec["quantization"], rec["prompt"]["style"], rec["normalize"]
        (None, 'float32', None, 'cloze', 'sum')
    """
    from llm_calib.engine.options import loaded_precision
    from llm_calib.models import model_fingerprint

    settings = check_resolved(run, "base_model_record").settings
    name = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    precision = loaded_precision(model) if hasattr(model, "parameters") else {}
    return {"model": name, "dtype": precision.get("dtype"), "quantization": precision.get("quantization"),
            "fingerprint": model_fingerprint(str(name)) if name else None, "prompt": prompt_dict(settings.prompt),
            "scorer": settings.scorer, "normalize": settings.normalize}


def calibrate(model: Any, tokenizer: Any, train: Records, heldout: Records,
              config: CalibrationConfig | None = None, *, unlabeled: Records | None = None, checkpoint_dir: str | os.PathLike[str] | None = None,
              resume: bool = False, progress: bool = True,
              log: Callable[[str], None] | None = None, confidence: Any = None) -> CalibrationResult:
    """Fine-tune ``model`` (LoRA) so that its confidence is calibrated; return the result.

    Args:
        model: a Hugging Face causal LM without adapters (LoRA is attached; its weights stay frozen).
        tokenizer: its tokenizer.
        train: labelled questions (all multiple-choice, or all open), or their
            :class:`~llm_calib.calm.encoding.EncodedRecords` (reused with its trunk cache).
        heldout: held-out questions of the same kind: model selection and the accuracy guard;
            also the upper-level inputs unless ``unlabeled`` is given.
        config: the run's configuration (default :class:`CalibrationConfig()`), resolved here once
            (:func:`~llm_calib.calm.run.resolve_run`); not changed. A run already resolved trains with
            :func:`calibrate_run`.
        unlabeled: upper-level inputs of the same kind (labels ignored). Default: held-out inputs.
        checkpoint_dir: where to write checkpoints every ``config.checkpoint_every`` steps.
        resume: continue from the newest checkpoint in ``checkpoint_dir`` (same configuration but
            for ``training.steps`` and ``checkpoint_every``, same records).
        progress: show a tqdm progress bar.
        log: where to say which checkpoint a resumed run continues from (default: nowhere).
        confidence: open questions: how model selection scores the held-out answers
            (:class:`~llm_calib.confidence.kinds.OpenConfidence`, the kind the report uses; None: token):
            greedy-answer ECE under ``token``, Sem-ECE of sampled answers under ``semantic``
            (``config.selection.sample_budget`` bounds the samples). See ``selection.open_metric``;
            :func:`calibrate_run` reads it from the resolved run (:meth:`~llm_calib.calm.run.ResolvedRun.with_confidence`).

    Warns:
        UserWarning: model selection kept the initial model (why, and what to try).

    Raises:
        TrainingDiverged: a loss or update is NaN/inf (names the step and the batch).
        ValueError: a question longer than the model's context (unless a caller's
            :func:`~llm_calib.engine.context.context_window` truncates), an empty set, records of mixed kinds or another type (naming it), or
            ``resume`` from a checkpoint of another configuration or data (names the fields).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.config.calibration import SelectionSettings, TrainingSettings
        >>> model, tok = tiny_random_model()
        >>> qs = builtin_multiple_choice(n_per_domain=4, domains=["capitals"])
        >>> cfg = CalibrationConfig(training=TrainingSettings(steps=2, batch_size=2, heldout_batch_size=2),
        ...                         selection=SelectionSettings(eval_every=1))
        >>> sorted(calibrate(model, tok, qs[:2], qs[2:], cfg, progress=False).metrics)
        ['after', 'before']
    """
    result = _calibrate(model, tokenizer, train, heldout,
                        lambda: resolve_run(config, train, heldout, unlabeled, confidence=confidence),
                        unlabeled, checkpoint_dir, resume, progress, log)
    _warn(result.notes)
    return result


def calibrate_run(model: Any, tokenizer: Any, train: Records, heldout: Records, run: ResolvedRun, *,
                  unlabeled: Records | None = None, checkpoint_dir: str | os.PathLike[str] | None = None,
                  resume: bool = False, progress: bool = True,
                  log: Callable[[str], None] | None = None) -> CalibrationResult:
    """:func:`calibrate` for a run already resolved (:func:`~llm_calib.calm.run.resolve_run`) from its
    configuration and these sets, as :func:`~llm_calib.evaluation.compare.run_comparison` trains each method.

    Example:
        >>> from llm_calib.calm.run import resolve_run
        >>> from llm_calib.config.calibration import TrainingSettings
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> qs = builtin_multiple_choice(n_per_domain=4, domains=["capitals"])
        >>> run = resolve_run(CalibrationConfig(training=TrainingSettings(steps=1, batch_size=2)), qs[:2], qs[2:])
        >>> calibrate_run(model, tok, qs[:2], qs[2:], run, progress=False).config.training.steps
        1
    """
    check_resolved(run, "calibrate_run")
    result = _calibrate(model, tokenizer, train, heldout, lambda: run, unlabeled, checkpoint_dir, resume, progress, log)
    _warn(result.notes)
    return result


def _calibrate(model: Any, tokenizer: Any, train: Records, heldout: Records, resolve: Callable[[], ResolvedRun],
               unlabeled: Records | None, checkpoint_dir: str | os.PathLike[str] | None, resume: bool, progress: bool,
               log: Callable[[str], None] | None) -> CalibrationResult:
    """The body of :func:`calibrate` and :func:`calibrate_run`; ``resolve`` gives the run (timed as set-up)."""
    # under torchrun: join the process group, gloo for a model on the CPU and nccl for one on a GPU
    distributed.init_from_env(next((p.device for p in model.parameters()), None))
    with context_window(model):  # every sequence within the model's positions (a caller's window: its mode)
        return _calibrate_in_window(model, tokenizer, train, heldout, resolve, unlabeled, checkpoint_dir, resume,
                                    progress, log)


def _calibrate_in_window(model: Any, tokenizer: Any, train: Records, heldout: Records,
                         resolve: Callable[[], ResolvedRun], unlabeled: Records | None,
                         checkpoint_dir: str | os.PathLike[str] | None, resume: bool, progress: bool,
                         log: Callable[[str], None] | None) -> CalibrationResult:
    """:func:`_calibrate` inside its context window."""
    timings: dict[str, float] = {}
    with _timed(timings, "setup"):  # checks the records first: a bad mix fails before the model is touched
        training.check_not_empty(train=train, heldout=heldout, unlabeled=unlabeled)
        run = resolve()
        base = base_model_record(model, run)  # before LoRA is attached
        trainer = training.build_trainer(model, tokenizer, train, heldout, run, unlabeled=unlabeled)
    config = run.config  # training.epochs resolved to steps
    with _timed(timings, "evaluate_before"):
        state = training.init_state(trainer)
    run_data = training.data_fingerprint(train, heldout, unlabeled) if checkpoint_dir is not None else None
    if resume and checkpoint_dir is not None:
        loaded = training.resume_state(checkpoint_dir, trainer, state, run_data)
        if loaded is not None and log is not None and distributed.rank() == 0:
            log(f"resuming from step {state.step} (checkpoint {loaded})")
    with _timed(timings, "train"):
        _train(trainer, state, checkpoint_dir, run_data, progress)
    with _timed(timings, "evaluate_after"):
        after = training.evaluate(trainer, state.best_theta)
    distributed.reshard_all(trainer.model)  # units the implicit solver kept gathered are sharded again
    after["selected_step"] = int(state.best["step"])  # integers as integers in metrics.json
    after["stopped_early"] = int(state.stopped_early)
    selection = training.selection_budget(config.selection, config.training.steps, trainer.heldout_format,
                                          len(trainer.heldout.records))
    note = training.selection_note(state.history, state.before, after["selected_step"], config.selection,
                                   selection["metric"])
    return CalibrationResult(trainer.model, state.best_lam, state.history, {"before": state.before, "after": after},
                             config, timings, base, [] if note is None else [note], selection)


def _warn(notes: list[str]) -> None:
    """Each note as a UserWarning at the caller of :func:`calibrate` / :func:`calibrate_run`, on the first rank."""
    if distributed.rank() == 0:
        for note in notes:
            warnings.warn(note, UserWarning, stacklevel=3)


def _train(trainer: training.Trainer, state: training.TrainState, checkpoint_dir: str | os.PathLike[str] | None,
           run_data: dict[str, Any] | None, progress: bool) -> None:
    """The loop: step, evaluate and select when due, checkpoint when due, until done."""
    config = trainer.config
    bar = tqdm(total=config.training.steps, initial=state.step, desc=f"calibrate[{config.objective.name}] train", dynamic_ncols=True,
               disable=not progress or distributed.rank() != 0)
    while not training.done(trainer, state):
        # the step reads nothing back: its record is read (and checked) with the others when the loop logs
        record = training.train_step(trainer, state, read=False)
        state.history.append(record)
        if training.log_due(trainer, state.step):
            training.read_back(state)  # raises TrainingDiverged naming the first non-finite step
        if training.evaluation_due(trainer, state.step):
            record.update(training.select(trainer, state, training.evaluate(trainer, state.theta)))
            shown = {k: record[k] for k in ("loss", "q") if k in record}
            bar.set_postfix(**{k: f"{v:.3g}" for k, v in shown.items()}, ece=f"{record['heldout_ece']:.3f}",
                            acc=f"{record['heldout_accuracy']:.3f}", H=f"{record['heldout_entropy']:.3f}")
        due = config.checkpoint_every and (state.step % config.checkpoint_every == 0 or state.stopped_early)
        if checkpoint_dir is not None and due and distributed.rank() == 0:
            training.save_state(checkpoint_dir, trainer, state, run_data)  # reads the unread steps first
        bar.update(1)
    training.read_back(state)
    bar.close()


@contextlib.contextmanager
def _timed(timings: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - t0

