"""Report writing: strict JSON, markdown tables with CIs, reliability PNGs."""

from __future__ import annotations

import json
import math

import pytest

from llm_calib.data import builtin_multiple_choice
from llm_calib.evaluation.evaluate import EvaluationResult, evaluate_records
from llm_calib.evaluation.report import (
    domain_table,
    format_metric,
    jsonable,
    markdown_report,
    plot_reliability,
    reliability_filename,
    write_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def result(tiny) -> EvaluationResult:
    model, tok = tiny
    recs = builtin_multiple_choice(5, domains=["capitals", "chemical_symbols"])
    fit = builtin_multiple_choice(5, seed=3, domains=["arithmetic"])
    return evaluate_records(
        model, tok, [("builtin", recs)], temperature_fit=("fit", fit), n_resamples=30
    )


def test_write_report_files(result, tmp_path):
    paths = write_report(result, tmp_path / "out")
    names = sorted(p.name for p in paths.values())
    assert names == [
        "metrics.json",
        "reliability_capitals.png",
        "reliability_chemical_symbols.png",
        "report.md",
    ]
    for p in paths.values():
        assert p.stat().st_size > 0
    assert paths["reliability:capitals"].read_bytes()[:8] == PNG_MAGIC
    data = json.loads(paths["metrics"].read_text())  # strict JSON (NaN written as null)
    assert data["domains"]["capitals"]["uncalibrated"]["accuracy"] == pytest.approx(
        result.domains["capitals"].uncalibrated["accuracy"]
    )
    assert data["temperature"]["temperature"] == pytest.approx(result.temperature.temperature)


def test_markdown_has_a_table_per_domain_with_both_columns(result):
    text = markdown_report(result)
    assert "## capitals" in text and "## chemical_symbols" in text
    assert text.count("| metric | uncalibrated | temperature-scaled |") == 2
    for label in ("Accuracy", "ECE", "AECE", "Brier", "NLL", "AUROC"):
        assert sum(line.startswith(f"| {label} |") for line in text.splitlines()) == 2
    acc = result.domains["capitals"].uncalibrated
    assert format_metric(acc, "accuracy") in text
    assert "fitted on `fit`" in text and "reliability_capitals.png" in text


def test_format_metric_and_table():
    m = {"ece": 0.25, "ece_ci_low": 0.2, "ece_ci_high": 0.3, "nll": float("nan")}
    assert format_metric(m, "ece") == "0.250 [0.200, 0.300]"
    assert format_metric(m, "nll") == "n/a" and format_metric(None, "ece") == "n/a"
    assert format_metric({"brier": 0.5}, "brier") == "0.500"
    table = domain_table(m, {"ece": 0.1}).splitlines()
    assert table[0] == "| metric | uncalibrated | temperature-scaled |"
    assert "| ECE | 0.250 [0.200, 0.300] | 0.100 |" in table


def test_jsonable_and_filenames():
    assert jsonable({"a": (1, float("inf")), 2: None}) == {"a": [1, None], "2": None}
    assert reliability_filename("a b/c") == "reliability_a_b_c.png"


def test_plot_with_empty_bins(tmp_path):
    nan = math.nan
    bins = {
        "edges": [0, 0.5, 1],
        "counts": [0, 4],
        "mean_confidence": [nan, 0.9],
        "accuracy": [nan, 0.25],
    }
    p = plot_reliability([("a", bins), ("b", bins)], tmp_path / "x.png", title="t")
    assert p.read_bytes()[:8] == PNG_MAGIC


def test_plot_wraps_panels_into_rows_of_columns(tmp_path):
    from PIL import Image

    bins = {"edges": [0, 0.5, 1], "counts": [1, 1], "mean_confidence": [0.3, 0.8], "accuracy": [0.0, 1.0]}
    one_row = Image.open(plot_reliability([("p", bins)] * 5, tmp_path / "row.png")).size
    wrapped = Image.open(plot_reliability([("p", bins)] * 5, tmp_path / "grid.png", columns=2)).size
    assert wrapped[0] < one_row[0] / 2 and wrapped[1] > 2.5 * one_row[1]  # 2 columns, 3 rows
    with pytest.raises(ValueError, match="columns must be at least 1"):
        plot_reliability([("p", bins)], tmp_path / "bad.png", columns=0)
