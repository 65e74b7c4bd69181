"""The evaluation pipeline: load data, score it, compute calibration metrics per domain.

Optionally a temperature fitted on one split is carried to every domain (how post-hoc temperature
scaling transfers out of domain).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from llm_calib.confidence.kinds import OpenConfidence
from llm_calib.confidence.token import OpenEndedSet
from llm_calib.config.choices import Normalize
from llm_calib.data import load as load_data
from llm_calib.data.records import MultipleChoice, OpenQA
from llm_calib.engine.context import ContextOverflow, context_window
from llm_calib.formats import (
    RecordKindError,
    ScoredResult,
    TaskFormat,
    format_for,
    multiple_choice_format,
    scorer_class,
)
from llm_calib.metrics import calibration as metrics
from llm_calib.metrics.temperature import fit_temperature, temperature_nll
from llm_calib.prompts.resolution import resolve_fewshot
from llm_calib.prompts.templates import PromptFormat, prompt_dict
from llm_calib.scoring import ScoredSet
from llm_calib.scoring.base import scoring_split

__all__ = [
    "DomainResult", "EvaluationResult", "TemperatureFit", "domain_result", "evaluate", "evaluate_records",
    "sample_rows", "write_samples",
]

HEADLINE_METRICS = ("accuracy", "ece", "adaptive_ece", "brier", "nll", "auroc")
"""The metrics the report tables show (with bootstrap intervals)."""


@dataclass
class TemperatureFit:
    """A temperature fitted on one split: ``T``, the split's spec, size and domains, the criterion before and after.

    Attributes:
        temperature: T.
        source: the split's spec.
        n: its questions.
        domains: its domains.
        nll_before, nll_after: the fit's criterion at T = 1 and at T: by ``criterion``, the NLL of the gold
            option (``"nll"``, multiple choice), the NLL of correctness of token confidence
            (``"correctness_nll"``, open answers) or the Sem-ECE (``"sem_ece"``, semantic confidence:
            the sampling temperature chosen from ``tried``).
        criterion: what ``nll_before`` and ``nll_after`` measure.
        tried: ``"sem_ece"``: the Sem-ECE and accuracy at each sampling temperature tried (only those keeping
            the accuracy are candidates, :func:`~llm_calib.confidence.temperature.choose_sampling_temperature`).

    Example:
        >>> import torch
        >>> s = ScoredSet([torch.tensor([0.0, 2.0]), torch.tensor([1.0, 0.0])], [1, 0], ["d", "d"], ["a", "b"])
        >>> fit = TemperatureFit.fit(s, "toy")
        >>> fit.n, fit.nll_after <= fit.nll_before, fit.describe()[:3]
        (2, True, 'NLL')
    """

    temperature: float
    source: str
    n: int
    domains: list[str]
    nll_before: float
    nll_after: float
    criterion: str = "nll"
    tried: dict[str, dict[str, float]] | None = None

    def describe(self) -> str:
        """The criterion before and after, as the reports print it.

        Example:
            >>> tried = {"0.7": {"sem_ece": 0.12, "accuracy": 0.38}, "1": {"sem_ece": 0.14, "accuracy": 0.4}}
            >>> TemperatureFit(0.7, "h", 60, ["d"], 0.14, 0.12, "sem_ece", tried).describe()
            'held-out Sem-ECE 0.140 -> 0.120; Sem-ECE / accuracy at T = 0.7: 0.120 / 0.380, 1: 0.140 / 0.400'
        """
        if self.criterion == "sem_ece":
            tried = ", ".join(f"{t}: {v['sem_ece']:.3f} / {v['accuracy']:.3f}" for t, v in (self.tried or {}).items())
            return f"held-out Sem-ECE {self.nll_before:.3f} -> {self.nll_after:.3f}; Sem-ECE / accuracy at T = {tried}"
        name = "NLL of correctness" if self.criterion == "correctness_nll" else "NLL"
        return f"{name} {self.nll_before:.3f} -> {self.nll_after:.3f}"

    @classmethod
    def fit(cls, scored: ScoredSet, source: str) -> TemperatureFit:
        """The NLL-minimising temperature of a scored multiple-choice set (:func:`~llm_calib.metrics.temperature.fit_temperature`)."""
        T = fit_temperature(scored.logits, scored.labels)
        return cls(T, source, len(scored), sorted(set(scored.domains)),
                   temperature_nll(scored.logits, scored.labels, 1.0), temperature_nll(scored.logits, scored.labels, T))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return dataclasses.asdict(self)


@dataclass
class DomainResult:
    """Metrics of one domain of ``kind`` ``"multiple_choice"`` or ``"open"``: the metric dicts
    (``summary``) and reliability bins (:meth:`~llm_calib.metrics.calibration.ReliabilityBins.to_dict`)
    ``uncalibrated`` and temperature-scaled (or None), the format-specific ``normalizations`` (or
    None), and, not serialised, the ``scored`` set and the ``task`` format that scored it.

    Example:
        >>> r = DomainResult("toy", "multiple_choice", {"n": 3, "accuracy": 0.5}, None, {}, None)
        >>> r.n, r.to_dict()["temperature_scaled"]
        (3, None)
    """

    domain: str
    kind: str
    uncalibrated: dict[str, float]
    temperature_scaled: dict[str, float] | None
    reliability: dict[str, list[float]]
    reliability_scaled: dict[str, list[float]] | None
    scored: ScoredSet | OpenEndedSet | None = field(default=None, repr=False)
    normalizations: dict[str, dict[str, float]] | None = None
    task: TaskFormat | None = field(default=None, repr=False, compare=False)

    @property
    def n(self) -> int:
        """Number of questions."""
        return int(self.uncalibrated["n"])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (without the raw scores)."""
        return {"kind": self.kind, "n": self.n, "uncalibrated": dict(self.uncalibrated),
                "temperature_scaled": dict(self.temperature_scaled) if self.temperature_scaled else None,
                "reliability": self.reliability, "reliability_scaled": self.reliability_scaled,
                "normalizations": self.normalizations}


