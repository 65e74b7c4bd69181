"""Train one or several objectives on the same data and compare them per domain with the
uncalibrated and temperature-scaled base model (``llm-calib calibrate``).

Each method attaches fresh LoRA adapters to the one base model, trains with the same data, seed
and budget, is saved to ``<out>/<method>/`` and evaluated, and its adapters are removed again; the
encoded records (and their trunk cache) are shared. :func:`write_comparison_report` writes
``metrics.json``, ``report.md`` and one ``reliability_<domain>.png`` per domain.
"""

from __future__ import annotations

import math
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llm_calib import distributed
from llm_calib.calm.run import ResolvedRun, check_resolved
from llm_calib.confidence.kinds import OpenConfidence
from llm_calib.config.calibration import flat_paths
from llm_calib.data.records import MultipleChoice, OpenQA
from llm_calib.engine.context import ContextOverflow, context_window
from llm_calib.evaluation.evaluate import (
    HEADLINE_METRICS,
    EvaluationResult,
    TemperatureFit,
    evaluate_records,
)
from llm_calib.evaluation.report import (
    REPORT_METRICS,
    context_lines,
    format_metric,
    jsonable,
    mean_of_domains,
    merged_specs_lines,
    metrics_table,
    plot_reliability,
    reliability_filename,
    setting_line,
)
from llm_calib.files.atomic import write_json_atomic, write_text_atomic
from llm_calib.formats import family_format
from llm_calib.models import free_memory
from llm_calib.objectives.base import Objective

__all__ = ["BASELINE_COLUMNS", "Comparison", "DomainComparison", "resume_budget_problem", "run_comparison",
           "stale_checkpoints", "stale_checkpoints_message", "write_comparison_report"]

BASELINE_COLUMNS = ("uncalibrated", "temperature_scaled")
"""The columns that need no training (the base model, and the base model with a temperature)."""

_LABELS = {"uncalibrated": "uncalibrated", "temperature_scaled": "temperature-scaled"}
TEMPERATURE_SUFFIX = "+temperature"
"""A trained method followed by a temperature fitted on its held-out scores: ``<method>+temperature``."""


@dataclass
class DomainComparison:
    """One evaluation domain: its kind, size, and per column (``uncalibrated``, ``temperature_scaled`` or
    a method) its metric dict (None where it does not apply) and reliability bins.
    """

    kind: str
    n: int
    columns: dict[str, dict[str, float] | None] = field(default_factory=dict)
    reliability: dict[str, dict[str, list[float]] | None] = field(default_factory=dict)

    @property
    def description(self) -> str:
        """How the report names the domain's kind of question (its format's description)."""
        return family_format(self.kind).description


