"""Penalty (F2SA): O(sigma) bias, state carried across calls, 3 gradients per evaluation pair, per-step batches."""

from __future__ import annotations

import itertools

import pytest
import torch
from _host_reads import HostReads
from hypothesis import example, given, settings
from hypothesis import strategies as st

import hypergrad as hg
from tests._problems import DT, Quadratic, Ridge, rel_err

TAUS = (0.02, 0.01, 0.005, 0.0025)


def _sigma_errors(problem, w_star, lam, exact, L_g, mu_g, L_f, steps):
    """Errors of F2SA at sigma = tau * mu_g / L_f, inner problems solved by many SGD steps.

    ``w`` starts at the exact inner solution and ``w_sigma`` there too (state None); ``steps``
    SGD steps with ``lr = 1 / L`` bring ``w_sigma`` to its minimiser up to round-off.
    """
    errors = []
    for tau in TAUS:
        sigma = tau * mu_g / L_f
        method = hg.Penalty(sigma, hg.inner.SGD(lr=1.0 / (L_g + sigma * L_f)), inner_steps=steps)
        r = method.hypergrad(problem, w_star, lam)
        errors.append(rel_err(r.grad["lam"], exact))
    return errors


def _check_linear(errors):
    ratios = [a / b for a, b in itertools.pairwise(errors)]
    # (relative errors can be large where the exact hypergradient is near zero; the ratios are
    # what matters: they show the asymptotic regime)
    assert errors[-1] > 1e-8, errors  # the bias is really there, above round-off
    assert all(1.7 < r < 2.3 for r in ratios), (errors, ratios)


@settings(max_examples=8, deadline=None)
@given(n=st.integers(2, 12), p=st.integers(1, 4), log_cond=st.floats(0.0, 2.0),
       seed=st.integers(0, 10_000))
@example(n=12, p=4, log_cond=2.0, seed=1)  # the worst conditioning, always
def test_bias_is_first_order_in_sigma_on_random_quadratics(n, p, log_cond, seed):
    q = Quadratic.random(n, p, 10.0**log_cond, seed)
    lam = torch.randn(p, dtype=DT, generator=torch.Generator().manual_seed(seed + 1))
    eig = torch.linalg.eigvalsh(q.A)
    L_f = float(torch.linalg.eigvalsh(q.C.T @ q.C).max())
    # SGD at lr = 1/L contracts by (1 - 1/cond) a step: the step count grows with cond (condition
    # numbers up to 100; the start, w*(lam), is already O(sigma) from the penalised minimiser)
    steps = 300 + int(10 * float(eig.max() / eig.min()))
    errors = _sigma_errors(q.problem(), {"w": q.w_star(lam)}, {"lam": lam}, q.hypergrad(lam),
                           float(eig.max()), float(eig.min()), L_f, steps=steps)
    _check_linear(errors)


@settings(max_examples=8, deadline=None)
@given(n=st.integers(15, 40), d=st.integers(1, 6), per_feature=st.booleans(),
       log_reg=st.floats(0.0, 2.0), seed=st.integers(0, 10_000))
def test_bias_is_first_order_in_sigma_on_ridge(n, d, per_feature, log_reg, seed):
    ridge = Ridge.random(n, d, seed)
    lam = torch.full((d,) if per_feature else (1,), log_reg, dtype=DT)
    eig = torch.linalg.eigvalsh(ridge.hessian(lam))
    L_f = float(torch.linalg.eigvalsh(ridge.Xv.T @ ridge.Xv).max())
    errors = _sigma_errors(ridge.problem(), {"w": ridge.w_star(lam)}, {"lam": lam},
                           ridge.hypergrad(lam), float(eig.max()), float(eig.min()), L_f, steps=400)
    _check_linear(errors)


