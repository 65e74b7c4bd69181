"""Docstring examples of benchmark-only helpers that moved out of ``llm_calib`` into ``benchmarks/``
(outside the doctest paths): they run here, so the move kept their checks."""

from __future__ import annotations

import doctest

import pytest
from _benchmarks import load_benchmark
from harness import loss_check, selection


@pytest.mark.parametrize("module", [loss_check, selection], ids=lambda m: m.__name__)
def test_harness_module_examples_run(module) -> None:
    results = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert results.attempted >= 3 and results.failed == 0


def test_open_temperature_fit_example_runs() -> None:
    bench = load_benchmark("calibration_bench")
    finder = doctest.DocTestFinder()
    (test,) = finder.find(bench.fit_open_temperature, "fit_open_temperature", globs=vars(bench))
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.summarize(verbose=False).attempted >= 3 and runner.failures == 0
