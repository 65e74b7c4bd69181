"""The evaluation pipeline: load data, score it, compute calibration metrics per domain.

Optionally a temperature is fitted on one named split (e.g. ARC-Easy dev) and carried to every
evaluated domain, which shows how post-hoc temperature scaling transfers out of domain. Results
are grouped by the ``domain`` of the records (one spec such as ``builtin`` may hold several).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from llm_calib import metrics
from llm_calib.data import load as load_data
from llm_calib.data.records import MultipleChoice, OpenQA
from llm_calib.prompts import PromptFormat
from llm_calib.scoring import (
    SCORERS,
    OpenEndedSet,
    ScoredSet,
    score_multiple_choice,
    score_open_ended,
)
from llm_calib.temperature import fit_temperature, temperature_nll

__all__ = [
    "DomainResult",
    "EvaluationResult",
    "TemperatureFit",
    "evaluate",
    "evaluate_records",
    "open_ended_summary",
    "score_records",
]

HEADLINE_METRICS = ("accuracy", "ece", "adaptive_ece", "brier", "nll", "auroc")
"""The metrics the report tables show (with bootstrap intervals)."""


@dataclass
class TemperatureFit:
    """A temperature fitted on one split.

    Attributes:
        temperature: the fitted ``T``.
        source: the spec (or description) of the fit split.
        n: number of fit questions.
        domains: domains of the fit questions.
        nll_before: fit-split NLL at ``T = 1``.
        nll_after: fit-split NLL at the fitted ``T``.

    Example:
        >>> TemperatureFit(2.0, "toy", 10, ["a"], 1.0, 0.8).to_dict()["temperature"]
        2.0
    """

    temperature: float
    source: str
    n: int
    domains: list[str]
    nll_before: float
    nll_after: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "temperature": self.temperature,
            "source": self.source,
            "n": self.n,
            "domains": list(self.domains),
            "nll_before": self.nll_before,
            "nll_after": self.nll_after,
        }


@dataclass
class DomainResult:
    """Metrics of one domain.

    Attributes:
        domain: the domain label.
        kind: ``"multiple_choice"`` or ``"open"``.
        uncalibrated: metric dict (see :func:`llm_calib.metrics.summarize`; for open questions
            :func:`open_ended_summary`).
        temperature_scaled: the same after temperature scaling, or None.
        reliability: per-bin statistics (:meth:`llm_calib.metrics.ReliabilityBins.to_dict`).
        reliability_scaled: the same after temperature scaling, or None.
        scored: the raw scores (not serialised).

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

    @property
    def n(self) -> int:
        """Number of questions."""
        return int(self.uncalibrated["n"])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (without the raw scores)."""
        return {
            "kind": self.kind,
            "n": self.n,
            "uncalibrated": dict(self.uncalibrated),
            "temperature_scaled": dict(self.temperature_scaled)
            if self.temperature_scaled
            else None,
            "reliability": self.reliability,
            "reliability_scaled": self.reliability_scaled,
        }


@dataclass
class EvaluationResult:
    """Everything an evaluation produced.

    Attributes:
        domains: per-domain results, in order of first appearance.
        temperature: the temperature fit, or None.
        config: the settings of the run (JSON-serialisable).
        timing: seconds spent per phase and scoring throughput.

    Example:
        >>> r = DomainResult("toy", "multiple_choice", {"n": 3, "accuracy": 0.5}, None, {}, None)
        >>> res = EvaluationResult({"toy": r}, None, {}, {})
        >>> res.macro_average()["uncalibrated"]["accuracy"]
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