@dataclass
class Comparison:
    """The outcome of :func:`run_comparison`: the methods, per-domain columns, the temperature fitted on
    the held-out split, per-method training summaries, the run's settings and, per trained method, the
    temperature fitted on its own held-out scores (its ``<method>+temperature`` column).
    """

    methods: list[str]
    domains: dict[str, DomainComparison]
    temperature: TemperatureFit | None
    training: dict[str, dict[str, Any]]
    config: dict[str, Any]
    method_temperatures: dict[str, TemperatureFit] = field(default_factory=dict)

    @property
    def columns(self) -> list[str]:
        """All column names: the two untrained baselines, then each method, followed by
        ``<method>+temperature`` where a temperature was fitted on it (multiple choice; open questions
        under token or semantic confidence)."""
        return [*BASELINE_COLUMNS, *(c for m in self.methods
                                     for c in (m, *((m + TEMPERATURE_SUFFIX,) if m in self.method_temperatures else ())))]

    def macro_average(self) -> dict[str, dict[str, float]]:
        """Unweighted mean over domains of the headline metrics, per column."""
        out: dict[str, dict[str, float]] = {}
        for col in self.columns:
            rows = [d.columns.get(col) for d in self.domains.values()]
            rows = [r for r in rows if r]
            if rows:
                out[col] = {
                    m: float(np.nanmean(vals)) if any(math.isfinite(v) for v in vals) else math.nan
                    for m in HEADLINE_METRICS
                    for vals in [[float(r.get(m, math.nan)) for r in rows]]
                }
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (``metrics.json``)."""
        from llm_calib.version import __version__

        return {
            "llm_calib_version": __version__,
            "config": self.config,
            "methods": list(self.methods),
            "columns": self.columns,
            "temperature": self.temperature.to_dict() if self.temperature else None,
            "method_temperatures": {m: fit.to_dict() for m, fit in self.method_temperatures.items()},
            "training": self.training,
            "domains": {
                dom: {"kind": d.kind, "n": d.n, "columns": d.columns, "reliability": d.reliability}
                for dom, d in self.domains.items()
            },
            "macro_average": self.macro_average(),
        }


def run_comparison(
    model: Any, tokenizer: Any, train: tuple[str, Sequence[MultipleChoice] | Sequence[OpenQA]],
    heldout: tuple[str, Sequence[MultipleChoice] | Sequence[OpenQA]],
    evals: Sequence[tuple[str, Sequence[MultipleChoice | OpenQA]]], run: ResolvedRun,
    methods: Sequence[Objective] | None, out_dir: str | Path, *,
    unlabeled: tuple[str, Sequence[MultipleChoice] | Sequence[OpenQA]] | None = None,
    checkpoints: bool = True, resume: bool = False, progress: bool = True, n_bins: int = 10,
    bootstrap: int = 1000, eval_batch_size: int = 8, log: Callable[[str], None] = lambda message: None,
    base_model: dict[str, Any] | None = None, restart: bool = False, confidence: OpenConfidence | None = None,
    context_overflow: ContextOverflow | None = None,
) -> Comparison:
    """Train each method on the base model, save it, and evaluate every column per domain.

    Args:
        model: the base model (or a zero-argument callable returning it), shared by every method.
        tokenizer: the model's tokenizer.
        train: ``(name, records)`` of the training split (all multiple choice or all open questions).
        heldout: ``(name, records)`` of the held-out split (upper level, model selection and, for
            multiple choice, the temperature fit): of the training kind, or multiple choice when
            the training records are open-ended (prompt, response) pairs
            (:func:`~llm_calib.calm.run.run_formats`).
        evals: ``(name, records)`` evaluation sets; results are per record domain.
        run: the run resolved from its configuration and these sets (:func:`~llm_calib.calm.run.resolve_run`,
            with ``unlabeled`` when given); its ``objective`` is replaced by each of ``methods``.
        methods: the objectives to train (distinct names); None: only the run's objective.
        out_dir: results go to ``out_dir/<method>/``, checkpoints to ``out_dir/checkpoints/<method>/``.
        unlabeled: ``(name, records)`` of unlabelled upper-level inputs; default: the held-out inputs.
        checkpoints: write checkpoints (when the configuration's ``checkpoint_every > 0``).
        resume: reuse finished results whose saved config matches; continue unfinished ones.
        progress: show progress bars.
        n_bins: ECE and reliability-diagram bins.
        bootstrap: bootstrap resamples for 95% intervals (0: none).
        eval_batch_size: questions per forward pass when scoring.
        log: receives one-line status messages.
        base_model: entries replacing those of each saved result's base-model record (e.g. ``model``).
        restart: without ``resume``, delete a method's checkpoints left by an earlier run in
            ``out_dir`` and start over; otherwise such checkpoints are an error.
        confidence: how open-ended answers of the evaluation sets get their confidence in every
            column (:class:`~llm_calib.confidence.kinds.OpenConfidence`: ``token``,
            ``semantic`` with Sem-ECE, ``p_true`` or ``verbalized``); None: ``token``. Open-question
            model selection scores the held-out answers with it too (``selection.open_metric``);
            training does not depend on it; multiple-choice sets ignore it.
        context_overflow: a question (trained on or evaluated) longer than the model's context is
            refused (``"refuse"``, the default) or its prompt cut from the left and counted
            (``"truncate"``; :func:`~llm_calib.engine.context.context_window`); ``config["context"]``
            records which.

    Returns:
        A :class:`Comparison`. Under ``torchrun`` only rank 0 writes.

    Raises:
        ValueError: no method or two of one name, records not all of one kind (naming the record),
            an empty set, (with ``resume``) a saved result trained with a different configuration, or
            (without ``resume`` and ``restart``) checkpoints of an earlier run (:func:`stale_checkpoints`).
        llm_calib.calm.trainer.TrainingDiverged: a method's training diverged.
    """
    _check_sets(train, heldout, evals, check_resolved(run, "run_comparison"), unlabeled)
    if confidence is not None:  # model selection scores the open held-out answers as the report does
        run = run.with_confidence(confidence)
    objectives = [run.objective] if methods is None else list(methods)
    names = [o.name for o in objectives]
    if not objectives or len(set(names)) != len(names):
        raise ValueError(f"methods must be a non-empty list of objectives of distinct names, got {names}")
    # the post-hoc knob, fitted on the held-out split: a temperature of the option scores (multiple choice), of
    # the greedy answers' token probabilities (open, token confidence) or of the sampling (semantic); none for
    # the model's judgement of its answers (p_true, verbalized)
    temperature_fit = heldout if _has_temperature(run.formats.upper) else None
    session = _Session(tokenizer, evals, temperature_fit,
                       _evaluation_settings(run, eval_batch_size, n_bins, bootstrap, progress, confidence), log)
    model = _base_model(model)
    with context_window(model, context_overflow) as window:  # every sequence trained on or scored
        # the training sets first: one longer than the context fails before the baselines are scored
        data = _encode(tokenizer, run, train, heldout, unlabeled)
        t0 = time.perf_counter()
        log(f"evaluating the base model{f' (temperature fitted on {heldout[0]})' if temperature_fit else ''}")
        base = session.evaluate(model)
        domains: dict[str, DomainComparison] = {}
        _collect(base, domains, {"uncalibrated": "uncalibrated", "temperature_scaled": "temperature_scaled"})
        timings = {"baselines_s": time.perf_counter() - t0}
        training: dict[str, dict[str, Any]] = {}
        method_temperatures: dict[str, TemperatureFit] = {}
        options = _TrainOptions(Path(out_dir), checkpoints, resume, progress, base_model or {}, restart, log)
        for objective in objectives:
            model, training[objective.name], fit = _train_and_evaluate(
                model, run.with_objective(objective), data, session, domains, options)
            if fit is not None:
                method_temperatures[objective.name] = fit
    run_config = _run_config(run, objectives, train, heldout, unlabeled, evals, session, n_bins, bootstrap)
    return Comparison(names, domains, base.temperature, training,
                      {**run_config, "context": window.summary(), "timings": timings}, method_temperatures)


def _check_sets(train: tuple[str, Any], heldout: tuple[str, Any], evals: Sequence[tuple[str, Any]], run: ResolvedRun,
                unlabeled: tuple[str, Any] | None) -> None:
    """The sets checked: not empty, the unlabelled ones of the kind the run's upper level reads."""
    from llm_calib.calm.training import check_not_empty

    check_not_empty(train=train[1], heldout=heldout[1], unlabeled=None if unlabeled is None else unlabeled[1])
    for name, records in evals:
        if not records:
            raise ValueError(f"the evaluation set {name!r} (eval) is empty: the report scores it; pass at least one question")
    if unlabeled is not None:
        run.formats.upper.check(unlabeled[1], what=unlabeled[0])


def _has_temperature(fmt: Any) -> bool:
    """Whether the held-out format takes a post-hoc temperature (see :mod:`llm_calib.confidence.temperature`)."""
    if fmt.family == "open":
        confidence = getattr(fmt, "confidence", None)
        return confidence is None or confidence.kind in ("token", "semantic")
    return bool(fmt.temperature_scalable)


def _evaluation_settings(run: ResolvedRun, batch_size: int, n_bins: int, bootstrap: int,
                         progress: bool, confidence: OpenConfidence | None) -> dict[str, Any]:
    """The keyword arguments of :func:`~llm_calib.evaluation.evaluate.evaluate_records` for every column."""
    settings = run.settings
    return {"scorer": settings.scorer, "normalize": settings.normalize, "prompt": settings.prompt,
            "open_prompt": settings.open_prompt, "batch_size": batch_size,
            "n_bins": n_bins, "ci": bootstrap > 0, "n_resamples": max(bootstrap, 1), "seed": run.config.seed,
            "progress": progress, "confidence": confidence}


def _base_model(model: Any) -> Any:
    """``model``, or the model a zero-argument callable returns."""
    import torch

    return model() if callable(model) and not isinstance(model, torch.nn.Module) else model


@dataclass
class _Session:
    """What every column's evaluation shares: the tokenizer, the sets, the temperature fit, the settings."""

    tokenizer: Any
    evals: Sequence[tuple[str, Sequence[MultipleChoice | OpenQA]]]
    temperature_fit: tuple[str, Any] | None
    eval_kwargs: dict[str, Any]
    log: Callable[[str], None]

    def evaluate(self, model: Any) -> EvaluationResult:
        """Every evaluation set scored by ``model`` (with a temperature fitted on the held-out split)."""
        return evaluate_records(model, self.tokenizer, self.evals, temperature_fit=self.temperature_fit,
                                **self.eval_kwargs)


def stale_checkpoints(out_dir: str | Path, methods: Sequence[str]) -> list[Path]:
    """The checkpoint folders of ``methods`` that an earlier run left in ``out_dir``
    (``out_dir/checkpoints/<method>/``, not empty): a new run without ``resume`` would delete them.

    Example:
        >>> import pathlib, tempfile
        >>> out = pathlib.Path(tempfile.mkdtemp())
        >>> (out / "checkpoints" / "calm" / "ckpt-000010").mkdir(parents=True)
        >>> [p.name for p in stale_checkpoints(out, ["calm", "lora_ce"])]
        ['calm']
    """
    folders = [Path(out_dir) / "checkpoints" / m for m in methods]
    return [f for f in folders if f.is_dir() and any(f.iterdir())]


def resume_budget_problem(out_dir: str | Path, methods: Sequence[str], steps: int | None) -> str | None:
    """Why ``--resume`` with a budget of ``steps`` cannot continue a method of ``out_dir``: its
    newest intact checkpoint has trained more steps (found before any model is loaded; None when
    every unfinished method can resume, or ``steps`` is None: a budget in epochs, resolved later).

    Example:
        >>> import tempfile
        >>> resume_budget_problem(tempfile.mkdtemp(), ["calm"], 10) is None
        True
    """
    from llm_calib.calm.trainer import CalibrationResult
    from llm_calib.calm.training import budget_refusal
    from llm_calib.files.checkpoint import latest_checkpoint

    if steps is None:
        return None
    for method in methods:
        result = Path(out_dir) / method
        if (result / "metrics.json").is_file() and CalibrationResult.problem(result) is None:
            continue  # finished: reused, not resumed
        with warnings.catch_warnings():  # a damaged checkpoint is named when the run resumes
            warnings.simplefilter("ignore")
            ckpt = latest_checkpoint(Path(out_dir) / "checkpoints" / method)
        if ckpt is not None and int(ckpt.name[5:]) > steps:
            return budget_refusal(ckpt, int(ckpt.name[5:]), steps)
    return None


def stale_checkpoints_message(out_dir: str | Path, methods: Sequence[str]) -> str:
    """The one-line refusal to delete the checkpoints of an earlier run (:func:`stale_checkpoints`).

    Example:
        >>> stale_checkpoints_message("runs/x", ["calm"])
        '--out runs/x holds checkpoints of an earlier run (calm); continue it with --resume, or pass --restart to delete them and start over'
    """
    return (f"--out {out_dir} holds checkpoints of an earlier run ({', '.join(str(m) for m in methods)}); "
            "continue it with --resume, or pass --restart to delete them and start over")


@dataclass
class _TrainOptions:
    """Where and how each method trains: output directory, checkpoints, resume, progress, base-model record."""

    out: Path
    checkpoints: bool
    resume: bool
    progress: bool
    base_model: dict[str, Any]
    restart: bool = False
    log: Callable[[str], None] | None = None
    warned: set[str] = field(default_factory=set)


def _collect(result: EvaluationResult, domains: dict[str, DomainComparison], columns: dict[str, str]) -> None:
    """Add ``result``'s metrics and reliability bins as the ``columns`` (column -> ``uncalibrated`` or
    ``temperature_scaled``) of each domain."""
    for dom, r in result.domains.items():
        d = domains.setdefault(dom, DomainComparison(r.kind, r.n))
        for col, source in columns.items():
            scaled = source == "temperature_scaled"
            d.columns[col] = r.temperature_scaled if scaled else r.uncalibrated
            d.reliability[col] = r.reliability_scaled if scaled else r.reliability


def _encode(tokenizer: Any, run: ResolvedRun, train: tuple[str, Any], heldout: tuple[str, Any],
            unlabeled: tuple[str, Any] | None) -> tuple[Any, Any, Any]:
    """The three sets encoded once: every method (and its trunk cache) reads the same token ids of the same records."""
    from llm_calib.calm.encoding import encode_records

    fmt, upper = run.formats
    return (encode_records(tokenizer, train[1], fmt=fmt), encode_records(tokenizer, heldout[1], fmt=upper),
            None if unlabeled is None else encode_records(tokenizer, unlabeled[1], fmt=upper))


def _train_and_evaluate(model: Any, run: ResolvedRun, data: tuple[Any, Any, Any], session: _Session,
                        domains: dict[str, DomainComparison], options: _TrainOptions,
                        ) -> tuple[Any, dict[str, Any], TemperatureFit | None]:
    """Train (or reuse) one method, evaluate it into ``domains``; return the bare base model again, the
    method's training summary and the temperature fitted on its held-out scores."""
    from llm_calib.calm.lora import detach_lora

    method = run.objective.name
    t0 = time.perf_counter()
    result, reused = _trained(model, session.tokenizer, run, data, session.log, options)
    for note in result.notes:
        session.log(f"[{method}] {note}")
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    session.log(f"[{method}] evaluating")
    # the trained model, then the same model with a temperature fitted on its own held-out scores
    # (train-time calibration followed by a post-hoc one, next to the temperature alone)
    res = session.evaluate(result.model)
    _collect(res, domains, {method: "uncalibrated",
                            **({method + TEMPERATURE_SUFFIX: "temperature_scaled"} if res.temperature else {})})
    summary = {
        "dir": method, "reused": reused, "heldout_before": result.metrics.get("before", {}),
        "heldout_after": result.metrics.get("after", {}), "notes": list(result.notes),
        "selection": dict(result.selection),
        "timings": {**result.timings, "train_total_s": train_s, "evaluate_s": time.perf_counter() - t0},
    }
    fit = res.temperature
    base = detach_lora(result.model)  # the bare base again, for the next method
    del result, res
    free_memory()
    return base, summary, fit


def _trained(model: Any, tokenizer: Any, run: ResolvedRun, data: tuple[Any, Any, Any], log: Callable[[str], None],
             options: _TrainOptions) -> tuple[Any, bool]:
    """The method's result: a finished one reused (``resume`` and the same configuration), else trained and saved."""
    from llm_calib.calm.trainer import CalibrationResult, calibrate_run
    from llm_calib.calm.training import selection_metric

    method, cfg = run.objective.name, run.config
    target, ckpt_dir = options.out / method, options.out / "checkpoints" / method
    damaged = CalibrationResult.problem(target) if options.resume and (target / "metrics.json").is_file() else None
    if damaged is not None:  # trained again (from its newest checkpoint), as a damaged checkpoint is skipped
        warnings.warn(f"[{method}] the finished result in {target} is damaged ({damaged}); training it again "
                      "from its newest checkpoint", UserWarning, stacklevel=2)
    if options.resume and damaged is None and (target / "metrics.json").is_file():
        result = CalibrationResult.load(target, model)
        saved, wanted = flat_paths(result.config.to_dict()), flat_paths(cfg.to_dict())
        saved.pop("checkpoint_every"), wanted.pop("checkpoint_every")
        if saved != wanted:
            diff = sorted(k for k in wanted if saved.get(k) != wanted[k])
            raise ValueError(f"{target} was trained with a different configuration (differs in {diff}); "
                             "remove it, start over with --restart, or choose another --out")
        metric = selection_metric(cfg.selection, run.formats.upper)
        if result.selection.get("metric", metric) != metric:
            raise ValueError(f"{target} was selected on the held-out {result.selection['metric']}, this run selects "
                             f"on the {metric}; remove it, start over with --restart, or choose another --out")
        log(f"[{method}] reusing the finished result in {target}")
        return result, True
    writer = distributed.rank() == 0
    if writer and not options.resume and ckpt_dir.exists():
        if any(ckpt_dir.iterdir()) and not options.restart:
            raise ValueError(stale_checkpoints_message(options.out, [method]))
        shutil.rmtree(ckpt_dir)  # stale checkpoints of an earlier run must not be resumed
    use_ckpt = options.checkpoints and cfg.checkpoint_every > 0
    log(f"[{method}] training {cfg.training.steps} steps")
    train_enc, heldout_enc, unlabeled_enc = data
    notes: list[str] = []
    # Each method's training warns anew about the same held-out set (a change of warning filters, as
    # peft's silencing makes, resets Python's once-per-place memory), and its selection note is
    # also logged as a status line: each warning is shown once per comparison.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = calibrate_run(model, tokenizer, train_enc, heldout_enc, run, unlabeled=unlabeled_enc,
                               checkpoint_dir=ckpt_dir if use_ckpt else None, resume=options.resume,
                               progress=options.progress,
                               log=lambda message: (options.log or (lambda _: None))(f"[{method}] {message}"))
            notes = result.notes
        finally:
            shown = [w for w in caught if str(w.message) not in notes and str(w.message) not in options.warned]
    for w in shown:
        options.warned.add(str(w.message))
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    result.base.update(options.base_model)
    if writer:
        result.save(target)
    return result, False