def test_state_carries_both_iterates_and_converges_with_one_step_per_call():
    """T=1 per call, state passed back: w and w_sigma reach their minimisers (closed form)."""
    q = Quadratic.random(6, 2, 5.0, 11)
    lam = torch.tensor([0.3, -0.7], dtype=DT)
    problem = q.problem()
    sigma = 0.01
    L = float(torch.linalg.eigvalsh(q.A + sigma * q.C.T @ q.C).max())
    method = hg.Penalty(sigma, hg.inner.Momentum(lr=0.5 / L, beta=0.5), inner_steps=1)
    w, state = {"w": torch.zeros(6, dtype=DT)}, None
    for k in range(400):
        r = method.hypergrad(problem, w, {"lam": lam}, state=state)
        if k == 0:
            # first call: w_sigma started at w, both took one step from zero
            assert set(r.state) == {"w", "w_sigma", "opt_state", "sigma_opt_state"}
            assert r.state["w_sigma"]["w"].shape == (6,)
            assert set(r.state["opt_state"]) == {"m.w"}
        w, state = r.w, r.state
    assert state is not None and state["w"] is r.w
    w_sigma_exact = torch.linalg.solve(
        q.A + sigma * q.C.T @ q.C, q.B @ lam + q.c + sigma * q.C.T @ q.d
    )
    assert rel_err(w["w"], q.w_star(lam)) < 1e-10
    assert rel_err(state["w_sigma"]["w"], w_sigma_exact) < 1e-10
    # same estimate as one call with many steps from the exact solution
    many = hg.Penalty(sigma, hg.inner.SGD(lr=1.0 / L), inner_steps=500).hypergrad(
        problem, {"w": q.w_star(lam)}, {"lam": lam}
    )
    assert rel_err(r.grad["lam"], many.grad["lam"]) < 1e-8


def test_state_w_sigma_is_used_not_reset():
    q = Quadratic.random(4, 1, 3.0, 2)
    lam = {"lam": torch.ones(1, dtype=DT)}
    method = hg.Penalty(0.1, hg.inner.SGD(lr=0.01), inner_steps=1)
    w = {"w": q.w_star(lam["lam"])}
    far = {"w_sigma": {"w": w["w"] + 100.0}}
    r_far = method.hypergrad(q.problem(), w, lam, state=far)
    r_none = method.hypergrad(q.problem(), w, lam)
    assert not torch.allclose(r_far.grad["lam"], r_none.grad["lam"])
    assert float((r_far.state["w_sigma"]["w"] - w["w"]).norm()) > 50.0


def test_state_with_wrong_shape_raises():
    q = Quadratic.random(4, 1, 3.0, 2)
    lam = {"lam": torch.ones(1, dtype=DT)}
    method = hg.Penalty(0.1, hg.inner.SGD(lr=0.1))
    with pytest.raises(ValueError, match="w_sigma"):
        method.hypergrad(q.problem(), {"w": torch.zeros(4, dtype=DT)}, lam,
                         state={"w_sigma": {"w": torch.zeros(5, dtype=DT)}})


class _Counter:
    def __init__(self):
        self.forward = 0
        self.backward = 0


def _counting(fn, counter):
    """Wrap a loss so that forward and backward passes through it are counted."""

    class _Tap(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            counter.backward += 1
            return grad

    def wrapped(w, lam, batch):
        counter.forward += 1
        return _Tap.apply(fn(w, lam, batch))

    return wrapped


@pytest.mark.parametrize("T", [1, 2, 5])
def test_cost_counts_every_gradient_3T_plus_3(T, monkeypatch):
    q = Quadratic.random(5, 2, 3.0, 0)
    base = q.problem()
    cg, cf = _Counter(), _Counter()
    problem = hg.BilevelProblem(_counting(base.inner, cg), _counting(base.outer, cf))
    calls = {"grad": 0, "create_graph": 0}
    orig = torch.autograd.grad

    def grad(*args, **kwargs):
        calls["grad"] += 1
        calls["create_graph"] += bool(kwargs.get("create_graph", False))
        return orig(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", grad)
    lam = {"lam": torch.ones(2, dtype=DT)}
    r = hg.Penalty(0.1, hg.inner.SGD(lr=0.1), inner_steps=T, evaluate="advanced").hypergrad(
        problem, {"w": torch.zeros(5, dtype=DT)}, lam
    )
    # T+1 backward passes of g at w and T+1 of g + sigma f at w_sigma, each one autograd.grad
    # call giving the w- and lam-gradients together; f is differentiated only inside g+sigma f.
    # grad_evals counts every gradient: g at w, and g and f at w_sigma, 3 per pair.
    assert calls["grad"] == 2 * T + 2
    assert r.info.grad_evals == cg.backward + cf.backward == 3 * T + 3
    assert cg.backward == 2 * T + 2 and cg.forward == 2 * T + 2
    assert cf.backward == T + 1 and cf.forward == T + 1
    assert calls["create_graph"] == 0
    if T == 1:
        assert r.info.grad_evals == 6


def test_non_finite_estimate_raises():
    g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()  # noqa: E731
    f = lambda w, lam, b: torch.where(w["x"] > 1e9, torch.sqrt(-w["x"]), w["x"]).sum()  # noqa: E731
    lam = {"c": torch.tensor([1.0, 2.0], dtype=DT)}
    with pytest.raises(hg.NonFiniteError):
        hg.Penalty(0.1, hg.inner.SGD(lr=0.5)).hypergrad(hg.BilevelProblem(g, f), {"x": lam["c"].clone()}, lam)


def test_diagnostics():
    q = Quadratic.random(4, 1, 3.0, 2)
    lam = {"lam": torch.ones(1, dtype=DT)}
    r = hg.Penalty(0.5, hg.inner.SGD(lr=0.1), inner_steps=3).hypergrad(
        q.problem(), {"w": q.w_star(lam["lam"])}, lam
    )
    assert r.info.iterations == 3 and r.info.extra["sigma"] == 0.5
    assert r.info.extra["inner_residual"] < 1e-10 and r.info.extra["gap"] > 0


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"sigma": 0.0}, ValueError, "sigma"),
        ({"sigma": -0.1}, ValueError, "sigma"),
        ({"sigma": float("inf")}, ValueError, "sigma"),
        ({"sigma": "1"}, TypeError, "sigma"),
        ({"inner_steps": 0}, ValueError, "inner_steps"),
        ({"inner_steps": 1.5}, TypeError, "inner_steps"),
        ({"inner_optimizer": None}, TypeError, "inner_optimizer"),
        ({"inner_optimizer": torch.optim.SGD}, TypeError, "inner_optimizer"),
        ({"sigma_optimizer": 0.1}, TypeError, "sigma_optimizer"),
    ],
)
def test_invalid_arguments_raise_naming_the_argument(kwargs, error, name):
    args = {"sigma": 0.1, "inner_optimizer": hg.inner.SGD(lr=0.1)} | kwargs
    with pytest.raises(error, match=name):
        hg.Penalty(**args)