def score_records(
    model: Any,
    tokenizer: Any,
    records: Sequence[MultipleChoice | OpenQA],
    *,
    scorer: str = "option_likelihood",
    normalize: Literal["sum", "mean"] = "sum",
    prompt: PromptFormat | None = None,
    batch_size: int = 8,
    max_new_tokens: int = 32,
    progress: bool = False,
) -> ScoredSet | OpenEndedSet:
    """Score records with the scorer that fits their type.

    Multiple-choice records go to ``scorer`` (``"option_likelihood"`` or ``"letter"``), open
    questions to :func:`~llm_calib.scoring.score_open_ended`. A mix of both is an error.

    Args:
        model: a Hugging Face causal LM.
        tokenizer: its tokenizer.
        records: all :class:`~llm_calib.data.records.MultipleChoice` or all
            :class:`~llm_calib.data.records.OpenQA`.
        scorer: multiple-choice scorer, ``"option_likelihood"`` or ``"letter"``.
        normalize: ``"sum"`` or ``"mean"`` option log-probabilities (option likelihood).
        prompt: prompt format; None uses the scorer's default.
        batch_size: questions per forward pass.
        max_new_tokens: generation budget for open questions.
        progress: show a progress bar.

    Returns:
        A :class:`~llm_calib.scoring.base.ScoredSet` (multiple choice) or an
        :class:`~llm_calib.scoring.open_ended.OpenEndedSet` (open questions).

    Raises:
        TypeError: the records mix multiple-choice and open questions.
        ValueError: an unknown scorer or bad arguments.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> qs = [MultipleChoice("2 + 2 = ?", ("4", "5"), 0, "math", "q0")]
        >>> score_records(model, tok, qs).scorer
        'option_likelihood'
    """
    records = list(records)
    kinds = {type(r) for r in records}
    if kinds == {OpenQA}:
        return score_open_ended(
            model,
            tokenizer,
            records,
            prompt=_open_prompt(prompt),
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            progress=progress,
        )
    if kinds <= {MultipleChoice}:
        return score_multiple_choice(
            model,
            tokenizer,
            records,
            scorer=scorer,
            normalize=normalize,
            prompt=prompt,
            batch_size=batch_size,
            progress=progress,
        )
    raise TypeError(
        f"records must be all MultipleChoice or all OpenQA, got {sorted(k.__name__ for k in kinds)}"
    )


def _open_prompt(prompt: PromptFormat | None) -> PromptFormat | None:
    if prompt is None or prompt.style == "cloze":
        return prompt
    return PromptFormat("cloze", prompt.chat_template, prompt.system_message, prompt.answer_prefix)


def open_ended_summary(
    scored: OpenEndedSet,
    n_bins: int = 10,
    ci: bool = True,
    n_resamples: int = 1000,
    seed: int = 0,
) -> dict[str, float]:
    """Calibration metrics of open-ended answers (confidence = mean token probability).

    Keys: ``n``, ``accuracy`` (exact match), ``f1``, ``ece``, ``ece15``, ``adaptive_ece``,
    ``mce``, ``brier`` and ``nll`` (of the confidence as a probability of being correct),
    ``auroc``, ``mean_confidence``, ``ece_product``, ``ece_min`` (ECE of the product and minimum
    token-probability confidences); with ``ci``, bootstrap intervals of the headline metrics.

    Args:
        scored: greedy answers with their token probabilities.
        n_bins: equal-width bins of the ECE variants.
        ci: add 95% bootstrap intervals.
        n_resamples: bootstrap resamples.
        seed: bootstrap seed.

    Returns:
        The metrics by name.

    Example:
        >>> s = OpenEndedSet(["Paris", "Rome"], [("Paris",), ("Oslo",)], ["geo"] * 2,
        ...                  ["q0", "q1"], [(0.9,), (0.2,)])
        >>> r = open_ended_summary(s, ci=False)
        >>> r["accuracy"], round(r["brier"], 3)
        (0.5, 0.025)
    """
    c = np.clip(scored.confidence("mean"), 0.0, 1.0)
    k = scored.correct.astype(np.float64)

    def _brier(c: np.ndarray, k: np.ndarray) -> float:
        return float(np.mean((np.asarray(c) - np.asarray(k)) ** 2))

    def _nll(c: np.ndarray, k: np.ndarray) -> float:
        cc = np.clip(np.asarray(c), metrics.NLL_EPS, 1 - metrics.NLL_EPS)
        kk = np.asarray(k)
        return float(-np.mean(kk * np.log(cc) + (1 - kk) * np.log(1 - cc)))

    def _acc(c: np.ndarray, k: np.ndarray) -> float:
        return float(np.mean(k))

    funcs = {
        "accuracy": _acc,
        "ece": lambda c, k: metrics.ece(c, k, n_bins),
        "adaptive_ece": lambda c, k: metrics.adaptive_ece(c, k, n_bins),
        "brier": _brier,
        "nll": _nll,
        "auroc": metrics.auroc,
    }
    out: dict[str, float] = {"n": len(scored)}
    out.update({name: f(c, k) for name, f in funcs.items()})
    out["f1"] = float(np.mean(scored.f1)) if len(scored) else math.nan
    out["ece15"] = metrics.ece(c, k, 15)
    out["mce"] = metrics.mce(c, k, n_bins)
    out["mean_confidence"] = float(c.mean())
    out["ece_product"] = metrics.ece(np.clip(scored.confidence("product"), 0, 1), k, n_bins)
    out["ece_min"] = metrics.ece(np.clip(scored.confidence("min"), 0, 1), k, n_bins)
    if ci:
        for name, f in funcs.items():
            lo, hi = metrics.bootstrap_ci(f, c, k, n_resamples=n_resamples, seed=seed)
            out[f"{name}_ci_low"], out[f"{name}_ci_high"] = lo, hi
    return out


