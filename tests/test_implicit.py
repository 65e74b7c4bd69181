"""Implicit differentiation against closed forms, across linear solvers and problem forms."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import hypergrad as hg
from tests._problems import DT, Quadratic, Ridge, rel_err

SETTINGS = settings(max_examples=25, deadline=None)


@SETTINGS
@given(n=st.integers(2, 30), p=st.integers(1, 5), log_cond=st.floats(0.0, 4.0), seed=st.integers(0, 10_000))
def test_dense_matches_closed_form_on_random_quadratics(n, p, log_cond, seed):
    q = Quadratic.random(n, p, 10.0**log_cond, seed)
    lam = torch.randn(p, dtype=DT, generator=torch.Generator().manual_seed(seed + 1))
    r = hg.Implicit(hg.linear.Dense()).hypergrad(q.problem(), {"w": q.w_star(lam)}, {"lam": lam})
    assert rel_err(r.grad["lam"], q.hypergrad(lam)) < 1e-9


@SETTINGS
@given(n=st.integers(5, 40), d=st.integers(1, 15), per_feature=st.booleans(),
       log_reg=st.floats(-3.0, 2.0), seed=st.integers(0, 10_000))
def test_dense_matches_closed_form_on_ridge(n, d, per_feature, log_reg, seed):
    ridge = Ridge.random(n, d, seed)
    lam = torch.full((d,) if per_feature else (1,), log_reg, dtype=DT)
    r = hg.Implicit(hg.linear.Dense()).hypergrad(ridge.problem(), {"w": ridge.w_star(lam)}, {"lam": lam})
    assert rel_err(r.grad["lam"], ridge.hypergrad(lam)) < 1e-9


def _fixed_point_map(problem: hg.BilevelProblem, step: float):
    def T(w, lam, batch):
        gw = torch.autograd.grad(problem.inner(w, lam, batch), list(w.values()), create_graph=True)
        return {k: w[k] - step * gk for k, gk in zip(w, gw, strict=True)}

    return T


# products="forward" uses torch.func.jvp, whose first use in a process scripts torch's own jvp
# decompositions with the deprecated torch.jit.script
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@SETTINGS
@given(n=st.integers(2, 20), p=st.integers(1, 4), log_cond=st.floats(0.0, 3.0), seed=st.integers(0, 10_000))
def test_iterative_solvers_and_fixed_point_form_match_dense(n, p, log_cond, seed):
    q = Quadratic.random(n, p, 10.0**log_cond, seed)
    lam = torch.randn(p, dtype=DT, generator=torch.Generator().manual_seed(seed + 1))
    problem, w, lams = q.problem(), {"w": q.w_star(lam)}, {"lam": lam}
    dense = hg.Implicit(hg.linear.Dense()).hypergrad(problem, w, lams).grad["lam"]
    step = 1.0 / float(torch.linalg.eigvalsh(q.A).max())
    methods = {
        "cg": hg.Implicit(hg.linear.CG(tol=1e-13, maxiter=10 * n)),
        "normal_cg": hg.Implicit(hg.linear.NormalCG(tol=1e-13, maxiter=50 * n)),
        "neumann": hg.Implicit(hg.linear.Neumann(steps=200_000, tol=1e-12)),
        "forward_products": hg.Implicit(hg.linear.CG(tol=1e-13, maxiter=10 * n), products="forward"),
        "fixed_point_dense": hg.Implicit(hg.linear.Dense(), fixed_point=_fixed_point_map(problem, step)),
        "fixed_point_normal_cg": hg.Implicit(
            hg.linear.NormalCG(tol=1e-13, maxiter=50 * n), fixed_point=_fixed_point_map(problem, step)
        ),
    }
    for name, method in methods.items():
        r = method.hypergrad(problem, w, lams)
        assert r.info.converged, name
        assert rel_err(r.grad["lam"], dense) < 1e-7, name


def test_result_carries_w_and_info():
    ridge = Ridge.random(20, 4, seed=0)
    lam = torch.zeros(4, dtype=DT)
    w = {"w": ridge.w_star(lam)}
    r = hg.Implicit(hg.linear.CG(tol=1e-10)).hypergrad(ridge.problem(), w, {"lam": lam})
    assert torch.equal(r.w["w"], w["w"])
    assert 1 <= r.info.iterations <= 4 + 10
    assert r.info.residual is not None and r.info.residual < 1e-8
    assert r.info.extra["inner_residual"] < 1e-10
    assert r.info.grad_evals == 3 + r.info.extra["matvecs"]


def test_cg_non_convergence_warns_and_is_reported():
    q = Quadratic.random(10, 2, cond=1e3, seed=3)
    lam = torch.zeros(2, dtype=DT)
    with pytest.warns(hg.ConvergenceWarning, match="not converged"):
        r = hg.Implicit(hg.linear.CG(tol=1e-12, maxiter=2)).hypergrad(q.problem(), {"w": q.w_star(lam)}, {"lam": lam})
    assert not r.info.converged
    assert r.info.iterations == 2
    assert any("not converged" in m for m in r.info.warnings)


def test_neumann_with_too_large_step_reports_divergence():
    q = Quadratic.random(6, 2, cond=10.0, seed=4)
    lam = torch.zeros(2, dtype=DT)
    big = 10.0 / float(torch.linalg.eigvalsh(q.A).max())
    with pytest.warns(hg.ConvergenceWarning, match="diverging"):
        r = hg.Implicit(hg.linear.Neumann(alpha=big, steps=500)).hypergrad(q.problem(), {"w": q.w_star(lam)}, {"lam": lam})
    assert not r.info.converged


def test_truncated_neumann_warns_once_per_solver_and_reports_every_call():
    q = Quadratic.random(10, 2, cond=1e3, seed=3)
    lam = torch.zeros(2, dtype=DT)
    w = {"w": q.w_star(lam)}
    method = hg.Implicit(hg.linear.Neumann(alpha=1.0 / float(torch.linalg.eigvalsh(q.A).max()), steps=10))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [method.hypergrad(q.problem(), w, {"lam": lam}) for _ in range(20)]
        convergence = [c for c in caught if issubclass(c.category, hg.ConvergenceWarning)]
        assert len(convergence) == 1 and "not converged" in str(convergence[0].message)
        assert all(not r.info.converged and any("not converged" in m for m in r.info.warnings)
                   for r in results)
        # a diverging solve (the same step on a 100x steeper problem) is another kind of warning:
        # the same instance reports it once too
        steep = Quadratic.random(10, 2, cond=1e3, seed=3)
        steep.A = steep.A * 100.0
        for _ in range(5):
            r = method.hypergrad(steep.problem(), {"w": steep.w_star(lam)}, {"lam": lam})
            assert any("diverging" in m for m in r.info.warnings)
        # another instance (even an equal one) warns on its own first call
        hg.Implicit(hg.linear.Neumann(steps=3)).hypergrad(q.problem(), w, {"lam": lam})
    messages = [str(c.message) for c in caught if issubclass(c.category, hg.ConvergenceWarning)]
    assert len(messages) == 3 and "diverging" in messages[1] and "not converged" in messages[2]


def test_neumann_default_step_converges_on_badly_scaled_problem():
    # A fixed alpha = 1 diverges here (lambda_max ~ 1e3); the power-iteration step must not.
    q = Quadratic.random(8, 2, cond=100.0, seed=5)
    q.A = q.A * 10.0
    lam = torch.zeros(2, dtype=DT)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hg.ConvergenceWarning)
        r = hg.Implicit(hg.linear.Neumann(steps=20_000, tol=1e-11)).hypergrad(
            q.problem(), {"w": q.w_star(lam)}, {"lam": lam}
        )
    assert rel_err(r.grad["lam"], q.hypergrad(lam)) < 1e-8


def test_cg_rejects_the_non_symmetric_fixed_point_system():
    q = Quadratic.random(4, 1, cond=2.0, seed=0)
    lam = torch.zeros(1, dtype=DT)
    method = hg.Implicit(hg.linear.CG(), fixed_point=_fixed_point_map(q.problem(), 0.1))
    with pytest.raises(ValueError, match="NormalCG"):
        method.hypergrad(q.problem(), {"w": q.w_star(lam)}, {"lam": lam})


def test_warm_start_reuses_previous_solution():
    ridge = Ridge.random(30, 10, seed=1)
    lam = torch.zeros(10, dtype=DT)
    method = hg.Implicit(hg.linear.CG(tol=1e-10), warm_start=True)
    first = method.hypergrad(ridge.problem(), {"w": ridge.w_star(lam)}, {"lam": lam})
    second = method.hypergrad(ridge.problem(), {"w": ridge.w_star(lam)}, {"lam": lam}, state=first.state)
    assert second.info.iterations == 0
    assert rel_err(second.grad["lam"], first.grad["lam"]) < 1e-9


def test_logistic_regression_matches_finite_differences_of_F():
    gen = torch.Generator().manual_seed(0)
    n, d = 60, 5
    X, Xv = torch.randn(n, d, generator=gen, dtype=DT), torch.randn(n, d, generator=gen, dtype=DT)
    w_true = torch.randn(d, generator=gen, dtype=DT)
    y = (X @ w_true + 0.5 * torch.randn(n, generator=gen, dtype=DT) > 0).to(DT)
    yv = (Xv @ w_true > 0).to(DT)
    bce = torch.nn.functional.binary_cross_entropy_with_logits

    def g(w, lam, b):
        return bce(X @ w["w"], y, reduction="sum") + 0.5 * (torch.exp(lam["lam"]) * w["w"] ** 2).sum()

    def f(w, lam, b):
        return bce(Xv @ w["w"], yv, reduction="sum")

    def w_star(lam):  # Newton's method to machine precision
        w = torch.zeros(d, dtype=DT)
        for _ in range(50):
            p = torch.sigmoid(X @ w)
            grad = X.T @ (p - y) + torch.exp(lam) * w
            H = X.T @ (X * (p * (1 - p))[:, None]) + torch.diag(torch.exp(lam))
            w = w - torch.linalg.solve(H, grad)
        return w

    def F(lam):
        return float(f({"w": w_star(lam)}, None, None))

    lam = torch.linspace(-1.0, 1.0, d, dtype=DT)
    r = hg.Implicit(hg.linear.CG(tol=1e-12)).hypergrad(hg.BilevelProblem(g, f), {"w": w_star(lam)}, {"lam": lam})
    h = 1e-5
    fd = torch.tensor([(F(lam + h * e) - F(lam - h * e)) / (2 * h) for e in torch.eye(d, dtype=DT)])
    assert rel_err(r.grad["lam"], fd) < 1e-7


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_module_with_only_last_layer_trainable(dtype):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(dtype)
    X, Xv = torch.randn(50, 4, dtype=dtype), torch.randn(50, 4, dtype=dtype)
    y, yv = torch.randn(50, dtype=dtype), torch.randn(50, dtype=dtype)
    call = hg.functional(net)

    def g(w, lam, b):
        r = call(w, X).squeeze(-1) - y
        return 0.5 * (r**2).sum() + 0.5 * torch.exp(lam["log_l2"]) * (w["2.weight"] ** 2).sum()

    def f(w, lam, b):
        return 0.5 * ((call(w, Xv).squeeze(-1) - yv) ** 2).sum()

    w = hg.module_params(net, trainable="2.*")
    assert set(w) == {"2.weight", "2.bias"}
    lam = {"log_l2": torch.tensor(0.0, dtype=dtype)}
    # The inner problem is ridge regression on the frozen features: solve and differentiate in closed form.
    with torch.no_grad():
        phi = torch.cat([torch.tanh(net[0](X)), torch.ones(50, 1, dtype=dtype)], 1).double()
        phiv = torch.cat([torch.tanh(net[0](Xv)), torch.ones(50, 1, dtype=dtype)], 1).double()
    reg = torch.diag(torch.tensor([1.0] * 8 + [0.0], dtype=DT))
    H = phi.T @ phi + reg
    theta = torch.linalg.solve(H, phi.T @ y.double())
    v = torch.linalg.solve(H, phiv.T @ (phiv @ theta - yv.double()))
    expected = -(reg @ theta) @ v
    w = {"2.weight": theta[:8].reshape(1, 8).to(dtype), "2.bias": theta[8:].to(dtype)}
    r = hg.Implicit(hg.linear.CG(tol=1e-10 if dtype == DT else 1e-6)).hypergrad(hg.BilevelProblem(g, f), w, lam)
    assert r.grad["log_l2"].dtype == dtype
    tol = 1e-9 if dtype == DT else 1e-3
    assert abs(float(r.grad["log_l2"]) - float(expected)) <= tol * max(1.0, abs(float(expected)))
    # The frozen first layer is untouched and not part of the result.
    assert set(r.w) == {"2.weight", "2.bias"}


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
def test_torchopt_custom_root_agrees():
    torchopt = pytest.importorskip("torchopt")
    ridge = Ridge.random(30, 6, seed=7)
    lam = torch.linspace(-1, 1, 6, dtype=DT)
    problem = ridge.problem()

    def optimality(w, lam_):  # torchopt differentiates this with functorch transforms
        return torch.func.grad(lambda w_: problem.inner({"w": w_}, {"lam": lam_}, None))(w)

    @torchopt.diff.implicit.custom_root(optimality, argnums=1, solve=torchopt.linear_solve.solve_cg(rtol=1e-13, maxiter=200))
    def inner_solver(w_init, lam_):
        return ridge.w_star(lam_.detach())

    lam_leaf = lam.clone().requires_grad_(True)
    w_opt = inner_solver(torch.zeros(6, dtype=DT), lam_leaf)
    (peer,) = torch.autograd.grad(problem.outer({"w": w_opt}, {"lam": lam_leaf}, None), lam_leaf)
    ours = hg.Implicit(hg.linear.CG(tol=1e-13)).hypergrad(problem, {"w": ridge.w_star(lam)}, {"lam": lam})
    assert rel_err(ours.grad["lam"], peer) < 1e-8
    assert rel_err(ours.grad["lam"], ridge.hypergrad(lam)) < 1e-9


class _CountOp(TorchDispatchMode):
    """Counts the calls of one ATen operator, wherever they run: in the losses, in the first
    backward pass and in the backward passes the autograd engine runs for the products."""

    def __init__(self, op):
        super().__init__()
        self.op, self.calls = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is self.op
        return func(*args, **(kwargs or {}))


def test_cg_spends_one_product_per_iteration_and_no_other_pass_over_the_data():
    """The cost model the benchmarks rest on (Implicit(CG) vs torchopt's custom_root): per
    hypergradient one outer gradient, one inner gradient with a graph, one Hessian-vector product
    per CG iteration and one mixed product; no product for an initial or final residual.

    Logistic regression with per-feature L2: every pass over the data matrix is one ``mm`` (the
    losses' forward passes, their gradients and each product's two), the mixed product none (it
    only crosses the regulariser), so the count of ``mm`` calls is ``4 + 2 * iterations``.
    """
    gen = torch.Generator().manual_seed(0)
    n, d = 60, 15
    X, Xv = torch.randn(n, d, generator=gen, dtype=DT), torch.randn(n, d, generator=gen, dtype=DT)
    y, yv = (torch.rand(n, generator=gen, dtype=DT) < 0.5).to(DT), (torch.rand(n, generator=gen, dtype=DT) < 0.5).to(DT)
    bce = torch.nn.functional.binary_cross_entropy_with_logits

    def g(w, lam, batch):
        z = torch.mm(X, w["w"]).squeeze(1)
        return bce(z, y) + 0.5 * (torch.exp(lam["log_l2"]) * w["w"].squeeze(1) ** 2).sum()

    def f(w, lam, batch):
        return bce(torch.mm(Xv, w["w"]).squeeze(1), yv)

    problem = hg.BilevelProblem(g, f)
    lam = {"log_l2": torch.full((d,), -2.0, dtype=DT)}
    w = hg.inner_solve(problem, {"w": torch.zeros(d, 1, dtype=DT)}, lam, 200, hg.inner.LBFGS(), tol=1e-12).w
    counter = _CountOp(torch.ops.aten.mm.default)
    with counter:
        r = hg.Implicit(hg.linear.CG(tol=1e-10)).hypergrad(problem, w, lam)
    assert r.info.converged and r.info.iterations >= 5
    assert r.info.extra["matvecs"] == r.info.iterations and r.info.grad_evals == 3 + r.info.iterations
    assert counter.calls == 4 + 2 * r.info.iterations