def test_default_is_evaluate_current():
    assert hg.Penalty(0.1, hg.inner.SGD(lr=0.1)).evaluate == "current"


def test_evaluate_current_is_the_advanced_estimate_one_step_earlier_at_3T_cost():
    """evaluate="current" with T steps gives the estimate "advanced" gives with T - 1 steps, and
    the iterates "advanced" reaches with T steps, for 3 T gradient evaluations."""
    q = Quadratic.random(6, 2, 10.0, 3)
    problem = q.problem()
    lam = {"lam": torch.tensor([0.3, -0.2], dtype=DT)}
    w0 = {"w": torch.zeros(6, dtype=DT)}
    for T in (2, 4):
        cur = hg.Penalty(0.05, hg.inner.SGD(lr=0.05), inner_steps=T, evaluate="current")
        adv_before = hg.Penalty(0.05, hg.inner.SGD(lr=0.05), inner_steps=T - 1, evaluate="advanced")
        adv_after = hg.Penalty(0.05, hg.inner.SGD(lr=0.05), inner_steps=T, evaluate="advanced")
        rc = cur.hypergrad(problem, w0, lam)
        rb = adv_before.hypergrad(problem, w0, lam)
        ra = adv_after.hypergrad(problem, w0, lam)
        assert rel_err(rc.grad["lam"], rb.grad["lam"]) < 1e-12
        assert rel_err(rc.grad["lam"], ra.grad["lam"]) > 1e-6  # a different point, not a copy
        assert torch.allclose(rc.w["w"], ra.w["w"], rtol=0, atol=1e-14)
        assert torch.allclose(rc.state["w_sigma"]["w"], ra.state["w_sigma"]["w"], rtol=0, atol=1e-14)
        assert rc.info.grad_evals == 3 * T and ra.info.grad_evals == 3 * T + 3


def test_evaluate_current_costs_three_gradients_at_T1(monkeypatch):
    q = Quadratic.random(5, 2, 3.0, 0)
    base = q.problem()
    cg, cf = _Counter(), _Counter()
    problem = hg.BilevelProblem(_counting(base.inner, cg), _counting(base.outer, cf))
    lam = {"lam": torch.ones(2, dtype=DT)}
    r = hg.Penalty(0.1, hg.inner.SGD(lr=0.1), evaluate="current").hypergrad(
        problem, {"w": torch.zeros(5, dtype=DT)}, lam
    )
    # one backward of g at w, one of g + sigma f at w_sigma: 3 gradients (g twice, f once)
    assert r.info.grad_evals == 3 == cg.backward + cf.backward and cg.backward == 2 and cf.backward == 1