def _mc_domain(
    domain: str,
    scored: ScoredSet,
    temperature: float | None,
    n_bins: int,
    ci: bool,
    n_resamples: int,
    seed: int,
) -> DomainResult:
    def summary(s: ScoredSet) -> tuple[dict[str, float], dict[str, list[float]]]:
        m = metrics.summarize(
            s.probs_numpy, s.labels_numpy, n_bins=n_bins, ci=ci, n_resamples=n_resamples, seed=seed
        )
        rb = metrics.reliability_bins(s.confidences, s.correct, n_bins=n_bins).to_dict()
        return m, rb

    unc, rb = summary(scored)
    scaled = rb_scaled = None
    if temperature is not None:
        scaled, rb_scaled = summary(scored.scaled(temperature))
    return DomainResult(domain, "multiple_choice", unc, scaled, rb, rb_scaled, scored)


def _open_domain(
    domain: str, scored: OpenEndedSet, n_bins: int, ci: bool, n_resamples: int, seed: int
) -> DomainResult:
    summary = open_ended_summary(scored, n_bins=n_bins, ci=ci, n_resamples=n_resamples, seed=seed)
    rb = metrics.reliability_bins(
        np.clip(scored.confidence("mean"), 0, 1), scored.correct, n_bins=n_bins
    )
    return DomainResult(domain, "open", summary, None, rb.to_dict(), None, scored)


