"""benchmarks/implicit_dense.py (Implicit Dense vs CG) on tiny problems: accurate rows, a report."""

from __future__ import annotations

from dataclasses import replace

import pytest
from _benchmarks import load_benchmark

pytest.importorskip("torchopt")


@pytest.fixture(scope="module")
def mods():
    hb = load_benchmark("hypergrad_bench")  # registered first: implicit_dense imports it by name
    return hb, load_benchmark("implicit_dense")


@pytest.mark.filterwarnings("ignore")
def test_solver_rows_are_accurate_and_render(mods) -> None:
    hb, dense = mods
    specs = [{"key": "logistic_d8", "kind": "logistic", "n": 60, "d": 8, "scalar": False, "K": 5},
             {"key": "ridge_feature_d6", "kind": "ridge", "n": 80, "d": 6, "scalar": False, "K": 5}]
    sizes = replace(hb.TINY, repeats=2, min_repeats=1, budget_s=1.0)
    rows = dense.solver_rows(specs, sizes, lambda _: None)
    assert [r["problem"] for r in rows] == ["logistic_d8", "ridge_feature_d6"]
    for r in rows:
        assert r["d"] == int(r["problem"].rsplit("d", 1)[1])
        # Dense solves exactly (float64 round-off); CG stops at tol=1e-6
        assert r["dense_err"] < 1e-12, r
        assert r["cg_err"] < 1e-4, r
        assert r["torchopt_err"] < 1e-4, r
        assert r["cg_ms"] > 0 and r["dense_ms"] > 0 and r["cg_iterations"] >= 1
    mat = dense.materialise_rows(specs[:1], lambda _: None, budget=0.01)
    assert mat[0]["d"] == 8 and all(mat[0][k] > 0 for k in ("hvp", "batched_vjp", "hessian", "gram"))
    vm = dense.vmap_matmul_rows([(20, 4)], budget=0.01)
    result = {"solvers": rows, "materialise": mat, "vmap": vm, "meta": hb.metadata(1),
              "command": "python benchmarks/implicit_dense.py --quick", "summary": dense.summary(rows),
              "elapsed_s": 1.0}
    text = dense.render(result)
    line = next(x for x in text.splitlines() if x.startswith("| logistic_d8 | 8 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert float(cells[5].strip("*")) == pytest.approx(rows[0]["dense_ms"] / rows[0]["cg_ms"], abs=0.006)
    assert "| 20 | 4 |" in text
    assert "of 2 problems" in text