@dataclass
class EvaluationResult:
    """Everything an evaluation produced: per-domain results, the temperature fit, settings and timings.

    Example:
        >>> r = DomainResult("toy", "multiple_choice", {"n": 3, "accuracy": 0.5}, None, {}, None)
        >>> EvaluationResult({"toy": r}, None, {}, {}).macro_average()["uncalibrated"]["accuracy"]
        0.5
    """

    domains: dict[str, DomainResult]
    temperature: TemperatureFit | None
    config: dict[str, Any]
    timing: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: config, temperature, timing, per-domain metrics and a macro average."""
        return {
            "config": dict(self.config),
            "temperature": self.temperature.to_dict() if self.temperature else None,
            "timing": dict(self.timing),
            "domains": {d: r.to_dict() for d, r in self.domains.items()},
            "macro_average": self.macro_average(),
        }

    def macro_average(self) -> dict[str, dict[str, float]]:
        """Unweighted mean over domains of the headline metrics, uncalibrated and scaled."""
        out: dict[str, dict[str, float]] = {}
        for key in ("uncalibrated", "temperature_scaled"):
            rows = [getattr(r, key) for r in self.domains.values() if getattr(r, key)]
            if rows:
                out[key] = {
                    m: float(np.nanmean([row.get(m, math.nan) for row in rows]))
                    if any(math.isfinite(row.get(m, math.nan)) for row in rows)
                    else math.nan
                    for m in HEADLINE_METRICS
                }
        return out


def _format(records: Sequence[Any], task: TaskFormat | None, *, what: str = "records", **settings: Any) -> TaskFormat:
    """The format of a data set entering evaluation (``task``, checked, or the one of the settings)."""
    try:
        if task is not None:
            task.check(records, what=what)
            return task
        return format_for(records, what=what, **settings)
    except RecordKindError as exc:
        raise TypeError(f"records must be all MultipleChoice or all OpenQA: {exc}") from exc


def domain_result(
    domain: str,
    task: TaskFormat,
    scored: ScoredResult,
    temperature: float | None = None,
    *,
    n_bins: int = 10,
    ci: bool = True,
    n_resamples: int = 1000,
    seed: int = 0,
    scaled: ScoredResult | None = None,
) -> DomainResult:
    """The metrics of one domain's scored set, whatever its format (temperature applied where it can be).

    ``scaled``: the set already scored by the model at the temperature (open answers: the deployed
    model at T answers again), used instead of the format's post-hoc scaling.

    Example:
        >>> import torch
        >>> from llm_calib.formats import OptionLikelihood
        >>> s = ScoredSet([torch.tensor([0.0, 2.0]), torch.tensor([1.0, 0.0])], [1, 1], ["d", "d"], ["a", "b"])
        >>> r = domain_result("d", OptionLikelihood(), s, 2.0, ci=False)
        >>> r.n, r.uncalibrated["accuracy"], r.temperature_scaled is not None
        (2, 0.5, True)
    """

    def summary(s: ScoredResult) -> tuple[dict[str, float], dict[str, list[float]]]:
        m = s.summary(n_bins=n_bins, ci=ci, n_resamples=n_resamples, seed=seed)
        c = s.confidences
        scored = ~np.isnan(c)  # answers without a confidence (an unparsed stated one) are counted in m, not binned
        if scored.any():
            rb = metrics.reliability_bins(c[scored], s.correct[scored], n_bins=n_bins).to_dict()
        else:  # no answer has a confidence: every bin empty
            nan = np.full(n_bins, np.nan)
            rb = metrics.ReliabilityBins(np.arange(n_bins + 1) / n_bins, np.zeros(n_bins, np.int64), nan, nan).to_dict()
        return m, rb

    unc, rb = summary(scored)
    metrics_scaled = rb_scaled = None
    scaled_set = scaled if scaled is not None else task.temperature_scaled(scored, temperature)
    if scaled_set is not None:
        metrics_scaled, rb_scaled = summary(scaled_set)
    return DomainResult(domain, task.family, unc, metrics_scaled, rb, rb_scaled, scored,  # type: ignore[arg-type]
                        normalizations=task.extra_metrics(scored, n_bins), task=task)


def evaluate_records(
    model: Any, tokenizer: Any, datasets: Sequence[tuple[str, Sequence[MultipleChoice | OpenQA]]], *,
    scorer: str = "option_likelihood", normalize: Normalize = "sum",
    prompt: PromptFormat | None = None, batch_size: int = 8,
    temperature_fit: tuple[str, Sequence[MultipleChoice]] | None = None, n_bins: int = 10, ci: bool = True,
    n_resamples: int = 1000, seed: int = 0, max_new_tokens: int = 32, progress: bool = False,
    open_prompt: PromptFormat | None = None, task: TaskFormat | None = None,
    confidence: OpenConfidence | None = None, context_overflow: ContextOverflow | None = None,
) -> EvaluationResult:
    """Evaluate already-loaded ``(name, records)`` data sets, per record domain.

    Arguments are those of :func:`evaluate`; ``temperature_fit`` is ``(name, records)``;
    ``context_overflow``: a question longer than the model's context is refused (``"refuse"``, the
    default) or its prompt cut from the left, counted in ``config["context"]`` and warned about
    (``"truncate"``; :func:`~llm_calib.engine.context.context_window`);
    ``open_prompt`` is the prompt of open questions (None: ``prompt`` as a cloze prompt); ``task``
    scores every set with that format instead of :func:`~llm_calib.formats.format_for`'s. With
    ``prompt.fewshot > 0`` and no pool, the pool is loaded without the evaluated questions
    (:func:`~llm_calib.prompts.resolution.resolve_fewshot`).

    Raises:
        ValueError: an unknown scorer, an empty data set, or a temperature-fit split that is empty,
            mixes kinds, or holds open questions under ``p_true`` or ``verbalized`` confidence.
        TypeError: a data set mixing multiple-choice and open questions.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.data import builtin_multiple_choice
        >>> model, tok = tiny_random_model()
        >>> qs = builtin_multiple_choice(4, domains=["capitals", "arithmetic"])
        >>> res = evaluate_records(model, tok, [("builtin", qs)], ci=False, temperature_fit=("fit", qs))
        >>> list(res.domains), res.temperature.temperature > 0
        (['capitals', 'arithmetic'], True)
    """
    scorer_class(scorer)  # ValueError naming the registered scorers, before any work
    if prompt is not None and prompt.fewshot > 0:
        evaluated = [r for _, recs in datasets for r in recs]
        if temperature_fit is not None:
            evaluated += list(temperature_fit[1])
        prompt = resolve_fewshot(prompt, exclude=evaluated)
    settings = {"scorer": scorer, "normalize": normalize, "prompt": prompt, "max_new_tokens": max_new_tokens,
                "open_prompt": open_prompt, "confidence": confidence}
    for name, records in datasets:
        if not records:
            raise ValueError(f"the evaluation set {name!r} (eval) is empty: the report scores it; pass at least one question")
    timing: dict[str, float] = {}
    stats = {"n_bins": n_bins, "ci": ci, "n_resamples": n_resamples, "seed": seed}
    with context_window(model, context_overflow) as window:  # every scored sequence within the model's positions
        run = _Scoring(model, tokenizer, task, settings, batch_size, progress, timing)
        fit, fit_family = run.fit_temperature(*temperature_fit) if temperature_fit is not None else (None, None)
        scored_domains = run.score_by_domain(datasets)
        scaled_domains: dict[str, tuple[TaskFormat, list[Any]]] = {}
        if fit is not None and fit_family == "open":
            # open answers at T: the deployed model at T answers again (token: the same greedy answers, their
            # token probabilities at T; semantic: samples drawn at T)
            scaled_domains = run.score_by_domain(datasets, temperature=fit.temperature)
    domains = {}
    for dom, (fmt, parts) in scored_domains.items():
        applies = fit is not None and fmt.family == fit_family  # a fit serves the domains of its own kind
        scaled = scaled_domains.get(dom)
        domains[dom] = domain_result(dom, fmt, type(parts[0]).concat(parts), fit.temperature if applies else None,
                                     scaled=type(scaled[1][0]).concat(scaled[1]) if applies and scaled else None,
                                     **stats)
    for dom, r in domains.items():
        unscored = int(r.uncalibrated.get("unscored", 0) or 0)
        if unscored and not r.uncalibrated.get("n"):  # nothing to measure: say so, not only "n/a" in the report
            warnings.warn(f"{dom}: no confidence could be read from any of its {unscored} answers (every calibration "
                          "metric is n/a); the model did not state a number 0-100 when asked: try another "
                          "verbalized template (--verbalized-template), or --confidence p_true", UserWarning, stacklevel=2)
    config = {
        "scorer": scorer,
        "normalize": normalize,
        "prompt": prompt_dict(prompt if prompt is not None else multiple_choice_format(scorer).prompt_settings(), tokenizer),
        "batch_size": batch_size,
        "max_new_tokens": max_new_tokens,
        "datasets": [name for name, _ in datasets],
        "context": window.summary(),
        **stats,
    }
    if open_prompt is not None:
        config["open_prompt"] = prompt_dict(open_prompt)
    if confidence is not None and any(r.kind == "open" for r in domains.values()):
        config["confidence"] = confidence.to_dict()
    return EvaluationResult(domains, fit, config, timing)


@dataclass
class _Scoring:
    """What :func:`evaluate_records` scores with: the model, the format settings, the batch size;
    it adds each scoring time to ``timing``."""

    model: Any
    tokenizer: Any
    task: TaskFormat | None
    settings: dict[str, Any]
    batch_size: int
    progress: bool
    timing: dict[str, float]

    def score(self, fmt: TaskFormat, name: str, records: Sequence[Any]) -> tuple[ScoredResult, float]:
        """``records`` scored by ``fmt`` under the progress label ``name``, and the seconds it took."""
        t0 = time.perf_counter()
        with scoring_split(name):
            scored = fmt.score(self.model, self.tokenizer, records, batch_size=self.batch_size, progress=self.progress)
        return scored, time.perf_counter() - t0

    def fit_temperature(self, name: str, records: Sequence[Any]) -> tuple[TemperatureFit, str]:
        """The temperature fitted on the split ``name``, and the kind of records it serves.

        Multiple choice: the option NLL (:meth:`TemperatureFit.fit`). Open questions: token confidence's
        NLL of correctness, or semantic confidence's sampling temperature by Sem-ECE
        (:func:`~llm_calib.confidence.temperature.fit_open_temperature`).

        Raises:
            ValueError: no records, records of both kinds, or open questions under ``p_true`` or
                ``verbalized`` confidence.
        """
        try:
            fmt: TaskFormat | None = _format(records, self.task, what=f"temperature_fit {name!r}", **self.settings)
        except TypeError:
            fmt = None
        if not records or fmt is None:
            raise ValueError(f"temperature_fit {name!r} must hold multiple-choice records or open questions (got none, "
                             "or both kinds)")
        t0 = time.perf_counter()
        if fmt.family == "open":
            from llm_calib.confidence.temperature import fit_open_temperature

            confidence = getattr(fmt, "confidence", None)
            try:
                found = fit_open_temperature(self.model, self.tokenizer, records, confidence, prompt=fmt.prompt_settings(),
                                             max_new_tokens=self.settings["max_new_tokens"], batch_size=self.batch_size)
            except ValueError as exc:
                raise ValueError(f"temperature_fit {name!r}: {exc}") from exc
            self.timing["temperature_fit_scoring_s"] = time.perf_counter() - t0
            fit = TemperatureFit(found.temperature, name, len(records), sorted({r.domain for r in records}),
                                 found.before, found.after, found.criterion, found.tried or None)
            return fit, "open"
        if not fmt.temperature_scalable:
            raise ValueError(f"temperature_fit {name!r}: the {fmt.description} format takes no temperature")
        scored, self.timing["temperature_fit_scoring_s"] = self.score(fmt, f"{name} (temperature fit)", records)
        return TemperatureFit.fit(scored, name), fmt.family  # type: ignore[arg-type]

    def score_by_domain(self, datasets: Sequence[tuple[str, Sequence[Any]]], *,
                        temperature: float | None = None) -> dict[str, tuple[TaskFormat, list[Any]]]:
        """Per record domain, in order of first appearance: its format and its scored parts (one per data set).

        With ``temperature``: only the open data sets, each answered by the deployed model at that temperature."""
        groups: dict[str, tuple[TaskFormat, list[Any]]] = {}
        n_scored, score_s = 0, 0.0
        for name, records in datasets:
            fmt = _format(records, self.task, what=f"data set {name!r}", **self.settings)
            if temperature is not None:
                if fmt.family != "open":
                    continue
                fmt = _at_temperature(fmt, temperature)
                scored, dt = self.score(fmt, f"{name} (T = {temperature:.3g})", records)
                self.timing[f"scoring_s[{name}, temperature]"] = dt
                for dom, part in scored.by_domain().items():
                    groups.setdefault(dom, (fmt, []))[1].append(part)
                continue
            scored, dt = self.score(fmt, name, records)
            self.timing[f"scoring_s[{name}]"] = dt
            n_scored += len(scored)
            score_s += dt
            for dom, part in scored.by_domain().items():
                groups.setdefault(dom, (fmt, []))[1].append(part)
        if temperature is None:
            self.timing["scoring_s"] = score_s
            self.timing["questions_per_s"] = n_scored / score_s if score_s > 0 else math.nan
        return groups


def _at_temperature(fmt: TaskFormat, temperature: float) -> TaskFormat:
    """An open format whose confidence reads the deployed model at ``temperature``."""
    confidence = getattr(fmt, "confidence", None) or OpenConfidence()
    return dataclasses.replace(fmt, confidence=dataclasses.replace(confidence, temperature=temperature))


def evaluate(
    model: Any, tokenizer: Any, data: Sequence[str], *, scorer: str = "option_likelihood",
    normalize: Normalize = "sum", prompt: PromptFormat | None = None,
    limit: int | None = None, limit_mode: Literal["sample", "first"] = "sample",
    on_error: Literal["raise", "skip"] = "raise", batch_size: int = 8, temperature_fit: str | None = None,
    n_bins: int = 10, ci: bool = True, n_resamples: int = 1000, seed: int = 0, max_new_tokens: int = 32,
    progress: bool = False, confidence: OpenConfidence | None = None, context_overflow: ContextOverflow | None = None,
) -> EvaluationResult:
    """Load data sets by spec, score them and compute per-domain calibration metrics.

    Args:
        model: a Hugging Face causal LM (see :func:`llm_calib.models.load`).
        tokenizer: its tokenizer.
        data: data specs (:mod:`llm_calib.data.spec`), e.g. ``"builtin"``.
        scorer: a registered multiple-choice format (:data:`~llm_calib.formats.SCORER_NAMES`):
            ``"option_likelihood"`` (default), ``"letter"`` or one registered later.
        normalize: ``"sum"``, ``"mean"``, ``"char"`` or ``"byte"`` (option likelihood only).
        prompt: prompt format; None uses the scorer's default.
        limit: at most this many questions per spec (also the temperature-fit split).
        limit_mode: ``"sample"`` (seeded subsample) or ``"first"`` (file order, as lm-eval).
        on_error: ``"raise"`` at the first bad row, or ``"skip"`` (listed in ``config["skipped"]``).
        batch_size: questions per forward pass.
        temperature_fit: spec of the split to fit a temperature on; None: no temperature scaling.
            Multiple choice: the option NLL; open questions: the NLL of correctness of token
            confidence, or under semantic confidence the sampling temperature with the lowest Sem-ECE
            (:mod:`llm_calib.confidence.temperature`); the temperature serves the domains of its kind.
        n_bins: bins of ECE and the reliability diagrams.
        ci: compute 95% bootstrap confidence intervals.
        n_resamples: bootstrap resamples.
        seed: subsample and bootstrap seed.
        max_new_tokens: generation budget for open questions.
        progress: show progress bars.
        confidence: open questions: the confidence of each answer
            (:class:`~llm_calib.confidence.kinds.OpenConfidence`: ``token``, the default,
            ``semantic`` (Sem-ECE over sampled answers), ``p_true`` or ``verbalized``).
        context_overflow: a question longer than the model's context: ``"refuse"`` (the default,
            ValueError naming it) or ``"truncate"`` its prompt from the left, counted in
            ``config["context"]`` (:mod:`llm_calib.engine.context`).

    Raises:
        ValueError: a malformed spec or bad arguments (messages name the parameter); a question
            longer than the model's context (unless ``context_overflow="truncate"``).
        FileNotFoundError: a spec's path does not exist.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> evaluate(model, tok, ["builtin:capitals:n=8"], ci=False).domains["capitals"].n
        8
    """
    if isinstance(data, str):
        data = [data]
    if not data:
        raise ValueError("data must name at least one data spec")
    t0 = time.perf_counter()
    skipped: dict[str, dict[str, Any]] = {}

    def _load(spec: str) -> list[Any]:
        res = load_data(spec, limit=limit, seed=seed, limit_mode=limit_mode, on_error=on_error)
        if res.skipped:
            skipped[spec] = {"count": res.skipped, "errors": list(res.errors)}
        return res.records

    loaded = [(spec, _load(spec)) for spec in data]
    fit = None
    if temperature_fit is not None:
        fit = (temperature_fit, _load(temperature_fit))
    load_s = time.perf_counter() - t0
    result = evaluate_records(
        model, tokenizer, loaded, scorer=scorer, normalize=normalize, prompt=prompt, batch_size=batch_size,
        temperature_fit=fit, n_bins=n_bins, ci=ci, n_resamples=n_resamples, seed=seed,
        max_new_tokens=max_new_tokens, progress=progress, confidence=confidence, context_overflow=context_overflow,
    )
    result.timing["data_loading_s"] = load_s
    result.config.update({"limit": limit, "limit_mode": limit_mode, "skipped": skipped})
    return result


def sample_rows(result: EvaluationResult) -> Iterator[dict[str, Any]]:
    """One JSON-ready dict per evaluated question, domain by domain (the format's ``sample_rows``).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> row = next(sample_rows(evaluate(model, tok, ["builtin:capitals:n=2"], ci=False)))
        >>> row["prediction"] == int(np.argmax(row["probs"]))
        True
    """
    for dom, r in result.domains.items():
        if r.task is not None and r.scored is not None:
            yield from r.task.sample_rows(dom, r.scored)


def write_samples(result: EvaluationResult, path: str | os.PathLike[str]) -> Path:
    """Write :func:`sample_rows` as JSON lines to ``path``, atomically (a temporary file, then a rename).

    Example:
        >>> import tempfile
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> res = evaluate(model, tok, ["builtin:capitals:n=3"], ci=False)
        >>> len(write_samples(res, Path(tempfile.mkdtemp()) / "samples.jsonl").read_text().splitlines())
        3
    """
    from llm_calib.files.atomic import write_text_atomic

    return write_text_atomic(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in sample_rows(result)))