def evaluate_records(
    model: Any,
    tokenizer: Any,
    datasets: Sequence[tuple[str, Sequence[MultipleChoice | OpenQA]]],
    *,
    scorer: str = "option_likelihood",
    normalize: Literal["sum", "mean"] = "sum",
    prompt: PromptFormat | None = None,
    batch_size: int = 8,
    temperature_fit: tuple[str, Sequence[MultipleChoice]] | None = None,
    n_bins: int = 10,
    ci: bool = True,
    n_resamples: int = 1000,
    seed: int = 0,
    max_new_tokens: int = 32,
    progress: bool = False,
) -> EvaluationResult:
    """Evaluate already-loaded records (see :func:`evaluate` for the arguments).

    Args:
        model: a Hugging Face causal LM.
        tokenizer: its tokenizer.
        datasets: ``(name, records)`` pairs; results are grouped by record domain.
        scorer: multiple-choice scorer, a key of :data:`llm_calib.scoring.SCORERS`.
        normalize: option-likelihood aggregation, ``"sum"`` or ``"mean"``.
        prompt: prompt format (None: the scorer's default).
        batch_size: questions per forward pass.
        temperature_fit: ``(name, records)`` of the split the temperature is fitted on, or None.
        n_bins: bins of ECE and the reliability diagrams.
        ci: compute bootstrap confidence intervals.
        n_resamples: bootstrap resamples.
        seed: bootstrap seed.
        max_new_tokens: generation budget for open questions.
        progress: show progress bars.

    Returns:
        An :class:`EvaluationResult`.

    Raises:
        ValueError: an unknown scorer, or a temperature-fit split without multiple-choice
            records.
        TypeError: a data set mixing multiple-choice and open questions.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.data import builtin_multiple_choice
        >>> model, tok = tiny_random_model()
        >>> qs = builtin_multiple_choice(4, domains=["capitals", "arithmetic"])
        >>> res = evaluate_records(model, tok, [("builtin", qs)], ci=False,
        ...                        temperature_fit=("fit", qs))
        >>> list(res.domains), res.domains["capitals"].n, res.temperature.temperature > 0
        (['capitals', 'arithmetic'], 4, True)
    """
    if scorer not in SCORERS:
        raise ValueError(f"scorer must be one of {tuple(SCORERS)}, got {scorer!r}")
    kwargs = {
        "scorer": scorer,
        "normalize": normalize,
        "prompt": prompt,
        "batch_size": batch_size,
        "max_new_tokens": max_new_tokens,
        "progress": progress,
    }
    timing: dict[str, float] = {}
    fit = None
    if temperature_fit is not None:
        name, fit_records = temperature_fit
        if not fit_records or not all(isinstance(r, MultipleChoice) for r in fit_records):
            raise ValueError(
                f"temperature_fit {name!r} must hold multiple-choice records (got none or open questions)"
            )
        t0 = time.perf_counter()
        fs = score_records(model, tokenizer, fit_records, **kwargs)
        assert isinstance(fs, ScoredSet)
        timing["temperature_fit_scoring_s"] = time.perf_counter() - t0
        T = fit_temperature(fs.logits, fs.labels)
        fit = TemperatureFit(
            temperature=T,
            source=name,
            n=len(fs),
            domains=sorted(set(fs.domains)),
            nll_before=temperature_nll(fs.logits, fs.labels, 1.0),
            nll_after=temperature_nll(fs.logits, fs.labels, T),
        )
    groups: dict[str, list[ScoredSet | OpenEndedSet]] = {}
    n_scored, score_s = 0, 0.0
    for name, records in datasets:
        if not records:
            raise ValueError(f"data set {name!r} holds no records")
        t0 = time.perf_counter()
        scored = score_records(model, tokenizer, records, **kwargs)
        dt = time.perf_counter() - t0
        timing[f"scoring_s[{name}]"] = dt
        n_scored += len(scored)
        score_s += dt
        for dom, part in scored.by_domain().items():
            groups.setdefault(dom, []).append(part)
    timing["scoring_s"] = score_s
    timing["questions_per_s"] = n_scored / score_s if score_s > 0 else math.nan
    domains: dict[str, DomainResult] = {}
    stats = {"n_bins": n_bins, "ci": ci, "n_resamples": n_resamples, "seed": seed}
    for dom, parts in groups.items():
        if isinstance(parts[0], ScoredSet):
            merged = ScoredSet.concat([p for p in parts if isinstance(p, ScoredSet)])
            domains[dom] = _mc_domain(dom, merged, fit.temperature if fit else None, **stats)
        else:
            opens = [p for p in parts if isinstance(p, OpenEndedSet)]
            merged_open = opens[0] if len(opens) == 1 else _concat_open(opens)
            domains[dom] = _open_domain(dom, merged_open, **stats)
    config = {
        "scorer": scorer,
        "normalize": normalize,
        "prompt": _prompt_dict(prompt, scorer),
        "batch_size": batch_size,
        "max_new_tokens": max_new_tokens,
        "datasets": [name for name, _ in datasets],
        **stats,
    }
    return EvaluationResult(domains, fit, config, timing)


