"""The measured table of docs/methods/choosing.md is in its Markdown source and is the committed
benchmark report (benchmarks/results/hypergrad.md), so it cannot go stale unseen."""

from __future__ import annotations

import doctest
from pathlib import Path

from _benchmarks import load_harness

ROOT = Path(__file__).resolve().parent.parent


def test_the_choosing_guide_carries_the_committed_benchmark_report() -> None:
    report = load_harness("hypergrad_report")
    guide = (ROOT / "docs" / "methods" / "choosing.md").read_text()
    committed = (ROOT / "benchmarks" / "results" / "hypergrad.md").read_text()
    assert guide.count(report.GUIDE_BEGIN) == 1 and guide.count(report.GUIDE_END) == 1
    block = guide.split(report.GUIDE_BEGIN + "\n", 1)[1].split(report.GUIDE_END, 1)[0]
    assert "| target | where | measured | limit | result | note |" in block  # the table itself
    assert block == report.guide_block(committed) + ("" if committed.endswith("\n") else "\n"), (
        "docs/methods/choosing.md is stale: rerun the benchmark, or copy the report with "
        "harness.hypergrad_report.sync_guide (benchmarks/harness/hypergrad_report.py)")
    assert report.sync_guide(guide, committed) == guide


def test_the_copy_examples_run() -> None:
    report = load_harness("hypergrad_report")
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for fn in (report.guide_block, report.sync_guide):
        for test in doctest.DocTestFinder().find(fn, fn.__name__, globs=vars(report)):
            runner.run(test)
    assert runner.summarize(verbose=False).attempted == 2 and runner.failures == 0
