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
    "SRBA": lambda: hg.SRBA(0.01, period=2, full_inner_batches=[None], full_outer_batches=[None]),
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


def _caught(fn):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [w for w in caught if issubclass(w.category, hg.ConvergenceWarning)]


def test_a_capped_cg_warns_once_per_solve_with_the_count_and_the_worst_residual():
    res, caught = _caught(lambda: _solve(hg.Implicit(hg.linear.CG(maxiter=2, tol=1e-12)), steps=20))
    assert res.unconverged_steps == 20
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert message.startswith("CG: not converged at 20 of 20 outer steps; the worst, at step ")
    assert "relative residual" in message and res.warnings == [message]
    assert caught[0].filename == __file__  # points at the caller of solve


def test_non_positive_curvature_warns_once_per_solve():
    A = torch.diag(torch.tensor([1.0, -1.0, 2.0], dtype=DT))
    g = lambda w, lam, b: 0.5 * w["x"] @ A @ w["x"] - w["x"] @ lam["c"]  # noqa: E731
    f = lambda w, lam, b: (w["x"] ** 2).sum()  # noqa: E731
    _, caught = _caught(lambda: hg.solve(
        hg.BilevelProblem(g, f), {"x": torch.ones(3, dtype=DT)}, {"c": torch.ones(3, dtype=DT)},
        hg.Implicit(hg.linear.CG()), lambda p: torch.optim.SGD(p, lr=1e-3), steps=15, progress=False))
    assert len(caught) == 1 and "non-positive curvature at 15 of 15 outer steps" in str(caught[0].message)


def test_neumann_inside_a_solve_is_counted_over_all_steps():
    method = hg.Implicit(hg.linear.Neumann(steps=2))
    _, first = _caught(lambda: _solve(method, steps=6))
    _, second = _caught(lambda: _solve(method, steps=6))  # the same instance: counted again
    for caught in (first, second):
        assert len(caught) == 1 and "Neumann: not converged at 6 of 6 outer steps" in str(caught[0].message)


def test_a_single_call_outside_solve_still_warns_once_per_kind():
    w, lam = _start()
    method = hg.Implicit(hg.linear.CG(maxiter=2, tol=1e-12))
    for _ in range(2):  # every call warns (once)
        _, caught = _caught(lambda: method.hypergrad(QUAD.problem(), w, lam))
        assert len(caught) == 1 and str(caught[0].message).startswith("CG: not converged after 2 iterations")


def test_warnings_gathered_before_an_error_are_still_reported():
    calls = []

    def f(w, lam, b):
        calls.append(1)
        return QUAD.problem().outer(w, lam, b) * (float("nan") if len(calls) > 3 else 1.0)

    problem = hg.BilevelProblem(QUAD.problem().inner, f)
    w, lam = _start()
    with (pytest.warns(hg.ConvergenceWarning, match="CG: not converged at 3 of 4 outer steps"),
          pytest.raises(hg.NonFiniteError, match=r"^outer step 3, Implicit.hypergrad \(f, the outer loss\): "
                                                 r"outer loss is nan")):
        hg.solve(problem, w, lam, hg.Implicit(hg.linear.CG(maxiter=1, tol=1e-12)), steps=5, progress=False,
                 outer_loss_every=0)


def test_non_finite_error_names_the_outer_step_and_the_function():
    def g(w, lam, b):
        x = w["w"]
        return 0.5 * (x ** 2).sum() - x @ QUAD.B @ lam["lam"] + (float("inf") if float(x.detach().abs().sum()) > 1e3 else 0.0)

    problem = hg.BilevelProblem(g, QUAD.problem().outer)
    _, lam = _start()
    with pytest.raises(hg.NonFiniteError, match=r"^outer step 0, the plain inner steps \(g, the inner loss\): inner loss"):
        hg.solve(problem, {"w": torch.full((6,), 1e3, dtype=DT)}, lam, hg.Implicit(), steps=2, inner_steps=2,
                 inner_optimizer=hg.inner.SGD(0.1), progress=False)


def test_progress_without_tqdm_says_once_that_it_needs_tqdm():
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import sys, warnings\n"
        "sys.modules['tqdm'] = sys.modules['tqdm.auto'] = None  # as if tqdm were not installed\n"
        "warnings.simplefilter('always')\n"
        "import torch, hypergrad as hg\n"
        "g = lambda w, lam, b: 0.5 * ((w['x'] - lam['c']) ** 2).sum()\n"
        "args = (hg.BilevelProblem(g, g), {'x': torch.zeros(1)}, {'c': torch.ones(1)}, hg.Implicit())\n"
        "with warnings.catch_warnings(record=True) as quiet:\n"
        "    hg.solve(*args, steps=2, progress=False)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    hg.solve(*args, steps=2)\n"
        "    hg.solve(*args, steps=2, progress=True)\n"
        "print(len(quiet), len(caught), caught[0].filename if caught else '', caught[0].message if caught else '')\n"
    )
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    quiet, caught, filename, message = run.stdout.strip().split(" ", 3)
    assert (quiet, caught, filename) == ("0", "1", "<string>"), run.stdout
    assert message.startswith("progress=True shows a progress bar only with tqdm installed (pip install tqdm)")


def test_unconverged_steps_counts_linear_solves_only():
    # BOME's value-function gap and Penalty's residuals stay above their tolerances during a run by design:
    # history["converged"] records that, unconverged_steps (the linear solves that stopped short) does not
    for method, test in ((hg.BOME(hg.inner.SGD(0.1), w_lr=0.01, inner_steps=2, tol=0.0), "value-function gap"),
                         (hg.Penalty(0.1, hg.inner.SGD(0.1), inner_steps=2, tol=0.0), "inner residuals")):
        res = _solve(method, steps=4)
        assert res.history["converged"].count(0.0) >= 1 and res.unconverged_steps == 0, test
        w, lam = _start()
        assert method.hypergrad(QUAD.problem(), w, lam).info.stopping_test == test
    w, lam = _start()
    assert hg.Implicit().hypergrad(QUAD.problem(), w, lam).info.stopping_test == "linear solve"
    assert hg.Unrolled(hg.inner.SGD(0.01), steps=2).hypergrad(QUAD.problem(), w, lam).info.stopping_test is None


def test_the_docs_name_every_method_without_a_stopping_test():
    import inspect
    from pathlib import Path

    names = {name.split()[0] for name in WITHOUT_A_TEST}
    assert "SRBA" in names
    listed_in = {
        "HypergradInfo": " ".join(inspect.getdoc(hg.HypergradInfo).split()),
        "bilevel.md": " ".join((Path(__file__).parents[1] / "docs/methods/bilevel.md").read_text().split()),
    }
    for where, text in listed_in.items():
        start = text.index("no stopping test" if where == "HypergradInfo" else "no such test")
        none_part = text[start:start + 300]  # the sentence listing the methods without a test
        missing = [name for name in sorted(names) if f"``{name}" not in none_part and f"`{name}" not in none_part]
        assert not missing, (where, missing)