def _concat_open(sets: Sequence[OpenEndedSet]) -> OpenEndedSet:
    return OpenEndedSet(
        [a for s in sets for a in s.answers],
        [r for s in sets for r in s.references],
        [d for s in sets for d in s.domains],
        [i for s in sets for i in s.ids],
        [p for s in sets for p in s.token_probs],
        dict(sets[0].info),
    )


def _prompt_dict(prompt: PromptFormat | None, scorer: str) -> dict[str, Any]:
    p = prompt or PromptFormat(style="listed" if scorer == "letter" else "cloze")
    return {
        "style": p.style,
        "chat_template": p.chat_template,
        "system_message": p.system_message,
        "answer_prefix": p.answer_prefix,
    }


def evaluate(
    model: Any,
    tokenizer: Any,
    data: Sequence[str],
    *,
    scorer: str = "option_likelihood",
    normalize: Literal["sum", "mean"] = "sum",
    prompt: PromptFormat | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    temperature_fit: str | None = None,
    n_bins: int = 10,
    ci: bool = True,
    n_resamples: int = 1000,
    seed: int = 0,
    max_new_tokens: int = 32,
    progress: bool = False,
) -> EvaluationResult:
    """Load data sets by spec, score them and compute per-domain calibration metrics.

    Args:
        model: a Hugging Face causal LM (see :func:`llm_calib.models.load`).
        tokenizer: its tokenizer.
        data: data specs (grammar in :mod:`llm_calib.data.spec`), e.g.
            ``"arc_easy:../shared/data/arc_easy/test.jsonl"`` or ``"builtin"``.
        scorer: ``"option_likelihood"`` (default) or ``"letter"``.
        normalize: ``"sum"`` or ``"mean"`` (option likelihood only).
        prompt: prompt format; None uses the scorer's default (cloze for option likelihood,
            listed for letter), with the chat template when the tokenizer has one.
        limit: at most this many questions per spec (a seeded subsample, ``seed``); also applied
            to the temperature-fit split.
        batch_size: questions per forward pass.
        temperature_fit: spec of the split to fit a temperature on (multiple choice), carried to
            every evaluated domain; None for no temperature scaling.
        n_bins: bins of ECE and the reliability diagrams.
        ci: compute 95% bootstrap confidence intervals.
        n_resamples: bootstrap resamples.
        seed: subsample and bootstrap seed.
        max_new_tokens: generation budget for open questions.
        progress: show progress bars.

    Returns:
        An :class:`EvaluationResult`.

    Raises:
        ValueError: a malformed spec or bad arguments (messages name the parameter).
        FileNotFoundError: a spec's path does not exist.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> res = evaluate(model, tok, ["builtin:capitals:n=8"], ci=False)
        >>> res.domains["capitals"].n
        8
    """
    if isinstance(data, str):
        data = [data]
    if not data:
        raise ValueError("data must name at least one data spec")
    t0 = time.perf_counter()
    loaded = [(spec, load_data(spec, limit=limit, seed=seed).records) for spec in data]
    fit = None
    if temperature_fit is not None:
        fit = (temperature_fit, load_data(temperature_fit, limit=limit, seed=seed).records)
    load_s = time.perf_counter() - t0
    result = evaluate_records(
        model,
        tokenizer,
        loaded,
        scorer=scorer,
        normalize=normalize,
        prompt=prompt,
        batch_size=batch_size,
        temperature_fit=fit,
        n_bins=n_bins,
        ci=ci,
        n_resamples=n_resamples,
        seed=seed,
        max_new_tokens=max_new_tokens,
        progress=progress,
    )
    result.timing["data_loading_s"] = load_s
    result.config["limit"] = limit
    return result
