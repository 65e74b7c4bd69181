"""harness.report (benchmarks/harness): number cells, markdown tables, verdicts and the provenance
lines of a benchmark report."""

from __future__ import annotations

import doctest

from _benchmarks import BENCHMARKS  # noqa: F401  (puts benchmarks/ on sys.path for harness)
from harness import report
from harness.report import (
    format_number,
    machine_info,
    markdown_table,
    mean_sd,
    provenance_lines,
    verdict,
)


def test_number_cells_tables_and_verdicts() -> None:
    assert format_number(0.98765) == "0.988" and format_number(12345, ",") == "12,345"
    assert format_number(None) == format_number(float("inf")) == "n/a" and format_number(float("nan"), missing="-") == "-"
    assert mean_sd([1.0, 2.0, 3.0], 1) == "2.0 ± 1.0" and mean_sd([None, float("nan")]) == "n/a"
    assert mean_sd([0.25, None]) == "0.250"
    assert markdown_table(["a", "b"], [(1, None), ("x", 2.5)]) == ["| a | b |", "|---|---|", "| 1 | None |", "| x | 2.5 |"]
    assert [verdict(True), verdict(False), verdict(None), verdict(None, False)] == ["PASS", "**MISS**", "info", "n/a"]


def test_provenance_lines_name_command_machine_and_a_busy_load() -> None:
    meta = machine_info(1)
    quiet = {**meta, "cores": 64, "load": [0.5, 0.5, 0.5]}
    lines = provenance_lines("python b.py --quick", quiet, mode="quick", elapsed_s=30, load_start=[0.2, 0.1, 0.1])
    assert lines[0] == f"- Command: `python b.py --quick` (quick mode, wall time 0.5 min); date {meta['date']}"
    assert "64 cores, 1 torch threads; load average at the start 0.2, 0.1, 0.1, at the end 0.5, 0.5, 0.5" in lines[1]
    assert "busy" not in lines[1] and lines[2].startswith(f"- Versions: torch {meta['torch']}, transformers ")
    busy = provenance_lines("c", {**quiet, "cores": 2, "load": None}, load_start=[3.0])
    assert busy[0] == f"- Command: `c`; date {meta['date']}" and "at the end ?" in busy[1] and "**busy machine**" in busy[1]


def test_the_docstring_examples_run() -> None:
    """benchmarks/ is outside the doctest paths: its examples run here."""
    results = doctest.testmod(report, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert results.attempted >= 6 and results.failed == 0
