"""FiniteDifference: exact on quadratics, O(eps^2) on logistic regression, first order only."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hypergrad as hg
from tests._problems import DT, Quadratic, Ridge, rel_err

SETTINGS = settings(max_examples=15, deadline=None)


class _CountGrad:
    """Wraps ``torch.autograd.grad``: counts calls and records any ``create_graph=True``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.create_graph = 0
        self._orig = torch.autograd.grad
        monkeypatch.setattr(torch.autograd, "grad", self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.create_graph += bool(kwargs.get("create_graph", False))
        return self._orig(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Quadratics: central differences are exact up to round-off.


@SETTINGS
@given(n=st.integers(2, 25), p=st.integers(1, 4), log_cond=st.floats(0.0, 3.0),
       seed=st.integers(0, 10_000), eps=st.sampled_from([1e-4, 1e-3, 1e-2, 1.0]))
def test_matches_closed_form_on_random_quadratics(n, p, log_cond, seed, eps):
    q = Quadratic.random(n, p, 10.0**log_cond, seed)
    lam = torch.randn(p, dtype=DT, generator=torch.Generator().manual_seed(seed + 1))
    problem, w, lams = q.problem(), {"w": q.w_star(lam)}, {"lam": lam}
    exact = q.hypergrad(lam)
    cg = hg.FiniteDifference(eps=eps, solver=hg.linear.CG(tol=1e-12, maxiter=20 * n))
    dense = hg.FiniteDifference(eps=eps, solver=hg.linear.Dense())
    # g is quadratic: the differences are exact, only round-off (~1e-16 * cond / eps) remains.
    assert rel_err(cg.hypergrad(problem, w, lams).grad["lam"], exact) < 1e-7
    assert rel_err(dense.hypergrad(problem, w, lams).grad["lam"], exact) < 1e-7


@SETTINGS
@given(n=st.integers(5, 30), d=st.integers(1, 8), log_reg=st.floats(-2.0, 1.0),
       seed=st.integers(0, 10_000))
def test_matches_closed_form_on_ridge_per_feature(n, d, log_reg, seed):
    # g is cubic in (w, lam) through exp(lam) * w^2, but quadratic in w: the w-differences are
    # exact and the mixed difference  [exp(lam) (w + h v)^2 - exp(lam) (w - h v)^2] / 4h  too.
    ridge = Ridge.random(n, d, seed)
    lam = torch.full((d,), log_reg, dtype=DT)
    method = hg.FiniteDifference(eps=1e-3, solver=hg.linear.CG(tol=1e-12, maxiter=20 * d))
    r = method.hypergrad(ridge.problem(), {"w": ridge.w_star(lam)}, {"lam": lam})
    assert rel_err(r.grad["lam"], ridge.hypergrad(lam)) < 1e-7
    assert r.info.converged and r.info.grad_evals == 3 + 2 * r.info.extra["matvecs"]


@SETTINGS
@given(n=st.integers(2, 15), p=st.integers(1, 4), seed=st.integers(0, 10_000),
       xi=st.floats(0.01, 1.0))
def test_identity_solver_is_the_darts_formula(n, p, seed, xi):
    q = Quadratic.random(n, p, 10.0, seed)
    lam = torch.randn(p, dtype=DT, generator=torch.Generator().manual_seed(seed + 1))
    w = torch.randn(n, dtype=DT, generator=torch.Generator().manual_seed(seed + 2))
    r = hg.FiniteDifference(solver="identity", xi=xi).hypergrad(q.problem(), {"w": w}, {"lam": lam})
    # grad_lam g = -B^T w, so the mixed product is -B^T v with v = xi * grad_w f.
    grad_w_f = q.C.T @ (q.C @ w - q.d)
    expected = q.e + xi * q.B.T @ grad_w_f
    assert rel_err(r.grad["lam"], expected) < 1e-8
    assert r.info.grad_evals == 3
    assert torch.equal(r.w["w"], w)


@SETTINGS
@given(n=st.integers(2, 12), p=st.integers(1, 3), seed=st.integers(0, 10_000),
       xi=st.floats(0.01, 0.5))
def test_virtual_step_is_the_derivative_of_one_unrolled_step(n, p, seed, xi):
    """DARTS with the look-ahead w' = w - xi grad_w g equals d/dlam f(w'(lam), lam)."""
    q = Quadratic.random(n, p, 10.0, seed)
    problem = q.problem()
    lam = torch.randn(p, dtype=DT, generator=torch.Generator().manual_seed(seed + 1))
    w = torch.randn(n, dtype=DT, generator=torch.Generator().manual_seed(seed + 2))
    lam_ = lam.clone().requires_grad_(True)
    w_ = w.clone().requires_grad_(True)
    gw = torch.autograd.grad(problem.inner({"w": w_}, {"lam": lam_}, None), w_, create_graph=True)[0]
    unrolled = torch.autograd.grad(problem.outer({"w": w_ - xi * gw}, {"lam": lam_}, None), lam_)[0]
    method = hg.FiniteDifference(solver="identity", xi=xi, virtual_step=True)
    r = method.hypergrad(problem, {"w": w}, {"lam": lam})
    assert rel_err(r.grad["lam"], unrolled) < 1e-8
    assert r.info.grad_evals == 4


# ---------------------------------------------------------------------------------------------
# A non-quadratic problem: the error is O(eps^2).


def _logistic(n: int, d: int, seed: int):
    """L2-regularised logistic regression, one log-strength per feature; w solved by Newton."""
    gen = torch.Generator().manual_seed(seed)
    X, Xv = torch.randn(n, d, generator=gen, dtype=DT), torch.randn(n, d, generator=gen, dtype=DT)
    w_true = torch.randn(d, generator=gen, dtype=DT)
    y = torch.sign(X @ w_true + 0.5 * torch.randn(n, generator=gen, dtype=DT))
    yv = torch.sign(Xv @ w_true + 0.5 * torch.randn(n, generator=gen, dtype=DT))
    lam = torch.randn(d, generator=gen, dtype=DT) - 1.0

    def g(w, lam, batch):
        return torch.nn.functional.softplus(-y * (X @ w["w"])).mean() + 0.5 * (
            torch.exp(lam["lam"]) * w["w"] ** 2
        ).sum()

    def f(w, lam, batch):
        return torch.nn.functional.softplus(-yv * (Xv @ w["w"])).mean()

    w = torch.zeros(d, dtype=DT)
    for _ in range(30):  # Newton: quadratic convergence to round-off
        s = torch.sigmoid(y * (X @ w))
        grad = -(X.T @ (y * (1 - s))) / n + torch.exp(lam) * w
        hess = X.T @ (X * (s * (1 - s))[:, None]) / n + torch.diag(torch.exp(lam))
        w = w - torch.linalg.solve(hess, grad)
    assert float(grad.norm()) < 1e-12
    return hg.BilevelProblem(g, f), {"w": w}, {"lam": lam}


@settings(max_examples=12, deadline=None)
@given(n=st.integers(20, 60), d=st.integers(2, 8), seed=st.integers(0, 10_000),
       solver=st.sampled_from(["cg", "dense"]))
def test_error_is_second_order_in_eps_on_logistic_regression(n, d, seed, solver):
    problem, w, lam = _logistic(n, d, seed)
    exact = hg.Implicit(hg.linear.Dense()).hypergrad(problem, w, lam).grad["lam"]
    linear = hg.linear.CG(tol=1e-13, maxiter=50 * d) if solver == "cg" else hg.linear.Dense()
    errors = []
    for eps in (0.05, 0.025, 0.0125, 0.00625):
        estimate = hg.FiniteDifference(eps=eps, solver=linear).hypergrad(problem, w, lam).grad["lam"]
        errors.append(rel_err(estimate, exact))
    # Truncation dominates (errors ~1e-4..1e-7, round-off ~1e-13): halving eps divides by 4.
    assert errors[-1] > 1e-10, errors  # not exact: the test really sees the O(eps^2) term
    ratios = [a / b for a, b in itertools.pairwise(errors)]
    assert all(3.5 < r < 4.5 for r in ratios), (errors, ratios)


# ---------------------------------------------------------------------------------------------
# No double backward.


class _OnceExp(torch.autograd.Function):
    """exp whose backward must not itself be differentiated.

    The first-order backward is ``@once_differentiable``. That decorator alone does not make a
    double backward through ``torch.autograd.grad(..., inputs)`` raise: it hangs its error node
    off detached aliases, which the engine prunes, so the second-order term is silently dropped
    (see ``test_once_differentiable_alone_silently_drops_second_order_terms``). The backward
    therefore also raises when it runs in ``create_graph`` mode (grad mode enabled), the mode
    every Hessian-vector or mixed product needs.
    """

    @staticmethod
    def forward(ctx, x):
        out = torch.exp(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():
            raise RuntimeError("trying to differentiate twice a once-differentiable function")
        return _OnceExp.first_order(ctx, grad)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def first_order(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out


class _OnceExpDecoratorOnly(torch.autograd.Function):
    """The same with ``@once_differentiable`` only (the silent-drop case)."""

    @staticmethod
    def forward(ctx, x):
        out = torch.exp(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out


def _once_differentiable_problem(exp=_OnceExp.apply):
    problem, w, lam = _logistic(30, 4, 0)
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(30, 4, generator=gen, dtype=DT)
    y = torch.sign(torch.randn(30, generator=gen, dtype=DT))

    def g(w, lam, batch):
        margins = -y * (X @ w["w"])
        return torch.log1p(exp(margins)).mean() + 0.5 * (torch.exp(lam["lam"]) * w["w"] ** 2).sum()

    return hg.BilevelProblem(g, problem.outer), w, lam


def test_no_double_backward_on_once_differentiable_loss(monkeypatch):
    problem, w, lam = _once_differentiable_problem()
    # The test can detect a double backward: Implicit needs one and fails on this loss.
    with pytest.raises(RuntimeError, match="differentiate twice"):
        hg.Implicit(hg.linear.CG()).hypergrad(problem, w, lam)
    counter = _CountGrad(monkeypatch)
    for method in (
        hg.FiniteDifference(eps=1e-3, solver=hg.linear.CG(tol=1e-8)),
        hg.FiniteDifference(eps=1e-3, solver=hg.linear.Dense()),
        hg.FiniteDifference(solver="identity", xi=0.5),
        hg.FiniteDifference(solver="identity", xi=0.5, virtual_step=True),
    ):
        before = counter.calls
        r = method.hypergrad(problem, w, lam)
        assert torch.isfinite(r.grad["lam"]).all()
        assert counter.calls - before == r.info.grad_evals  # one autograd.grad per gradient
    assert counter.create_graph == 0


def test_once_differentiable_loss_agrees_with_plain_autograd_version():
    """The custom Function is plain exp: FD on it matches the exact value on the plain loss."""
    problem, w, lam = _once_differentiable_problem()
    plain, _, _ = _once_differentiable_problem(torch.exp)
    fd = hg.FiniteDifference(eps=1e-4, solver=hg.linear.Dense())
    exact = hg.Implicit(hg.linear.Dense()).hypergrad(plain, w, lam).grad["lam"]
    assert rel_err(fd.hypergrad(problem, w, lam).grad["lam"], exact) < 1e-6


def test_once_differentiable_alone_silently_drops_second_order_terms():
    """Documents the torch behaviour that motivates ``_OnceExp``'s explicit check."""
    silent, w, lam = _once_differentiable_problem(_OnceExpDecoratorOnly.apply)
    plain, _, _ = _once_differentiable_problem(torch.exp)
    exact = hg.Implicit(hg.linear.Dense()).hypergrad(plain, w, lam).grad["lam"]
    wrong = hg.Implicit(hg.linear.Dense()).hypergrad(silent, w, lam).grad["lam"]
    assert rel_err(wrong, exact) > 0.1  # no error raised, but the Hessian lost the data term
    fd = hg.FiniteDifference(eps=1e-4, solver=hg.linear.Dense()).hypergrad(silent, w, lam)
    assert rel_err(fd.grad["lam"], exact) < 1e-6  # first-order only: unaffected


# ---------------------------------------------------------------------------------------------
# Cost, state, diagnostics, errors.


def test_cost_is_three_gradients_with_identity_and_two_per_product_with_a_solver(monkeypatch):
    q = Quadratic.random(6, 2, 10.0, 3)
    lam = torch.ones(2, dtype=DT)
    problem, w, lams = q.problem(), {"w": q.w_star(lam)}, {"lam": lam}
    counter = _CountGrad(monkeypatch)
    r = hg.FiniteDifference(solver="identity", xi=0.1).hypergrad(problem, w, lams)
    assert counter.calls == 3 == r.info.grad_evals
    counter.calls = 0
    r = hg.FiniteDifference(solver=hg.linear.CG(tol=1e-10)).hypergrad(problem, w, lams)
    assert r.info.iterations >= 1
    assert counter.calls == r.info.grad_evals == 3 + 2 * r.info.extra["matvecs"]


def test_warm_start_passes_v_through_state():
    q = Quadratic.random(8, 2, 100.0, 5)
    lam = torch.ones(2, dtype=DT)
    problem, w, lams = q.problem(), {"w": q.w_star(lam)}, {"lam": lam}
    method = hg.FiniteDifference(solver=hg.linear.CG(tol=1e-10), warm_start=True)
    first = method.hypergrad(problem, w, lams)
    assert set(first.state) == {"v"} and first.state["v"]["w"].shape == (8,)
    second = method.hypergrad(problem, w, lams, state=first.state)
    assert second.info.iterations < first.info.iterations
    assert rel_err(second.grad["lam"], q.hypergrad(lam)) < 1e-7


def test_non_convergence_is_reported_and_warned():
    q = Quadratic.random(20, 2, 1e4, 0)
    lam = torch.ones(2, dtype=DT)
    method = hg.FiniteDifference(solver=hg.linear.CG(tol=1e-14, maxiter=2))
    with pytest.warns(hg.ConvergenceWarning):
        r = method.hypergrad(q.problem(), {"w": q.w_star(lam)}, {"lam": lam})
    assert not r.info.converged and r.info.warnings and r.info.residual > 0


def test_zero_outer_gradient_gives_grad_lam_f_without_differences():
    g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()  # noqa: E731
    f = lambda w, lam, b: (lam["c"] ** 2).sum() + 0.0 * w["x"].sum()  # noqa: E731
    lam = {"c": torch.tensor([1.0, -2.0], dtype=DT)}
    r = hg.FiniteDifference(solver="identity", xi=1.0).hypergrad(hg.BilevelProblem(g, f), {"x": lam["c"]}, lam)
    assert r.grad["c"].tolist() == [2.0, -4.0] and r.info.grad_evals == 1


def test_non_finite_estimate_raises():
    g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()  # noqa: E731
    # finite value, NaN gradient (the masked sqrt branch of torch.where)
    f = lambda w, lam, b: torch.where(w["x"] > 1e9, torch.sqrt(-w["x"]), w["x"]).sum()  # noqa: E731
    lam = {"c": torch.tensor([1.0, 2.0], dtype=DT)}
    for method in (hg.FiniteDifference(), hg.FiniteDifference(solver="identity", xi=1.0)):
        with pytest.raises(hg.NonFiniteError):
            method.hypergrad(hg.BilevelProblem(g, f), {"x": lam["c"].clone()}, lam)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"eps": 0.0}, ValueError, "eps"),
        ({"eps": -1e-3}, ValueError, "eps"),
        ({"eps": float("nan")}, ValueError, "eps"),
        ({"eps": "small"}, TypeError, "eps"),
        ({"solver": "newton"}, ValueError, "solver"),
        ({"solver": 3}, TypeError, "solver"),
        ({"solver": "identity"}, ValueError, "xi"),
        ({"solver": "identity", "xi": 0.0}, ValueError, "xi"),
        ({"solver": "identity", "xi": -1.0}, ValueError, "xi"),
        ({"xi": 0.1}, ValueError, "xi"),
        ({"virtual_step": True}, ValueError, "virtual_step"),
        ({"solver": "identity", "xi": 0.1, "virtual_step": 1}, TypeError, "virtual_step"),
    ],
)
def test_invalid_arguments_raise_naming_the_argument(kwargs, error, name):
    with pytest.raises(error, match=name):
        hg.FiniteDifference(**kwargs)


def test_invalid_inputs_raise():
    q = Quadratic.random(3, 1, 2.0, 0)
    with pytest.raises(TypeError, match="w"):
        hg.FiniteDifference().hypergrad(q.problem(), [1.0], {"lam": torch.ones(1, dtype=DT)})


def test_truncated_neumann_warns_once_per_solver_and_reports_every_call():
    q = Quadratic.random(8, 2, cond=1e3, seed=3)
    lam = torch.zeros(2, dtype=DT)
    method = hg.FiniteDifference(solver=hg.linear.Neumann(alpha=1.0 / float(torch.linalg.eigvalsh(q.A).max()), steps=5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [method.hypergrad(q.problem(), {"w": q.w_star(lam)}, {"lam": lam}) for _ in range(6)]
    convergence = [c for c in caught if issubclass(c.category, hg.ConvergenceWarning)]
    assert len(convergence) == 1 and "not converged" in str(convergence[0].message)
    assert all(not r.info.converged and any("not converged" in m for m in r.info.warnings) for r in results)
