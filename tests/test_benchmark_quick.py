"""The benchmark's core (benchmarks/hypergrad_bench.py) on tiny sizes: sane numbers, a report."""

from __future__ import annotations

import math

import pytest
import torch
from _benchmarks import load_benchmark

pytest.importorskip("torchopt")
pytest.importorskip("higher")
pytest.importorskip("sklearn")

@pytest.fixture(scope="module")
def bench():
    return load_benchmark("hypergrad_bench")


@pytest.fixture(scope="module")
def result(bench):
    return bench.suite(bench.TINY, threads=1, log=lambda _: None)


def _rows(result, problem=None, family=None, library=None):
    return [
        r for r in result["rows"]
        if (problem is None or r.problem == problem)
        and (family is None or r.family == family)
        and (library is None or r.library == library)
    ]


@pytest.mark.filterwarnings("ignore")
def test_exact_methods_are_accurate_and_peers_agree(result) -> None:
    for problem in ("ridge_scalar", "ridge_feature", "logistic_d50", "clean"):
        for library in ("hypergrad", "torchopt"):
            (cg,) = _rows(result, problem, "implicit-cg", library)
            assert cg.error is not None and cg.error < 1e-4, (problem, library, cg.error)
        (fd,) = _rows(result, problem, "fd-cg", "hypergrad")
        assert fd.error < 1e-3, (problem, fd.error)
        # same estimator, same number: torchopt's CG, higher and MetaSGD against ours
        for family, library in (("implicit-cg", "torchopt"), ("unrolled-reverse", "higher"),
                                ("unrolled-reverse-metasgd", "torchopt")):
            (peer,) = _rows(result, problem, family, library)
            assert peer.agree is not None and peer.agree < 1e-5, (problem, family, peer.agree)
    # forward and reverse unrolling agree (scalar hyperparameter)
    for problem in ("ridge_scalar", "ksweep_K10"):
        (fwd,) = _rows(result, problem, "unrolled-forward")
        (rev,) = _rows(result, problem, "unrolled-reverse", "hypergrad")
        (ck,) = _rows(result, problem, "unrolled-checkpoint")
        if rev.error is not None:
            assert math.isclose(fwd.error, rev.error, rel_tol=1e-4, abs_tol=1e-9)
            assert math.isclose(ck.error, rev.error, rel_tol=1e-6, abs_tol=1e-12)


@pytest.mark.filterwarnings("ignore")
def test_times_ratios_and_targets_are_finite(result, bench, tmp_path) -> None:
    rows = result["rows"]
    assert len(rows) > 40
    for r in rows:
        assert math.isfinite(r.time_s) and r.time_s > 0, r
        assert math.isfinite(r.geq) and r.geq > 0, r
    # a solve-based hypergradient costs more than one gradient; the unit row is exactly 1
    for r in _rows(result, family="implicit-cg"):
        assert r.geq > 1.5, r
    assert all(r.geq == 1.0 for r in _rows(result, family="unit"))
    ratios = bench.pair_ratios(rows)
    assert {p["pair"] for p in ratios} >= {
        "Implicit CG / torchopt custom_root+solve_cg", "Unrolled reverse / higher"}
    for p in ratios:
        assert math.isfinite(p["time_ratio"]) and 0.01 < p["time_ratio"] < 100, p
    names = [t["target"] for t in bench.targets(rows, result["sizes"])]
    assert any(n.startswith("Implicit CG time") for n in names)
    assert any(n.startswith("Penalty") for n in names)
    acc = {c["name"]: c["test_acc"] for c in result["cleaning"]}
    assert all(0.0 <= a <= 1.0 for a in acc.values())
    assert acc["oracle (clean examples only)"] > acc["no cleaning (all weights 0.5)"]
    text = bench.render(result, tmp_path)
    assert (tmp_path / "hypergrad.md").read_text() == text
    assert (tmp_path / "hypergrad.json").exists()
    assert "## Targets" in text and "| Implicit CG |" in text


@pytest.mark.filterwarnings("ignore")
def test_memory_measurement_of_one_configuration(bench, tmp_path) -> None:
    """The worker's per-configuration measurement (run in-process here)."""
    spec = {"key": "ridge_mem", "kind": "ridge", "n": 60, "d": 8, "scalar": True, "K": 5}
    bench.build_bench(spec, tmp_path)  # fills the cache the worker reads
    config = {"spec": spec, "cache": str(tmp_path), "mode": "tiny", "threads": 1,
              "group": "unrolled-reverse", "name": "Unrolled reverse (K=5)", "K": 5}
    threads = torch.get_num_threads()
    try:
        out = bench._measure_one(config)
    finally:
        torch.set_num_threads(threads)
    assert out["peak_mb"] >= 0.0 and math.isfinite(out["peak_mb"])
    assert out["seconds"] > 0.0
