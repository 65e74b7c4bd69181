"""Calibration metrics for any lm-eval run, from lm-eval's ``--log_samples`` files
(``samples_<task>_<date>.jsonl``): for a multiple-choice task the option probabilities are the
softmax over the logged option log-likelihoods, summed (``acc``), per character (``acc_norm``) or
per UTF-8 byte (``acc_bytes``) (:func:`samples_result`); for a generation task run with ``repeats``,
the semantic confidence of each question's sampled responses (:func:`generation_result`). No model
or lm-eval needed. See :doc:`/tutorials/lm_eval` and :doc:`/tutorials/open_ended`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llm_calib.confidence.lm_eval_generations import read_generation_samples
from llm_calib.confidence.sampled import SampledSet
from llm_calib.data.lm_eval_logs import rows_by_doc, samples_task_name
from llm_calib.evaluation.evaluate import (
    DomainResult,
    EvaluationResult,
    TemperatureFit,
    domain_result,
)
from llm_calib.formats.multiple_choice import normalization_metrics
from llm_calib.metrics import calibration as metrics
from llm_calib.scoring import ScoredSet, normalized

__all__ = [
    "SAMPLES_NORMALIZATIONS", "generation_result", "read_samples", "samples_result",
]

SAMPLES_NORMALIZATIONS: dict[str, str] = {"acc": "sum", "acc_norm": "char", "acc_bytes": "byte"}
"""lm-eval's metric names and the ``normalize`` mode each takes its argmax under; the ones a
samples file has what it takes to compute (no token counts, so no per-token mode)."""

SCORER = "lm_eval_samples"

def _pairs(arguments: Any) -> list[tuple[str, str]]:
    if isinstance(arguments, Mapping):  # the file format: {"gen_args_0": {"arg_0": .., "arg_1": ..}}
        items = sorted(arguments.items(), key=lambda kv: int(str(kv[0]).rsplit("_", 1)[-1]))
        return [(str(a["arg_0"]), str(a["arg_1"])) for _, a in items]
    return [(str(a[0]), str(a[1])) for a in arguments]  # in memory: a list of (context, cont)


def _gold(target: Any, choices: list[str], where: str) -> int:
    if isinstance(target, list) and len(target) == 1:
        target = target[0]
    if isinstance(target, (int, np.integer)) and not isinstance(target, bool):
        index = int(target)
    elif isinstance(target, str) and target.strip().lstrip("-").isdigit():
        index = int(target.strip())
    elif isinstance(target, str) and target in choices:
        index = choices.index(target)
    else:
        raise ValueError(f"{where}: target {target!r} is neither an option index nor one of the choices")
    if not 0 <= index < len(choices):
        raise ValueError(f"{where}: gold index {index} is not in [0, {len(choices) - 1}]")
    return index


def read_samples(path: str | os.PathLike[str], *, task: str | None = None, target_delimiter: str = " ",
                 rows: Sequence[Mapping[str, Any]] | None = None) -> ScoredSet:
    """The option scores of one multiple-choice task from an lm-eval samples file.

    Args:
        path: a ``samples_<task>_<date>.jsonl`` file written by ``lm_eval --log_samples``.
        task: the domain of its questions; default :func:`samples_task_name` of ``path``.
        target_delimiter: the task's, removed from each continuation to get the choice text.
        rows: the samples themselves (e.g. ``simple_evaluate(...)["samples"][task]``) instead of the file.

    Returns:
        A :class:`~llm_calib.scoring.base.ScoredSet` of the summed log-likelihoods by ``doc_id``
        (ids ``<task>/<doc_id>``; the first filter's rows), ``details`` as the scorers' plus the
        metrics lm-eval logged (``lm_eval``).

    Raises:
        ValueError: not a multiple-choice samples file, an empty file, a line not UTF-8 or not JSON,
            a malformed target (the message names the file and line).
        FileNotFoundError, IsADirectoryError: ``path`` is no file (:func:`check_samples_file`).

    Example:
        >>> import json, tempfile, pathlib
        >>> row = {"doc_id": 0, "doc": {}, "target": "1", "filter": "none",
        ...        "arguments": {"gen_args_0": {"arg_0": "Q: 2+2?\\nA:", "arg_1": " 3"},
        ...                      "gen_args_1": {"arg_0": "Q: 2+2?\\nA:", "arg_1": " 4"}},
        ...        "filtered_resps": [["-2.5", "False"], ["-0.5", "True"]], "acc": 1.0}
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "samples_toy_2026-01-02T10-11-12.5.jsonl"
        >>> _ = p.write_text(json.dumps(row) + "\\n")
        >>> s = read_samples(p)
        >>> s.ids, s.labels, s.logits[0].tolist(), s.details[0]["choices"]
        (['toy/0'], [1], [-2.5, -0.5], ['3', '4'])
    """
    path = Path(path)
    name = task or samples_task_name(path)
    logits, labels, ids, details = [], [], [], []
    for doc_id, line_no, row in rows_by_doc(path, rows):
        where = f"{path}:{line_no}"
        resps = row.get("filtered_resps", row.get("resps"))
        if resps is None or "arguments" not in row:
            raise ValueError(f"{where}: no 'filtered_resps'/'arguments': not an lm-eval samples line")
        if resps and isinstance(resps[0], list) and resps[0] and isinstance(resps[0][0], list):
            resps = [r[0] for r in resps]  # unfiltered resps: one list of responses per request
        pairs = _pairs(row["arguments"])
        if len(pairs) != len(resps) or not all(isinstance(r, (list, tuple)) and len(r) == 2 for r in resps):
            raise ValueError(
                f"{where}: responses are not (log-likelihood, is_greedy) pairs, one per option: "
                "only multiple_choice tasks have option log-likelihoods"
            )
        if len(pairs) % 2 == 0 and "acc_mutual_info" in row and all(c == "" for c, _ in pairs[len(pairs) // 2:]):
            pairs, resps = pairs[: len(pairs) // 2], resps[: len(resps) // 2]
        if len(pairs) < 2:
            raise ValueError(f"{where}: {len(pairs)} option(s); multiple choice needs at least 2")
        try:  # filtered_resps: (loglikelihood, is_greedy), as strings in files
            lls = [float(r[0]) for r in resps]
        except (TypeError, ValueError):
            raise ValueError(f"{where}: log-likelihoods are not numbers: {resps!r}") from None
        if not all(math.isfinite(v) for v in lls):
            raise ValueError(f"{where}: non-finite log-likelihood in {lls}")
        conts = [c for _, c in pairs]
        choices = [c.removeprefix(target_delimiter) for c in conts]
        labels.append(_gold(row.get("target"), choices, where))
        logits.append(torch.tensor(lls, dtype=torch.float64))
        ids.append(f"{name}/{doc_id}")
        details.append({
            "prompt": pairs[0][0], "continuations": conts, "choices": choices, "loglik": lls,
            "n_chars": [max(len(c), 1) for c in choices], "n_bytes": [max(len(c.encode("utf-8")), 1) for c in choices],
            "lm_eval": {k: float(row[k]) for k in SAMPLES_NORMALIZATIONS if isinstance(row.get(k), (int, float))},
        })
    info = {"normalize": "sum", "source": str(path), "target_delimiter": target_delimiter}
    return ScoredSet(logits, labels, [name] * len(ids), ids, SCORER, info, details)


def _normalizations(scored: ScoredSet, n_bins: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, mode in SAMPLES_NORMALIZATIONS.items():
        out[name] = normalization_metrics(scored, mode, n_bins)
        logged = [d["lm_eval"][name] for d in scored.details or [] if name in d["lm_eval"]]
        if len(logged) == len(scored):
            # lm-eval's own per-document decisions, for a check of the reading
            out[name]["lm_eval_accuracy"] = float(np.mean(logged))
    return out


def _domain(scored: ScoredSet, normalize: str, temperature: float | None, n_bins: int,
            ci: bool, n_resamples: int, seed: int) -> DomainResult:
    head = normalized(scored, normalize)

    def summary(s: ScoredSet) -> tuple[dict[str, float], dict[str, list[float]]]:
        m = s.summary(n_bins=n_bins, ci=ci, n_resamples=n_resamples, seed=seed)
        return m, metrics.reliability_bins(s.confidences, s.correct, n_bins=n_bins).to_dict()

    unc, rb = summary(head)
    scaled = rb_scaled = None
    if temperature is not None:
        scaled, rb_scaled = summary(head.scaled(temperature))
    return DomainResult(scored.domains[0], "multiple_choice", unc, scaled, rb, rb_scaled, head,
                        normalizations=_normalizations(scored, n_bins))


def samples_result(
    paths: Sequence[str | os.PathLike[str]], *, normalize: str = "sum", temperature_fit: str | None = None,
    target_delimiter: str = " ", n_bins: int = 10, ci: bool = True, n_resamples: int = 1000, seed: int = 0,
) -> EvaluationResult:
    """The calibration report (:func:`llm_calib.evaluation.report.write_report`) of lm-eval samples files, one domain per task.

    Args:
        paths: ``samples_<task>_<date>.jsonl`` files of multiple-choice tasks (one task each).
        normalize: the headline scores, ``"sum"`` / ``"char"`` / ``"byte"`` or lm-eval's names
            (all three are reported side by side under ``normalizations``).
        temperature_fit: a task among ``paths`` (then scaled in-sample) or another samples file:
            one temperature fitted on it under ``normalize`` is applied to every task.
        target_delimiter: see :func:`read_samples`.
        n_bins: ECE and reliability bins.
        ci: bootstrap intervals (``n_resamples`` resamples, ``seed``).

    Raises:
        ValueError: no paths, two files of one task, an unknown normalisation or fit task, or a
            file :func:`read_samples` rejects.

    Example:
        >>> import json, tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> rows = [{"doc_id": i, "target": str(i % 2), "filtered_resps": [[str(-1.0 - i), "False"],
        ...          ["-1.5", "False"]], "arguments": {"gen_args_0": {"arg_0": "Q", "arg_1": " a"},
        ...          "gen_args_1": {"arg_0": "Q", "arg_1": " bb"}}} for i in range(4)]
        >>> p = d / "samples_toy_2026-01-02T10-11-12.5.jsonl"
        >>> _ = p.write_text("".join(json.dumps(r) + "\\n" for r in rows))
        >>> res = samples_result([p], ci=False, temperature_fit="toy")
        >>> res.domains["toy"].n, res.domains["toy"].uncalibrated["accuracy"]
        (4, 0.75)
        >>> sorted(res.domains["toy"].normalizations), res.temperature.source
        (['acc', 'acc_bytes', 'acc_norm'], 'toy')
    """
    if not paths:
        raise ValueError("no samples files given")
    mode = SAMPLES_NORMALIZATIONS.get(normalize, normalize)
    if mode not in SAMPLES_NORMALIZATIONS.values():
        raise ValueError(
            f"normalize must be one of {tuple(SAMPLES_NORMALIZATIONS.values())} or "
            f"{tuple(SAMPLES_NORMALIZATIONS)} (lm-eval logs no token counts), got {normalize!r}"
        )
    sets: dict[str, ScoredSet] = {}
    files: dict[str, str] = {}
    for p in paths:
        s = read_samples(p, target_delimiter=target_delimiter)
        name = s.domains[0]
        if name in sets:
            raise ValueError(f"two samples files of task {name!r}: {files[name]} and {p}")
        sets[name], files[name] = s, str(p)
    fit = None
    if temperature_fit is not None:
        if temperature_fit in sets:
            fit_set = sets[temperature_fit]
        elif Path(temperature_fit).is_file():
            fit_set = read_samples(temperature_fit, target_delimiter=target_delimiter)
        else:
            raise ValueError(f"temperature_fit {temperature_fit!r} is neither a task among {sorted(sets)} nor a file")
        fit = TemperatureFit.fit(normalized(fit_set, mode), temperature_fit)
    stats = {"n_bins": n_bins, "ci": ci, "n_resamples": n_resamples, "seed": seed}
    domains = {name: _domain(s, mode, fit.temperature if fit else None, **stats) for name, s in sets.items()}
    config = {"source": "lm-eval samples", "scorer": SCORER, "files": files, "normalize": mode,
              "target_delimiter": target_delimiter, "datasets": list(files.values()), **stats}
    return EvaluationResult(domains, fit, config, {})


def generation_result(
    paths: Sequence[str | os.PathLike[str]], *, equivalence: str = "exact", threshold: float = 0.5,
    estimator: str = "sample_split", splits: int = 10, seed: int = 0, response_regex: str | None = None,
    n_bins: int = 10, ci: bool = True, n_resamples: int = 1000,
) -> Any:
    """The calibration report (:func:`llm_calib.evaluation.report.write_report`) of lm-eval generation runs,
    one domain per task, semantic confidence from each question's sampled responses.

    Args:
        paths: ``samples_<task>_<date>.jsonl`` files of ``generate_until`` tasks run with ``repeats``.
        equivalence: ``"exact"`` or ``"f1"`` (:func:`~llm_calib.confidence.lm_eval_generations.read_generation_samples`).
        threshold: for ``"f1"``.
        estimator: ``"sample_split"`` or ``"plug_in"``.
        splits: R, the sample splits.
        seed: seeds the splits and the bootstrap.
        response_regex: per-response extraction (see :func:`~llm_calib.confidence.lm_eval_generations.read_generation_samples`).
        n_bins: ECE and reliability bins.
        ci: bootstrap intervals (``n_resamples`` resamples).

    Returns:
        An :class:`~llm_calib.evaluation.evaluate.EvaluationResult` (no temperature: lm-eval logs no scores to scale).

    Raises:
        ValueError: no paths, two files of one task, or a file :func:`~llm_calib.confidence.lm_eval_generations.read_generation_samples` rejects.

    Example:
        >>> import json, tempfile, pathlib
        >>> rows = [{"doc_id": i, "target": "4", "arguments": [["2+2=", {"until": ["\\n"]}]],
        ...          "resps": [["4", "4", "5"] if i else ["3", "3", "3"]], "filtered_resps": ["4"]} for i in range(2)]
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "samples_math_2026-01-02T10-11-12.5.jsonl"
        >>> _ = p.write_text("".join(json.dumps(r) + "\\n" for r in rows))
        >>> r = generation_result([p], estimator="plug_in", ci=False).domains["math"]
        >>> r.n, r.uncalibrated["accuracy"], round(r.uncalibrated["ece"], 3)
        (2, 0.5, 0.667)
    """
    from llm_calib.confidence.kinds import OpenConfidence
    from llm_calib.formats.open_ended import OpenEnded

    if not paths:
        raise ValueError("no samples files given")
    confidence = OpenConfidence("semantic", seed=seed, equivalence=equivalence, threshold=threshold,
                                estimator=estimator, splits=splits)
    task = OpenEnded(confidence=confidence)
    sets: dict[str, SampledSet] = {}
    files: dict[str, str] = {}
    for p in paths:
        s = read_generation_samples(p, equivalence=equivalence, threshold=threshold, estimator=estimator,
                                    splits=splits, seed=seed, response_regex=response_regex)
        name = s.domains[0]
        if name in sets:
            raise ValueError(f"two samples files of task {name!r}: {files[name]} and {p}")
        sets[name], files[name] = s, str(p)
    stats = {"n_bins": n_bins, "ci": ci, "n_resamples": n_resamples, "seed": seed}
    domains = {name: domain_result(name, task, s, None, **stats) for name, s in sets.items()}
    config = {"source": "lm-eval samples (generate_until)", "files": files, "confidence": confidence.to_dict(),
              "datasets": list(files.values()), **stats}
    if response_regex is not None:
        config["response_regex"] = response_regex
    return EvaluationResult(domains, None, config, {})