def _run_config(run: ResolvedRun, objectives: Sequence[Objective], train: tuple[str, Any], heldout: tuple[str, Any],
                unlabeled: tuple[str, Any] | None, evals: Sequence[tuple[str, Any]], session: _Session, n_bins: int,
                bootstrap: int) -> dict[str, Any]:
    """The run's settings as ``metrics.json`` records them (``config``)."""
    return {
        "train": {"spec": train[0], "n": len(train[1]), "kind": run.formats.lower.family},
        "heldout": {"spec": heldout[0], "n": len(heldout[1]), "kind": run.formats.upper.family},
        **({} if unlabeled is None else {"unlabeled": {"spec": unlabeled[0], "n": len(unlabeled[1])}}),
        "eval": [name for name, _ in evals],
        "calibration": {**{k: v for k, v in run.config.to_dict().items() if k != "objective"},
                        "objectives": {o.name: o.to_dict() for o in objectives}},
        "evaluation": {"scorer": run.settings.scorer, "normalize": run.settings.normalize,
                       "prompt_style": session.eval_kwargs["prompt"].style, "n_bins": n_bins, "bootstrap": bootstrap,
                       **_confidence_setting(session.eval_kwargs["confidence"], evals)},
    }


def _confidence_setting(confidence: OpenConfidence | None, evals: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """``{"confidence": settings}`` when open questions were scored with a chosen confidence kind, else empty."""
    if confidence is None or not any(isinstance(r, OpenQA) for _, recs in evals for r in recs):
        return {}
    return {"confidence": confidence.to_dict()}


def _label(column: str) -> str:
    if column.endswith(TEMPERATURE_SUFFIX):
        return column.removesuffix(TEMPERATURE_SUFFIX) + " + temperature"
    return _LABELS.get(column, column)


def _summary_table(cmp: Comparison, metric: str) -> list[str]:
    cols = cmp.columns
    lines = ["| domain | n | " + " | ".join(_label(c) for c in cols) + " |", "|---|---|" + "---|" * len(cols)]
    for dom, d in cmp.domains.items():
        cells = " | ".join(format_metric(d.columns.get(c), metric) for c in cols)
        lines.append(f"| {dom} | {d.n} | {cells} |")
    avg = cmp.macro_average()
    if len(cmp.domains) > 1:
        cells = " | ".join(format_metric(avg.get(c), metric) for c in cols)
        lines.append(f"| macro average | | {cells} |")
    return lines


def _fitted(fit: TemperatureFit) -> str:
    """How a temperature was found: fitted by likelihood, or (semantic confidence) chosen by held-out Sem-ECE."""
    return {"sem_ece": "the sampling temperature chosen by Sem-ECE (among those keeping 95% of the accuracy)",
            "correctness_nll": "fitted to token confidence (NLL of correctness)"}.get(fit.criterion, "fitted")


def _describe(objective: dict[str, Any]) -> str:
    """``calm (solver: bome)``: an objective's name and the names of its tagged parts."""
    parts = [f"{k}: {v['name']}" for k, v in objective.items() if isinstance(v, dict) and "name" in v]
    return objective.get("name", "?") + (f" ({', '.join(parts)})" if parts else "")


def _prompt_kind(cfg: dict[str, Any]) -> str:
    """How the report's scorer line names the prompt a run used: a template of its own, else its
    preset (``lm_eval_arc prompt``), else its style (``cloze prompt``, ``listed prompt``); a preset's
    or a given template sets the question text whatever the style says."""
    settings = cfg.get("calibration", {}).get("prompt", {})
    if settings.get("template"):
        return "own-template prompt"
    if settings.get("preset") not in (None, "default"):
        return f"{settings['preset']} prompt"
    return f"{cfg['evaluation']['prompt_style']} prompt"


def _selection_lines(cmp: Comparison) -> list[str]:
    """What model selection measured on the held-out split, once per distinct setting (a results folder
    written before it was recorded: nothing)."""
    seen: list[dict[str, Any]] = []
    for t in cmp.training.values():
        sel = t.get("selection") or {}
        if sel and sel not in seen:
            seen.append(sel)
    lines = []
    for sel in seen:
        generated = ""
        if "answers" in sel:
            each = f", {sel['samples_per_question']} samples per question" if sel.get("samples_per_question") else ""
            generated = f"; at most {sel['answers']} answers generated{each}"
        lines.append(f"Model selection and the accuracy guard read the held-out {sel['metric']}: at most "
                     f"{sel['evaluations']} evaluations of {sel['questions']} questions{generated}.")
    return ["", *lines] if lines else []


def comparison_markdown(cmp: Comparison, *, title: str = "Calibration: methods compared") -> str:
    """The ``report.md`` text: settings, training summary, summary tables, one table per domain."""
    cfg = cmp.config
    cal = cfg.get("calibration", {})
    lines = [f"# {title}", ""]
    if cfg.get("model"):
        computed = ", ".join(str(cfg[k]) for k in ("dtype", "quantization", "device") if cfg.get(k))
        lines.append(f"- model: `{cfg['model']}`" + (f" ({computed})" if computed else ""))
    lines += [
        f"- train: `{cfg['train']['spec']}` ({cfg['train']['n']} questions); held-out: "
        f"`{cfg['heldout']['spec']}` ({cfg['heldout']['n']} questions)",
        f"- evaluated: {', '.join(f'`{s}`' for s in cfg['eval'])}",
        *merged_specs_lines(cfg.get("merged_specs") or []),
        *context_lines(cfg.get("context")),
        f"- methods: {', '.join(_describe(cal.get('objectives', {}).get(m, {'name': m})) for m in cmp.methods)}; "
        f"same data order, seed ({cal.get('seed')}) and budget "
        f"({cal.get('training', {}).get('steps')} steps of {cal.get('training', {}).get('batch_size')} questions) for each",
        f"- scorer: `{cfg['evaluation']['scorer']}` ({cfg['evaluation']['normalize']}, {_prompt_kind(cfg)})",
    ]
    if cfg.get("prompt"):  # as resolved (the command line adds it), as evaluate's report shows it
        lines.append(setting_line("prompt", cfg["prompt"]))
    train_kind = cfg["train"].get("kind", "multiple_choice")
    heldout_kind = cfg["heldout"].get("kind", train_kind)
    if heldout_kind == train_kind:
        lines += family_format(train_kind).training_notes
    else:
        lines.append(f"- lower level trained on {'open-ended (prompt, response)' if train_kind == 'open' else train_kind} records (token "
                     f"cross-entropy of each reference response, e.g. instruction data); the held-out and "
                     f"unlabelled sets (selection, accuracy guard, upper level) are {family_format(heldout_kind).description}")
    fit = cmp.temperature
    if fit is not None:
        lines.append(
            f"- temperature scaling: T = {fit.temperature:.3f}, {_fitted(fit)} on `{fit.source}` "
            f"({fit.n} questions; {fit.describe()}), carried to every domain of its kind"
        )
    for m, mfit in cmp.method_temperatures.items():
        lines.append(f"- {m} + temperature: the trained model, then T = {mfit.temperature:.3f} {_fitted(mfit)} on its own "
                     f"answers to `{mfit.source}` ({mfit.describe()}); compare it with temperature scaling alone to "
                     "see what training adds")
    lines += ["", "## Training (held-out split)", ""]
    lines += [
        "| method | accuracy before | accuracy after | ECE before | ECE after | selected step | stopped early | time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, t in cmp.training.items():
        b, a = t.get("heldout_before", {}), t.get("heldout_after", {})
        stopped = "yes" if a.get("stopped_early") else "no"
        step = a.get("selected_step")
        if step is not None and int(step) == 0 and t.get("notes"):
            step = "0 (initial model kept)"
        lines.append(
            f"| {m} | {format_metric(b, 'accuracy')} | {format_metric(a, 'accuracy')} | "
            f"{format_metric(b, 'ece')} | {format_metric(a, 'ece')} | "
            f"{'n/a' if step is None else step if isinstance(step, str) else int(step)} | {stopped} | "
            f"{t.get('timings', {}).get('train_total_s', math.nan):.1f} |"
        )
    lines += _selection_lines(cmp)
    notes = [(m, note) for m, t in cmp.training.items() for note in t.get("notes", [])]
    if notes:
        lines.append("")
        lines += [f"**{m}: the initial model was kept.** {note}" if "initial model was kept" in note
                  else f"**{m}:** {note}" for m, note in notes]
    lines += ["", "## ECE per domain", "", *_summary_table(cmp, "ece"), ""]
    lines += ["## Accuracy per domain", "", *_summary_table(cmp, "accuracy"), ""]
    if cmp.config["evaluation"].get("bootstrap"):
        lines += ["Values are point estimates with 95% bootstrap confidence intervals.", ""]
    # every metric evaluate's report shows (report.REPORT_METRICS), per domain and overall
    for dom, d in cmp.domains.items():
        lines += [f"## {dom}", "", f"{d.n} questions, {d.description}.",
                  *family_format(d.kind).domain_notes(d.columns.get("uncalibrated") or {}), ""]
        lines.append(metrics_table([(_label(c), d.columns.get(c)) for c in cmp.columns], metrics=REPORT_METRICS))
        lines += ["", f"![reliability diagrams]({reliability_filename(dom)})", ""]
    if len(cmp.domains) > 1:
        n = sum(d.n for d in cmp.domains.values())
        lines += ["## overall (mean of domains)", "", f"{n} questions in {len(cmp.domains)} domains, each weighted equally.", ""]
        overall = [(_label(c), mean_of_domains([d.columns.get(c) for d in cmp.domains.values()])) for c in cmp.columns]
        lines += [metrics_table(overall, metrics=REPORT_METRICS), ""]
    return "\n".join(lines)


def write_comparison_report(cmp: Comparison, out_dir: str | Path) -> dict[str, Path]:
    """Write ``metrics.json``, ``report.md`` and ``reliability_<domain>.png`` into ``out_dir``; return the paths.

    Example:
        See :doc:`/tutorials/calibrate_llm`: ``llm-calib calibrate`` calls :func:`run_comparison` and then this.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    paths["metrics"] = out / "metrics.json"
    write_json_atomic(paths["metrics"], jsonable(cmp.to_dict()), allow_nan=False)
    paths["report"] = out / "report.md"
    write_text_atomic(paths["report"], comparison_markdown(cmp) + "\n")
    for dom, d in cmp.domains.items():
        panels = []
        for col in cmp.columns:
            bins = d.reliability.get(col)
            if bins is None:
                continue
            label = _label(col)
            fit = cmp.temperature if col == "temperature_scaled" else cmp.method_temperatures.get(
                col.removesuffix(TEMPERATURE_SUFFIX)) if col.endswith(TEMPERATURE_SUFFIX) else None
            if fit is not None:
                label += f" (T = {fit.temperature:.2f})"
            values = d.columns.get(col) or {}
            acc, ece = values.get("accuracy", math.nan), values.get("ece", math.nan)
            panels.append((f"{label}\nacc {acc:.3f}, ECE {ece:.3f}", bins))
        paths[f"reliability:{dom}"] = plot_reliability(
            panels, out / reliability_filename(dom), title=f"{dom} (n = {d.n})"
        )
    return paths
