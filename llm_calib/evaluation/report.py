"""Writing evaluation results: ``metrics.json``, ``report.md`` and a reliability diagram per domain
(:func:`plot_reliability`; uncalibrated and temperature-scaled side by side).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from llm_calib.evaluation.evaluate import HEADLINE_METRICS, EvaluationResult
from llm_calib.files.atomic import atomic_path, write_json_atomic, write_text_atomic
from llm_calib.formats import family_format

__all__ = [
    "METRIC_LABELS",
    "REPORT_METRICS",
    "context_lines",
    "domain_table",
    "format_metric",
    "jsonable",
    "markdown_report",
    "mean_of_domains",
    "merged_specs_lines",
    "metrics_table",
    "plot_reliability",
    "reliability_filename",
    "setting_line",
    "write_report",
]

METRIC_LABELS: dict[str, str] = {
    "accuracy": "Accuracy", "ece": "ECE", "adaptive_ece": "AECE", "brier": "Brier", "nll": "NLL", "auroc": "AUROC",
    "ece15": "ECE-15", "classwise_ece": "class-wise ECE", "mce": "MCE", "mean_entropy": "mean entropy",
    "mean_confidence": "mean confidence",
}
"""Row labels of the report tables."""

REPORT_METRICS: tuple[str, ...] = (*HEADLINE_METRICS, "ece15", "classwise_ece", "mce", "mean_entropy", "mean_confidence")
"""The rows of a domain's table in ``report.md``: the headline metrics (with bootstrap
intervals), then ECE with 15 bins, class-wise ECE, MCE, mean entropy (nats) and mean confidence."""


def jsonable(obj: Any) -> Any:
    """``obj`` (dicts, lists, tuples, Python/numpy/0-d tensor numbers, strings, None; anything else as
    its ``str``) in strict-JSON types, NaN and infinities as ``None``.

    Example:
        >>> import numpy as np
        >>> jsonable({"a": np.float64("nan"), "b": [np.int64(2), 0.5]})
        {'a': None, 'b': [2, 0.5]}
    """
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 1) == 0:
        obj = obj.item()
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, str | int | bool):
        return obj
    return str(obj)


def format_metric(metrics: dict[str, float] | None, name: str, digits: int = 3) -> str:
    """``value [low, high]`` of metric ``name`` in a metric dict (the interval from ``<name>_ci_low`` /
    ``<name>_ci_high`` when both are present; ``n/a`` when missing or NaN).

    Example:
        >>> format_metric({"ece": 0.1234, "ece_ci_low": 0.1, "ece_ci_high": 0.15}, "ece")
        '0.123 [0.100, 0.150]'
    """
    if not metrics:
        return "n/a"
    v = metrics.get(name)
    if v is None or not math.isfinite(v):
        return "n/a"
    text = f"{v:.{digits}f}"
    lo, hi = metrics.get(f"{name}_ci_low"), metrics.get(f"{name}_ci_high")
    if lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi):
        text += f" [{lo:.{digits}f}, {hi:.{digits}f}]"
    return text


def metrics_table(columns: list[tuple[str, dict[str, float] | None]], metrics: tuple[str, ...] = HEADLINE_METRICS) -> str:
    """Markdown table: one row per metric (labelled by :data:`METRIC_LABELS`), one column per
    ``(header, metric dict)`` (None shows ``n/a``).

    Example:
        >>> print(metrics_table([("before", {"accuracy": 0.5}), ("after", {"accuracy": 0.6})],
        ...                     metrics=("accuracy",)))
        | metric | before | after |
        |---|---|---|
        | Accuracy | 0.500 | 0.600 |
    """
    lines = ["| metric | " + " | ".join(label for label, _ in columns) + " |", "|---|" + "---|" * len(columns)]
    for m in metrics:
        cells = " | ".join(format_metric(values, m) for _, values in columns)
        lines.append(f"| {METRIC_LABELS.get(m, m)} | {cells} |")
    return "\n".join(lines)


def domain_table(uncalibrated: dict[str, float], scaled: dict[str, float] | None = None) -> str:
    """:func:`metrics_table` of every :data:`REPORT_METRICS` row of one domain, uncalibrated and (if
    given) temperature-scaled.

    Example:
        >>> domain_table({"accuracy": 0.5}).splitlines()[:3]
        ['| metric | uncalibrated |', '|---|---|', '| Accuracy | 0.500 |']
    """
    columns: list[tuple[str, dict[str, float] | None]] = [("uncalibrated", uncalibrated)]
    if scaled is not None:
        columns.append(("temperature-scaled", scaled))
    return metrics_table(columns, metrics=REPORT_METRICS)


def setting_line(key: str, value: Any) -> str:
    """One ``- key: `value``` line of a report's settings (a dict as ``k=v`` pairs, a list
    comma-separated): how ``evaluate``'s and ``calibrate``'s reports show the resolved prompt.

    Example:
        >>> setting_line("prompt", {"template": "Q: {question}", "fewshot": 2})
        "- prompt: `template='Q: {question}', fewshot=2`"
    """
    if isinstance(value, dict):
        value = ", ".join(f"{k}={v!r}" for k, v in value.items())
    elif isinstance(value, list | tuple):
        value = ", ".join(str(v) for v in value)
    return f"- {key}: `{value}`"


def merged_specs_lines(merged: list[dict[str, str]]) -> list[str]:
    """The report lines of data specs given twice and counted once (``merged_specs`` of a run's config).

    Example:
        >>> merged_specs_lines([{"flag": "--data", "spec": "x.jsonl", "same_as": "./x.jsonl"}])
        ['- merged: `--data x.jsonl` holds the questions of `--data ./x.jsonl`: counted once']
    """
    return [f"- merged: `{m['flag']} {m['spec']}` holds the questions of `{m['flag']} {m['same_as']}`: counted once"
            for m in merged]


def context_lines(context: dict[str, Any] | None) -> list[str]:
    """The report line of the questions cut to fit the model's context (``context`` of a run's
    config, :meth:`~llm_calib.engine.context.ContextWindow.summary`); none when nothing was cut.

    Example:
        >>> context_lines({"limit": 512, "on_overflow": "truncate", "truncated": 2, "truncated_examples": ["q1", "q4"]})
        ["- context: 2 question(s) longer than the model's 512 tokens cut from the left to fit (q1, q4)"]
    """
    if not context or not context.get("truncated"):
        return []
    shown = ", ".join(context.get("truncated_examples", [])) + (", ..." if context["truncated"] > 5 else "")
    return [f"- context: {context['truncated']} question(s) longer than the model's {context['limit']} tokens cut "
            f"from the left to fit ({shown})"]


def mean_of_domains(rows: list[dict[str, float] | None], metrics: tuple[str, ...] = REPORT_METRICS) -> dict[str, float]:
    """The unweighted mean over domains of each metric (NaN where no domain has it), for a
    report's overall row or table.

    Example:
        >>> mean_of_domains([{"ece": 0.1, "mce": 0.3}, {"ece": 0.3}, None], ("ece", "mce", "nll"))
        {'ece': 0.2, 'mce': 0.3, 'nll': nan}
    """
    present = [r for r in rows if r]
    out = {}
    for m in metrics:
        vals = [float(r[m]) for r in present if r.get(m) is not None and math.isfinite(float(r[m]))]
        out[m] = sum(vals) / len(vals) if vals else math.nan
    return out


def markdown_report(result: EvaluationResult, *, title: str = "Calibration report") -> str:
    """The ``report.md`` text of an evaluation result: settings, temperature fit, a summary, one table per domain.

    Example:
        >>> from llm_calib.evaluation.evaluate import EvaluationResult
        >>> print(markdown_report(EvaluationResult({}, None, {"scorer": "letter"}, {})))
        # Calibration report
        <BLANKLINE>
        - scorer: `letter`
        <BLANKLINE>
    """
    cfg = result.config
    lines = [f"# {title}", ""]
    for key in (
        "model", "adapter", "dtype", "quantization", "device", "scorer", "normalize", "prompt", "datasets",
        "limit", "limit_mode", "n_bins", "seed",
    ):
        value = cfg.get(key)
        if value is not None:
            lines.append(setting_line(key, value))
    if cfg.get("confidence"):  # open answers: how their confidence was read
        lines.append(setting_line("confidence", cfg["confidence"]))
    lines += merged_specs_lines(cfg.get("merged_specs") or [])
    lines += context_lines(cfg.get("context"))
    fit = result.temperature
    if fit is not None:
        lines.append(
            f"- temperature: T = {fit.temperature:.3f}, fitted on `{fit.source}` "
            f"({fit.n} questions, domains {', '.join(fit.domains)}; "
            f"{fit.describe()})"
        )
    if "questions_per_s" in result.timing:
        lines.append(
            f"- scoring time: {result.timing.get('scoring_s', math.nan):.1f} s "
            f"({result.timing['questions_per_s']:.2f} questions/s)"
        )
    lines.append("")
    if result.domains:
        lines += ["## Summary", ""]
        scaled = fit is not None

        def row(label: str, n: int, unc: dict[str, float] | None, ts: dict[str, float] | None) -> str:
            cells = f"| {label} | {n} | {format_metric(unc, 'accuracy')} | {format_metric(unc, 'ece')} |"
            return cells + (f" {format_metric(ts, 'ece')} |" if scaled else "")

        head = "| domain | n | accuracy | ECE |" + (" ECE (T-scaled) |" if scaled else "")
        lines += [head, "|---|---|---|---|" + ("---|" if scaled else "")]
        lines += [row(dom, r.n, r.uncalibrated, r.temperature_scaled) for dom, r in result.domains.items()]
        if len(result.domains) > 1:
            avg = result.macro_average()
            lines.append(row("overall (mean of domains)", sum(r.n for r in result.domains.values()),
                             avg.get("uncalibrated"), avg.get("temperature_scaled")))
        lines.append("")
        if cfg.get("ci", True):  # --bootstrap 0: point estimates alone
            lines.append("Values are point estimates with 95% bootstrap confidence intervals.")
            lines.append("")
    for dom, r in result.domains.items():
        lines += [f"## {dom}", ""]
        task = family_format(r.kind)
        lines.append(f"{r.n} questions, {task.description}.")
        lines += task.domain_notes(r.uncalibrated)
        lines += ["", domain_table(r.uncalibrated, r.temperature_scaled), ""]
        if r.normalizations:
            lines += [
                "Option-score normalisations (lm-eval names; probabilities are the softmax over "
                "the normalised scores):",
                "",
                "| normalisation | divides the log-likelihood by | accuracy | ECE | NLL | Brier |",
                "|---|---|---|---|---|---|",
            ]
            per = {"acc": "1 (sum)", "acc_norm": "characters", "acc_bytes": "bytes", "acc_token": "tokens"}
            for name, m in r.normalizations.items():
                cells = " | ".join(f"{m[k]:.4f}" for k in ("accuracy", "ece", "nll", "brier"))
                lines.append(f"| {name} | {per.get(name, '')} | {cells} |")
            lines.append("")
        lines += [f"![reliability diagram]({reliability_filename(dom)})", ""]
    return "\n".join(lines)


def reliability_filename(domain: str) -> str:
    """``reliability_<domain>.png``, the file name of a domain's reliability diagram (unsafe characters as ``_``).

    Example:
        >>> reliability_filename("mmlu/stem x")
        'reliability_mmlu_stem_x.png'
    """
    return "reliability_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", domain) + ".png"


def plot_reliability(
    panels: list[tuple[str, dict[str, list[float]]]],
    path: str | os.PathLike[str],
    *,
    title: str = "",
    columns: int | None = None,
) -> Path:
    """Draw reliability diagrams (accuracy bars per bin, the gap to the diagonal, a confidence
    histogram underneath) to a PNG and return its path.

    Args:
        panels: ``(label, bins)`` pairs, ``bins`` as :meth:`llm_calib.metrics.calibration.ReliabilityBins.to_dict`.
        path: output file.
        title: figure title.
        columns: panels per row (None: all in one row); more panels wrap onto further rows.

    Raises:
        ValueError: ``columns`` below 1.

    Example:
        >>> import tempfile, os
        >>> bins = {"edges": [0, 0.5, 1], "counts": [2, 3], "mean_confidence": [0.3, 0.8],
        ...         "accuracy": [0.5, 0.6]}
        >>> p = plot_reliability([("raw", bins)], os.path.join(tempfile.mkdtemp(), "r.png"))
        >>> p.stat().st_size > 0
        True
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if columns is not None and columns < 1:
        raise ValueError(f"columns must be at least 1 (or None), got {columns}")
    n = len(panels)
    cols = max(1, min(n, columns or n))
    rows = -(-n // cols)
    fig, axes = plt.subplots(2 * rows, cols, figsize=(4.2 * cols, 5.2 * rows), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1] * rows}, sharex="col")
    for spare in range(n, rows * cols):
        for r in (2 * (spare // cols), 2 * (spare // cols) + 1):
            axes[r, spare % cols].set_visible(False)
    for i, (label, bins) in enumerate(panels):
        edges = np.asarray(bins["edges"], dtype=float)
        counts = np.asarray(bins["counts"], dtype=float)
        acc = np.asarray([np.nan if a is None else a for a in bins["accuracy"]], dtype=float)
        conf = np.asarray([np.nan if c is None else c for c in bins["mean_confidence"]], dtype=float)
        width, left = np.diff(edges), edges[:-1]
        top, bottom = axes[2 * (i // cols), i % cols], axes[2 * (i // cols) + 1, i % cols]
        top.bar(left, np.nan_to_num(acc), width=width, align="edge", color="tab:blue", edgecolor="black",
                alpha=0.8, label="accuracy")
        gap_lo, gap_hi = np.minimum(acc, conf), np.maximum(acc, conf)
        ok = np.isfinite(gap_lo)
        top.bar(left[ok], (gap_hi - gap_lo)[ok], bottom=gap_lo[ok], width=width[ok], align="edge", color="tab:red",
                alpha=0.3, edgecolor="tab:red", label="gap to confidence")
        top.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
        top.set_xlim(0, 1)
        top.set_ylim(0, 1)
        top.set_ylabel("accuracy")
        top.set_title(label)
        top.legend(loc="upper left", fontsize=8)
        bottom.bar(left, counts, width=width, align="edge", color="gray", edgecolor="black")
        bottom.set_xlabel("confidence")
        bottom.set_ylabel("count")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(out) as tmp:  # a full disk leaves no truncated PNG
            fig.savefig(tmp, dpi=100)
    finally:
        plt.close(fig)
    return out


def write_report(
    result: EvaluationResult, out_dir: str | os.PathLike[str], *, title: str = "Calibration report"
) -> dict[str, Path]:
    """Write ``metrics.json``, ``report.md`` and a ``reliability_<domain>.png`` per domain into ``out_dir``
    (created if missing); return the paths by ``"metrics"``, ``"report"``, ``"reliability:<domain>"``.

    Example:
        >>> import tempfile
        >>> from llm_calib.evaluation.evaluate import EvaluationResult
        >>> paths = write_report(EvaluationResult({}, None, {}, {}), tempfile.mkdtemp())
        >>> sorted(paths)
        ['metrics', 'report']
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    metrics_path = out / "metrics.json"
    from llm_calib.version import __version__

    write_json_atomic(metrics_path, jsonable({"llm_calib_version": __version__, **result.to_dict()}), allow_nan=False)
    paths["metrics"] = metrics_path
    report_path = out / "report.md"
    write_text_atomic(report_path, markdown_report(result, title=title) + "\n")
    paths["report"] = report_path
    for dom, r in result.domains.items():
        panels = [("uncalibrated", r.reliability)]
        if r.reliability_scaled is not None and result.temperature is not None:
            panels.append((f"temperature-scaled (T = {result.temperature.temperature:.2f})", r.reliability_scaled))
        acc, ece = r.uncalibrated.get("accuracy", math.nan), r.uncalibrated.get("ece", math.nan)
        title_d = f"{dom} (n = {r.n}, accuracy {acc:.3f}, ECE {ece:.3f})"
        paths[f"reliability:{dom}"] = plot_reliability(panels, out / reliability_filename(dom), title=title_d)
    return paths
