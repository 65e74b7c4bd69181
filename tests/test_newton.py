"""hg.inner.Newton and L-BFGS's strong Wolfe line search: closed forms, convergence rates, step counts
against SciPy and PyTorch.

The wine problem: a multinomial logistic regression on scikit-learn's wine data (178 samples, 13
standardized features, 3 classes; weights W (3 x 13) and biases b), with a per-feature L2 penalty
exp(lam_j) = exp(-4) on W's columns: smooth, strongly convex, and condition number in the
hundreds, so L-BFGS takes a few dozen steps and its line search matters near the minimum.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from _benchmarks import BENCHMARKS  # noqa: F401  (puts benchmarks/ on sys.path for harness)
from harness import inner_problems

import hypergrad as hg
from hypergrad.line_search import strong_wolfe

DT = torch.float64


def _wine(log_l2: float = -4.0):
    pytest.importorskip("sklearn.datasets")
    return inner_problems.wine(log_l2)


def _norms(problem, w, lam, optimizer, steps, tol=0.0):
    """The gradient norm before and after each step (one inner_solve step at a time)."""
    state, norms = None, []
    for _ in range(steps):
        out = hg.inner_solve(problem, w, lam, 1, optimizer, opt_state=state, tol=tol)
        norms.append(out.grad_norm)
        if out.converged:
            return norms, w
        w, state = out.w, out.state
    norms.append(hg.inner_solve(problem, w, lam, 0, optimizer, tol=0.0).grad_norm)
    return norms, w


def _scipy_lbfgsb(problem, w0, lam):
    """SciPy's L-BFGS-B (history 10, as ours) asked for a gradient norm of 1e-10; its iteration count and the
    gradient norm it stopped at."""
    optimize = pytest.importorskip("scipy.optimize")
    keys, shapes = list(w0), [v.shape for v in w0.values()]
    sizes = [v.numel() for v in w0.values()]

    def fun(x):
        parts = torch.tensor(x, dtype=DT).split(sizes)
        w = {k: p.reshape(s).requires_grad_(True) for k, p, s in zip(keys, parts, shapes, strict=True)}
        value = problem.inner(w, lam, None)
        grads = torch.autograd.grad(value, list(w.values()))
        return float(value), torch.cat([gr.reshape(-1) for gr in grads]).numpy()

    result = optimize.minimize(fun, np.zeros(sum(sizes)), jac=True, method="L-BFGS-B",
                               options={"gtol": 1e-10, "ftol": 0.0, "maxiter": 5000, "maxcor": 10})
    return result.nit, float(np.linalg.norm(fun(result.x)[1]))


# ------------------------------------------------------------------------------------ L-BFGS


def test_lbfgs_reaches_1e_10_on_the_wine_problem_within_1_2_times_scipys_iterations():
    problem, w0, lam = _wine()
    ours = hg.inner_solve(problem, w0, lam, 500, hg.inner.LBFGS(), tol=1e-10)
    scipy_steps, scipy_norm = _scipy_lbfgsb(problem, w0, lam)
    torch_run = inner_problems.torch_lbfgs(problem, w0, lam)
    torch_steps, torch_norm = torch_run["steps"], torch_run["grad_norm"]
    backtracking = hg.inner_solve(problem, w0, lam, 500, hg.inner.LBFGS(line_search="armijo"), tol=1e-10)
    print(f"wine problem, steps to |grad| <= 1e-10: hypergrad L-BFGS (strong Wolfe) {ours.steps}; SciPy L-BFGS-B "
          f"{scipy_steps} (stopped at {scipy_norm:.1e}); torch LBFGS strong Wolfe {torch_steps} (stopped at "
          f"{torch_norm:.1e}); hypergrad backtracking {backtracking.steps}")
    assert ours.converged and ours.grad_norm <= 1e-10
    assert ours.steps <= 1.2 * scipy_steps, (ours.steps, scipy_steps)  # measured 36 vs 32
    assert ours.steps < torch_steps and ours.steps < backtracking.steps  # measured 81 and 104


def test_lbfgs_strong_wolfe_reaches_the_ridge_closed_form():
    gen = torch.Generator().manual_seed(3)
    X, y = torch.randn(50, 8, generator=gen, dtype=DT), torch.randn(50, generator=gen, dtype=DT)
    g = lambda w, lam, b: 0.5 * ((X @ w["x"] - y) ** 2).mean() + 0.5 * lam["l2"] * (w["x"] ** 2).sum()  # noqa: E731
    lam = {"l2": torch.tensor(0.05, dtype=DT)}
    out = hg.inner_solve(hg.BilevelProblem(g, g), {"x": torch.zeros(8, dtype=DT)}, lam, 100, hg.inner.LBFGS(), tol=1e-13)
    exact = torch.linalg.solve(X.T @ X / 50 + 0.05 * torch.eye(8, dtype=DT), X.T @ y / 50)
    assert out.converged and torch.allclose(out.w["x"], exact, atol=1e-12, rtol=0)
    assert out.steps <= 25  # measured 18 (Wolfe steps are inexact: no finite termination on a quadratic)


def test_the_update_without_a_search_still_matches_torch():
    # update() (unrolled, no search) keeps PyTorch's pair rule; the relative rule is the search's
    problem, w0, lam = inner_problems.logistic(n=40, d=4)
    opt = hg.inner.LBFGS(lr=0.5, history_size=3, line_search=None)
    params = [v.clone().requires_grad_(True) for v in w0.values()]
    reference = torch.optim.LBFGS(params, lr=0.5, history_size=3, max_iter=1, tolerance_grad=-1, tolerance_change=-1)
    w, state = dict(w0), opt.init(w0)
    for _ in range(6):
        reference.step(inner_problems.lbfgs_closure(reference, problem, w0, params, lam))
        _, grad, _ = hg.autodiff.inner_grads(problem, None, w, lam)
        w, state = opt.update(w, grad, state)
    for (k, v), p in zip(w.items(), params, strict=True):
        assert torch.allclose(v, p.detach(), atol=1e-10), k


def test_line_search_options():
    assert hg.inner.LBFGS().line_search == "strong_wolfe"
    assert hg.inner.LBFGS(line_search=True).line_search == "strong_wolfe"
    assert hg.inner.LBFGS(line_search=False).line_search is None
    with pytest.raises(ValueError, match="line_search must be 'strong_wolfe', 'armijo' or None"):
        hg.inner.LBFGS(line_search="wolfe")
    with pytest.raises(ValueError, match=r"c2 must be in \(c1, 1\)"):
        hg.inner.LBFGS(c2=1e-5)


# ------------------------------------------------------------------------------ line search


def test_strong_wolfe_brackets_and_zooms_to_the_conditions():
    for minimum in (0.01, 0.3, 3.0, 40.0):
        calls: list[float] = []

        def phi(t, m=minimum, calls=calls):
            calls.append(t)
            return (t - m) ** 4 - 2.0 * t, 4.0 * (t - m) ** 3 - 2.0, None

        value0, slope0 = phi(0.0)[:2]
        calls.clear()
        result = strong_wolfe(phi, value0, slope0, 1.0)
        assert result.satisfied and result.evaluations == len(calls) <= 25
        assert result.value <= value0 + 1e-4 * result.step * slope0 and abs(result.slope) <= 0.9 * abs(slope0)


def test_strong_wolfe_decides_by_the_slope_where_values_are_at_rounding():
    # phi's changes (1e-30) are far below its rounding error: after the first evaluation its values read one
    # ulp high, only the slope is informative (as near the minimum of a loss whose gradient norm is 1e-10)
    def make():
        calls = []

        def phi(t):
            calls.append(t)
            return 1.0 + (2.2e-16 if len(calls) > 1 else 0.0), 2e-30 * (t - 2.0), None

        return phi

    value0, slope0 = 1.0, -4e-30
    blind = strong_wolfe(make(), value0, slope0, 0.1)  # values only: the noisy ulp reads as an increase
    assert not blind.satisfied and blind.step == 0.1
    result = strong_wolfe(make(), value0, slope0, 0.1, rounding=16 * 2.2e-16)
    assert result.satisfied and abs(result.slope) <= 0.9 * abs(slope0) and result.step > 0.2


def test_strong_wolfe_backs_off_a_non_finite_step_and_rejects_an_ascent_direction():
    def phi(t):
        if t > 1.0:
            return math.inf, math.nan, None
        return (t - 0.5) ** 2, 2.0 * (t - 0.5), None

    result = strong_wolfe(phi, 0.25, -1.0, 8.0)
    assert result.satisfied and 0.0 < result.step <= 1.0
    with pytest.raises(ValueError, match="descent direction"):
        strong_wolfe(phi, 0.25, 1.0, 1.0)


# ----------------------------------------------------------------------------------- Newton


def test_newton_converges_quadratically_on_a_logistic_problem():
    problem, w0, lam = inner_problems.logistic()
    norms, _ = _norms(problem, w0, lam, hg.inner.Newton(), 20, tol=1e-14)
    print("Newton on logistic regression (n=200, d=20), gradient norm per step:", " ".join(f"{n:.1e}" for n in norms))
    assert norms[-1] <= 1e-14 and len(norms) <= 8  # measured: 6 steps
    ratios = [b / a**2 for a, b in itertools.pairwise(norms) if a < 1e-2 and b > 1e-15]
    assert ratios and max(ratios) < 10.0, ratios  # |g_{k+1}| <= C |g_k|^2 once close
    # and the rate: the digits double (the last steps gain more than the first)
    assert norms[-2] < norms[-3] ** 1.8


def test_newton_cg_steps_and_the_step_count_against_scipy():
    problem, w0, lam = inner_problems.logistic()
    optimize = pytest.importorskip("scipy.optimize")
    keys = list(w0)

    def unflat(x):
        return {"x": torch.tensor(x[:-1], dtype=DT), "c": torch.tensor(x[-1], dtype=DT)}

    def fun(x):
        w = {k: v.requires_grad_(True) for k, v in unflat(x).items()}
        value = problem.inner(w, lam, None)
        grads = torch.autograd.grad(value, [w[k] for k in keys])
        return float(value), torch.cat([gr.reshape(-1) for gr in grads]).numpy()

    def hessp(x, p):
        root = hg.autodiff.RootSystem(problem, unflat(x), lam, None)
        return root.rmatvec_flat(torch.tensor(p, dtype=DT)).numpy()

    scipy_result = optimize.minimize(fun, np.zeros(21), jac=True, hessp=hessp, method="trust-ncg",
                                     options={"gtol": 1e-10})
    dense = hg.inner_solve(problem, w0, lam, 50, hg.inner.Newton(), tol=1e-10)
    cg = hg.inner_solve(problem, w0, lam, 50, hg.inner.Newton(solver=hg.linear.CG(tol=1e-8)), tol=1e-10)
    print(f"logistic regression, Newton steps to |grad| <= 1e-10: Dense {dense.steps}, CG {cg.steps}; SciPy "
          f"trust-ncg {scipy_result.nit}")
    assert dense.converged and cg.converged
    assert dense.steps <= scipy_result.nit and cg.steps <= scipy_result.nit + 1
    assert torch.allclose(cg.w["x"], dense.w["x"], atol=1e-9)


def test_newton_solves_a_quadratic_in_one_step():
    gen = torch.Generator().manual_seed(1)
    M = torch.randn(6, 6, generator=gen, dtype=DT)
    A, b = M @ M.T + torch.eye(6, dtype=DT), torch.randn(6, generator=gen, dtype=DT)
    g = lambda w, lam, batch: 0.5 * w["x"] @ A @ w["x"] - b @ w["x"]  # noqa: E731
    out = hg.inner_solve(hg.BilevelProblem(g, g), {"x": torch.zeros(6, dtype=DT)}, {}, 5, hg.inner.Newton(), tol=1e-12)
    assert out.steps == 1 and torch.allclose(out.w["x"], torch.linalg.solve(A, b), atol=1e-12)


def test_newton_safeguards_a_non_convex_start_and_a_long_step():
    # g = (x^2 - 1)^2 + y^2 starts at x = 0.1, where the Hessian is negative in x: the plain Newton step
    # would climb to the maximum at 0; the damping turns it into a descent direction
    g = lambda w, lam, b: ((w["v"][0] ** 2 - 1.0) ** 2 + w["v"][1] ** 2)  # noqa: E731
    problem = hg.BilevelProblem(g, g)
    out = hg.inner_solve(problem, {"v": torch.tensor([0.1, 1.0], dtype=DT)}, {}, 50, hg.inner.Newton(), tol=1e-12)
    assert out.converged and torch.allclose(out.w["v"].abs(), torch.tensor([1.0, 0.0], dtype=DT), atol=1e-9)
    assert float(out.state["damping"]) < 1e-3  # it fell back once the Hessian was positive definite
    # far from the minimum of a logistic loss the full Newton step overshoots: without the search it
    # diverges, with it the iteration converges (and quadratically once close)
    logistic, w0, lam = inner_problems.logistic()
    far = {"x": torch.full_like(w0["x"], 3.0), "c": torch.tensor(-20.0, dtype=DT)}
    searched = hg.inner_solve(logistic, far, lam, 60, hg.inner.Newton(), tol=1e-10)
    wolfe = hg.inner_solve(logistic, far, lam, 60, hg.inner.Newton(line_search="strong_wolfe"), tol=1e-10)
    plain = hg.inner_solve(logistic, far, lam, 60, hg.inner.Newton(line_search=None), tol=1e-10)
    assert searched.converged and searched.steps <= 12 and wolfe.converged  # measured 10 and 7 steps
    assert not plain.converged and plain.grad_norm > 0.1  # the full steps overshoot and never settle


def test_newton_is_refused_where_only_gradients_are_given():
    newton = hg.inner.Newton()
    for build, name in ((lambda: hg.Unrolled(newton, 3), "optimizer"), (lambda: hg.Penalty(0.1, newton), "inner_optimizer"),
                        (lambda: hg.BOME(newton, w_lr=0.1), "inner_optimizer"),
                        (lambda: hg.AlternatingImplicit(newton, 2, hg.Implicit()), "inner_optimizer")):
        with pytest.raises(TypeError, match=rf"^{name} steps with update\(w, grad, state\), which Newton cannot take"):
            build()
    with pytest.raises(TypeError, match=r"Newton steps with the loss's Hessian"):
        newton.update({"x": torch.zeros(1)}, {"x": torch.zeros(1)}, newton.init({"x": torch.zeros(1)}))
    with pytest.raises(ValueError, match="lr must be a finite number > 0"):
        hg.inner.Newton(lr=0.0)
    with pytest.raises(TypeError, match="solver must be a linear solver with a damping option"):
        hg.inner.Newton(solver=hg.linear.Neumann())
    problem, w0, lam = inner_problems.logistic(n=30, d=3)
    res = hg.solve(problem, w0, lam, hg.Implicit(), lambda p: torch.optim.SGD(p, lr=1e-12), steps=1, inner_steps=8,
                   inner_optimizer=newton, progress=False)
    _, grad, _ = hg.autodiff.inner_grads(problem, None, res.w, lam)
    assert float(sum(v.norm() ** 2 for v in grad.values())) ** 0.5 < 1e-10  # solve's inner steps took Newton steps