def test_converged_means_both_inner_residuals_below_tol():
    q = Quadratic.random(4, 1, 3.0, 2)
    problem = q.problem()
    lam = {"lam": torch.ones(1, dtype=DT)}
    w_star = {"w": q.w_star(lam["lam"])}
    method = hg.Penalty(0.01, hg.inner.SGD(lr=0.1), tol=1e-6)
    # at w*: the w residual is ~0 but w_sigma (starting at w*) is O(sigma) off its optimum
    r = method.hypergrad(problem, w_star, lam)
    assert r.info.extra["inner_residual"] < 1e-6 < r.info.extra["sigma_residual"]
    assert r.info.converged is False
    for _ in range(2000):  # one step per call, carrying the state: both iterates converge
        r = method.hypergrad(problem, r.w, lam, state=r.state)
    assert max(r.info.extra["inner_residual"], r.info.extra["sigma_residual"]) < 1e-6
    assert r.info.converged is True
    far = hg.Penalty(0.01, hg.inner.SGD(lr=0.1), tol=1e-6).hypergrad(problem, {"w": torch.zeros(4, dtype=DT)}, lam)
    assert far.info.converged is False
    with pytest.raises(ValueError, match="tol"):
        hg.Penalty(0.1, hg.inner.SGD(lr=0.1), tol=-1.0)
    with pytest.raises(ValueError, match="evaluate"):
        hg.Penalty(0.1, hg.inner.SGD(lr=0.1), evaluate="later")


@pytest.mark.parametrize(("evaluate", "pairs"), [("current", 3), ("advanced", 4)])
def test_step_batches_give_a_fresh_batch_per_evaluation_pair(evaluate, pairs):
    """With StepBatches each evaluation pair reads the next inner and outer batch; both iterates
    of a pair see the same batches."""
    seen_g, seen_f = [], []

    def g(w, lam, batch):
        seen_g.append(batch)
        return 0.5 * ((w["x"] - lam["c"] * batch) ** 2).sum()

    def f(w, lam, batch):
        seen_f.append(batch)
        return 0.5 * ((w["x"] - batch) ** 2).sum()

    method = hg.Penalty(0.1, hg.inner.SGD(lr=0.5), inner_steps=3, evaluate=evaluate)
    inner, outer = iter([1.0, 2.0, 3.0, 4.0, 5.0]), iter([-1.0, -2.0, -3.0, -4.0, -5.0])
    lam = {"c": torch.ones(2, dtype=DT)}
    method.hypergrad(hg.BilevelProblem(g, f), {"x": torch.zeros(2, dtype=DT)}, lam,
                     inner_batch=hg.StepBatches(inner), outer_batch=hg.StepBatches(outer))
    expected = [1.0, 2.0, 3.0, 4.0][:pairs]
    assert seen_g == [b for b in expected for _ in range(2)]   # g at w, then g + sigma f at w_sigma
    assert seen_f == [-b for b in expected]
    assert next(inner) == pairs + 1.0 and next(outer) == -(pairs + 1.0)   # drew exactly what it used


@pytest.mark.parametrize("evaluate", ["current", "advanced"])
def test_device_scalars_give_the_same_estimate_and_read_nothing_back(evaluate):
    q = Quadratic.random(4, 3, 10.0, seed=5)
    lam = {"lam": torch.tensor([0.5, -1.0, 2.0], dtype=DT)}
    w = {"w": torch.zeros(4, dtype=DT)}
    kwargs = dict(sigma=0.1, inner_optimizer=hg.inner.Adam(lr=0.05), inner_steps=3, evaluate=evaluate)
    host = hg.Penalty(**kwargs).hypergrad(q.problem(), w, lam)
    reads = HostReads()
    with reads:
        device = hg.Penalty(**kwargs, device_scalars=True).hypergrad(q.problem(), w, lam)
    assert reads.count == 0
    assert torch.equal(device.grad["lam"], host.grad["lam"]) and torch.equal(device.w["w"], host.w["w"])
    assert torch.equal(device.state["w_sigma"]["w"], host.state["w_sigma"]["w"])
    for k, value in host.info.extra.items():
        assert float(device.info.extra[k]) == value if isinstance(value, float) else device.info.extra[k] == value, k
    assert bool(device.info.converged) is host.info.converged and bool(device.info.extra["finite"])
    nan_f = hg.BilevelProblem(q.problem().inner, lambda w_, l_, b: q.problem().outer(w_, l_, b) * float("nan"))
    assert not bool(hg.Penalty(**kwargs, device_scalars=True).hypergrad(nan_f, w, lam).info.extra["finite"])
    with pytest.raises(hg.NonFiniteError):
        hg.Penalty(**kwargs).hypergrad(nan_f, w, lam)
