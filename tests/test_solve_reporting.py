"""What a solve reports: ``info.converged`` only when something was checked, the count of
unconverged steps, warnings once per solve, errors that name the outer step."""

from __future__ import annotations

import math

import pytest
import torch

import hypergrad as hg
from tests._problems import DT, Quadratic

QUAD = Quadratic.random(6, 2, cond=50.0, seed=0)


def _start():
    return {"w": torch.zeros(6, dtype=DT)}, {"lam": torch.zeros(2, dtype=DT)}


def _solve(method, steps=5, **kwargs):
    w, lam = _start()
    args = {"steps": steps, "progress": False, "outer_optimizer": lambda p: torch.optim.SGD(p, lr=1e-3)} | kwargs
    return hg.solve(QUAD.problem(), w, lam, method, **args)


WITHOUT_A_TEST = {
    "Unrolled": lambda: hg.Unrolled(hg.inner.SGD(0.01), steps=3),
    "FiniteDifference identity": lambda: hg.FiniteDifference(solver="identity", xi=0.01),
    "SOBA": lambda: hg.SOBA(0.01),
    "SABA": lambda: hg.SABA(0.01, n_inner=1, n_outer=1),
    "AmIGO": lambda: hg.AmIGO(0.01, inner_steps=2, linear_steps=2),
    "StocBiO": lambda: hg.StocBiO(0.01, inner_steps=2, neumann_steps=2),
}


@pytest.mark.parametrize("name", sorted(WITHOUT_A_TEST))
def test_a_method_without_a_stopping_test_reports_converged_none(name):
    method = WITHOUT_A_TEST[name]()
    w, lam = _start()
    batch = (0, None) if name == "SABA" else None
    r = method.hypergrad(QUAD.problem(), w, lam, batch, batch)
    assert r.info.converged is None, name
    if name != "SABA":  # SABA's batches need an index; checked through hypergrad() above
        res = _solve(method, steps=3)
        assert all(math.isnan(c) for c in res.history["converged"]) and res.unconverged_steps == 0


def test_a_method_with_a_test_reports_its_outcome():
    w, lam = _start()
    ok = hg.Implicit(hg.linear.Dense()).hypergrad(QUAD.problem(), w, lam)
    assert ok.info.converged is True
    with pytest.warns(hg.ConvergenceWarning):
        capped = hg.Implicit(hg.linear.CG(maxiter=1, tol=1e-12)).hypergrad(QUAD.problem(), w, lam)
    assert capped.info.converged is False


def test_the_solve_counts_the_steps_whose_linear_solve_did_not_converge():
    with pytest.warns(hg.ConvergenceWarning):
        res = _solve(hg.Implicit(hg.linear.CG(maxiter=1, tol=1e-12)), steps=4)
    assert res.unconverged_steps == 4 and res.history["converged"] == [0.0] * 4
    exact = _solve(hg.Implicit(hg.linear.Dense()), steps=4)
    assert exact.unconverged_steps == 0 and exact.history["converged"] == [1.0] * 4
