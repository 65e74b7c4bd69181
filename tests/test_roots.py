"""hg.custom_root: the inner solution as a differentiable tensor, against Implicit, torchopt and closed forms."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import hypergrad as hg

DT = torch.float64
TIGHT = hg.linear.CG(tol=1e-13, maxiter=500)


def _data(n=60, d=6, classes=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    X, Xv = torch.randn(n, d, generator=gen, dtype=DT), torch.randn(n, d, generator=gen, dtype=DT)
    if classes is None:
        truth = torch.randn(d, generator=gen, dtype=DT)
        y = X @ truth + 0.3 * torch.randn(n, generator=gen, dtype=DT)
        yv = Xv @ truth + 0.3 * torch.randn(n, generator=gen, dtype=DT)
    else:
        truth = torch.randn(d, classes, generator=gen, dtype=DT)
        y, yv = (X @ truth).argmax(1), (Xv @ truth).argmax(1)
    return X, y, Xv, yv


def _ridge():
    X, y, Xv, yv = _data()
    g = lambda w, lam, b: 0.5 * ((X @ w["x"] - y) ** 2).mean() + 0.5 * (lam["log_l2"].exp() * w["x"] ** 2).sum()  # noqa: E731
    f = lambda w, lam, b: 0.5 * ((Xv @ w["x"] - yv) ** 2).mean()  # noqa: E731
    return hg.BilevelProblem(g, f), {"x": torch.zeros(6, dtype=DT)}, {"log_l2": torch.linspace(-2.0, 0.5, 6, dtype=DT)}


def _logistic():
    X, y, Xv, yv = _data()
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    g = lambda w, lam, b: bce(X @ w["x"], (y > 0).to(DT)) + 0.5 * (lam["log_l2"].exp() * w["x"] ** 2).sum()  # noqa: E731
    f = lambda w, lam, b: bce(Xv @ w["x"], (yv > 0).to(DT))  # noqa: E731
    return hg.BilevelProblem(g, f), {"x": torch.zeros(6, dtype=DT)}, {"log_l2": torch.linspace(-3.0, -1.0, 6, dtype=DT)}


def _pytree():
    """Multinomial logistic regression: w = (weight matrix, bias), lam = (per-feature L2, a temperature)."""
    X, y, Xv, yv = _data(classes=3)
    ce = torch.nn.functional.cross_entropy

    def g(w, lam, b):
        logits = (X @ w["W"] + w["b"]) * lam["inv_temp"].exp()
        return ce(logits, y) + 0.5 * (lam["log_l2"].exp()[:, None] * w["W"] ** 2).sum() + 0.05 * (w["b"] ** 2).sum()

    def f(w, lam, b):
        return ce(Xv @ w["W"] + w["b"], yv)

    w0 = {"W": torch.zeros(6, 3, dtype=DT), "b": torch.zeros(3, dtype=DT)}
    lam = {"log_l2": torch.linspace(-2.5, -0.5, 6, dtype=DT), "inv_temp": torch.tensor(0.2, dtype=DT)}
    return hg.BilevelProblem(g, f), w0, lam


PROBLEMS = {"ridge": _ridge, "logistic": _logistic, "pytree": _pytree}


def _lbfgs_root(problem, **options):
    @hg.custom_root(problem.inner, **options)
    def solve(w0, lam, batch=None):
        return hg.inner_solve(problem, w0, lam, 500, hg.inner.LBFGS(), batch, tol=1e-12)

    return solve


def _leaves(lam):
    return {k: v.clone().requires_grad_(True) for k, v in lam.items()}


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_hypergradient_equals_implicit(name):
    problem, w0, lam0 = PROBLEMS[name]()
    solve = _lbfgs_root(problem, solver=TIGHT)
    lam = _leaves(lam0)
    w_star = solve(w0, lam)
    grads = torch.autograd.grad(problem.outer(w_star, lam, None), list(lam.values()))
    implicit = hg.Implicit(TIGHT).hypergrad(problem, {k: v.detach() for k, v in w_star.items()}, lam0)
    assert implicit.info.converged and implicit.info.extra["inner_residual"] < 1e-10
    for key, grad in zip(lam, grads, strict=True):
        assert float((grad - implicit.grad[key]).abs().max()) <= 1e-10, (name, key)
        assert float(implicit.grad[key].abs().max()) > 1e-4  # a hypergradient worth comparing


def test_ridge_matches_the_closed_form_and_gradients_reach_the_data():
    X, y, Xv, yv = _data()
    g = lambda w, lam, b: 0.5 * ((b[0] @ w["x"] - b[1]) ** 2).mean() + 0.5 * (lam["log_l2"].exp() * w["x"] ** 2).sum()  # noqa: E731
    problem = hg.BilevelProblem(g, g)
    solve = _lbfgs_root(problem, solver=TIGHT)
    lam = {"log_l2": torch.full((6,), -1.0, dtype=DT, requires_grad=True)}
    targets = y.clone().requires_grad_(True)
    w_star = solve({"x": torch.zeros(6, dtype=DT)}, lam, (X, targets))  # the batch is a tuple holding tensors
    loss = ((Xv @ w_star["x"] - yv) ** 2).mean()
    loss.backward()

    lam2, targets2 = lam["log_l2"].detach().clone().requires_grad_(True), y.clone().requires_grad_(True)
    n = X.shape[0]
    exact = torch.linalg.solve(X.T @ X / n + torch.diag(lam2.exp()), X.T @ targets2 / n)
    ((Xv @ exact - yv) ** 2).mean().backward()
    assert torch.allclose(w_star["x"], exact, atol=1e-10)
    assert torch.allclose(lam["log_l2"].grad, lam2.grad, atol=1e-10, rtol=0)
    assert torch.allclose(targets.grad, targets2.grad, atol=1e-10, rtol=0)  # d loss / d training targets


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_hypergradient_equals_torchopts_custom_root(name):
    torchopt = pytest.importorskip("torchopt")
    problem, w0, lam0 = PROBLEMS[name]()
    keys, lam_keys = list(w0), list(lam0)
    w_star = hg.inner_solve(problem, w0, lam0, 500, hg.inner.LBFGS(), tol=1e-12).w

    def optimality(w_, *lam_t):
        lam_ = dict(zip(lam_keys, lam_t, strict=True))
        grads = torch.func.grad(lambda ww: problem.inner(dict(zip(keys, ww, strict=True)), lam_, None))(w_)
        return tuple(grads)

    @torchopt.diff.implicit.custom_root(optimality, argnums=tuple(range(1, 1 + len(lam_keys))),
                                        solve=torchopt.linear_solve.solve_cg(rtol=1e-13, maxiter=500))
    def theirs(w_init, *lam_t):
        return tuple(w_star[k] for k in keys)

    lam_t = [v.clone().requires_grad_(True) for v in lam0.values()]
    w_t = theirs(tuple(torch.zeros_like(v) for v in w0.values()), *lam_t)
    expected = torch.autograd.grad(problem.outer(dict(zip(keys, w_t, strict=True)), lam0, None), lam_t)

    solve = _lbfgs_root(problem, solver=TIGHT)
    lam = _leaves(lam0)
    ours = torch.autograd.grad(problem.outer(solve(w0, lam), lam, None), list(lam.values()))
    for a, b in zip(ours, expected, strict=True):
        assert float((a - b).abs().max()) <= 1e-10, name


def test_the_solution_composes_with_the_rest_of_a_graph():
    # a model whose output layer is the ridge solution on features that a trainable encoder computes
    X, y, Xv, yv = _data()
    encoder = torch.nn.Linear(6, 4).to(DT)

    def g(w, lam, features):
        return 0.5 * ((features @ w["x"] - y) ** 2).mean() + 0.5 * lam["l2"] * (w["x"] ** 2).sum()

    solve = _lbfgs_root(hg.BilevelProblem(g, g), solver=TIGHT)
    lam = {"l2": torch.tensor(0.3, dtype=DT, requires_grad=True)}

    def loss_of(weight, bias, l2, through_root):
        features = torch.tanh(X @ weight.T + bias)
        if through_root:
            head = solve({"x": torch.zeros(4, dtype=DT)}, {"l2": l2}, features)["x"]
        else:
            head = torch.linalg.solve(features.T @ features / 60 + l2 * torch.eye(4, dtype=DT), features.T @ y / 60)
        return ((torch.tanh(Xv @ weight.T + bias) @ head - yv) ** 2).mean()

    params = [encoder.weight, encoder.bias, lam["l2"]]
    ours = torch.autograd.grad(loss_of(*params, through_root=True), params)
    exact = torch.autograd.grad(loss_of(*params, through_root=False), params)
    for a, b in zip(ours, exact, strict=True):
        assert torch.allclose(a, b, atol=1e-9, rtol=0)


def test_vmap_over_a_batch_of_lam_with_grad_in_either_order():
    problem, w0, lam0 = _logistic()
    solve = _lbfgs_root(problem, solver=TIGHT)

    def F(log_l2):
        return problem.outer(solve(w0, {"log_l2": log_l2}), None, None)

    lams = torch.stack([lam0["log_l2"] + 0.4 * i for i in range(4)])
    loop_values = torch.stack([F(lam) for lam in lams])
    loop_grads = torch.stack([torch.func.grad(F)(lam) for lam in lams])
    assert torch.allclose(torch.func.vmap(F)(lams), loop_values, atol=1e-12, rtol=0)
    assert torch.allclose(torch.func.vmap(torch.func.grad(F))(lams), loop_grads, atol=1e-12, rtol=0)
    assert torch.allclose(torch.func.grad(lambda L: torch.func.vmap(F)(L).sum())(lams), loop_grads, atol=1e-12, rtol=0)
    assert float(loop_grads.std(0).max()) > 1e-4  # the lams give different hypergradients


def test_vectorize_runs_a_vmappable_solver_under_vmap():
    X, y, _, _ = _data()
    calls = []

    def g(w, lam, b):
        return 0.5 * ((X @ w["x"] - y) ** 2).mean() + 0.5 * lam["l2"] * (w["x"] ** 2).sum()

    def closed_form(w0, lam, batch=None):
        calls.append(lam["l2"].shape)
        n = X.shape[0]
        return {"x": torch.linalg.solve(X.T @ X / n + lam["l2"] * torch.eye(6, dtype=DT), X.T @ y / n)}

    looped = hg.custom_root(g, solver=TIGHT)(closed_form)
    vectorized = hg.custom_root(g, solver=TIGHT, vectorize=True)(closed_form)
    l2s = torch.tensor([0.1, 0.5, 2.0], dtype=DT)

    def norm(solve):
        return torch.func.vmap(torch.func.grad(lambda l2: (solve({"x": torch.zeros(6, dtype=DT)}, {"l2": l2})["x"] ** 2).sum()))

    calls.clear()
    expected = norm(looped)(l2s)
    assert len(calls) == 3  # one solve per lam
    calls.clear()
    got = norm(vectorized)(l2s)
    assert len(calls) == 1  # one vectorised solve (traced by vmap)
    assert torch.allclose(got, expected, atol=1e-12, rtol=0)
    exact = torch.func.vmap(torch.func.grad(lambda l2: (closed_form(None, {"l2": l2})["x"] ** 2).sum()))(l2s)
    assert torch.allclose(got, exact, atol=1e-10, rtol=0)


def test_a_fixed_point_optimality_with_normal_cg():
    # w = T(w) = w - eta * grad g(w): the same root, a (here symmetric, but not declared) Jacobian eta * H
    problem, w0, lam0 = _ridge()

    def optimality(w, lam, batch):
        grad = torch.func.grad(lambda w_: problem.inner(w_, lam, batch))(w)
        return {k: 0.5 * grad[k] for k in w}

    @hg.custom_root(optimality=optimality, solver=hg.linear.NormalCG(tol=1e-13, maxiter=500))
    def solve(w0, lam, batch=None):
        return hg.inner_solve(problem, w0, lam, 500, hg.inner.LBFGS(), tol=1e-12)

    lam = _leaves(lam0)
    grad = torch.autograd.grad(problem.outer(solve(w0, lam), lam, None), [lam["log_l2"]])[0]
    w_star = hg.inner_solve(problem, w0, lam0, 500, hg.inner.LBFGS(), tol=1e-12).w
    expected = hg.Implicit(hg.linear.Dense()).hypergrad(problem, w_star, lam0).grad["log_l2"]
    assert float((grad - expected).abs().max()) <= 1e-10
    with pytest.raises(ValueError, match="CG needs a symmetric system"):  # CG is refused for an undeclared Jacobian
        hg.custom_root(optimality=optimality, solver=hg.linear.CG())(solve.__wrapped__)(w0, _leaves(lam0))[
            "x"].sum().backward()


def test_a_capped_linear_solve_warns_and_bad_arguments_say_so():
    problem, w0, lam0 = _logistic()
    solve = _lbfgs_root(problem, solver=hg.linear.CG(maxiter=1, tol=1e-14))
    with pytest.warns(hg.ConvergenceWarning, match="CG: not converged after 1 iterations"):
        problem.outer(solve(w0, _leaves(lam0)), lam0, None).backward()
    with pytest.raises(ValueError, match="exactly one of inner"):
        hg.custom_root()
    with pytest.raises(ValueError, match="exactly one of inner"):
        hg.custom_root(problem.inner, optimality=lambda w, lam, b: w)
    with pytest.raises(TypeError, match=r"^solver must be an instance"):
        hg.custom_root(problem.inner, solver=hg.linear.CG)
    bad = hg.custom_root(problem.inner)(lambda w0, lam, batch=None: {"x": torch.zeros(3, dtype=DT)})
    with pytest.raises(ValueError, match=r"w\['x'\] must be a tensor of shape \(6,\) like w0's, got torch.Size\(\[3\]\)"):
        bad(w0, lam0)
    twice = _leaves(lam0)
    grad = torch.autograd.grad(problem.outer(solve(w0, twice), twice, None), [twice["log_l2"]], create_graph=True)[0]
    with pytest.raises(RuntimeError, match="first-order"), warnings.catch_warnings():
        warnings.simplefilter("ignore", hg.ConvergenceWarning)
        grad.sum().backward()


def test_no_graph_without_leaves_that_require_grad_and_w0_gets_no_gradient():
    problem, w0, lam0 = _ridge()
    solve = _lbfgs_root(problem)
    w_plain = solve(w0, lam0)  # nothing requires grad: the solver runs, no graph
    assert not w_plain["x"].requires_grad
    start = {"x": torch.zeros(6, dtype=DT, requires_grad=True)}
    lam = _leaves(lam0)
    out = solve(start, lam)
    grads = torch.autograd.grad(out["x"].sum(), [start["x"], lam["log_l2"]], allow_unused=True)
    assert grads[0] is None and grads[1] is not None and math.isfinite(float(grads[1].sum()))
