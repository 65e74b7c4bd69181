"""BOME: the multiplier on hand cases, and convergence to the bilevel solution of ridge regression."""

from __future__ import annotations

import itertools

import pytest
import torch
from _host_reads import HostReads
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hypergrad as hg
from hypergrad.bome import bome_phi
from tests._problems import DT

# ---------------------------------------------------------------------------------------------
# Hand cases. w, lam scalars; g = (w - lam)^2 / 2, so one SGD step with lr = 1 lands on
# w_hat = lam exactly: q = (w - lam)^2 / 2, grad_w q = w - lam, grad_lam q = -(w - lam) - 0.
# f = a w + b lam, so grad f = (a, b). At w = 2, lam = 0: q = 2, grad q = (2, -2), |grad q|^2 = 8.


def _hand_problem(a: float, b: float) -> hg.BilevelProblem:
    g = lambda w, lam, batch: 0.5 * ((w["w"] - lam["lam"]) ** 2).sum()  # noqa: E731
    f = lambda w, lam, batch: (a * w["w"] + b * lam["lam"]).sum()  # noqa: E731
    return hg.BilevelProblem(g, f)


W0 = {"w": torch.tensor([2.0], dtype=DT)}
LAM0 = {"lam": torch.tensor([0.0], dtype=DT)}


@pytest.mark.parametrize(
    ("a", "b", "eta", "barrier", "phi"),
    [
        # value: phi = (eta q - <f', q'>) / |q'|^2, <f', q'> = 2a - 2b
        (1.0, 0.0, 3.0, "value", (3.0 * 2 - 2.0) / 8),  # 0.5
        (1.0, 1.0, 1.0, "value", (1.0 * 2 - 0.0) / 8),  # 0.25: grad f orthogonal to grad q
        (-1.0, 0.5, 0.5, "value", (0.5 * 2 + 3.0) / 8),  # 0.5: grad f points uphill in q
        (5.0, 0.0, 3.0, "value", 0.0),  # slack: 2a = 10 > eta q = 6, no correction
        # gradient: phi = (eta |q'|^2 - <f', q'>) / |q'|^2
        (1.0, 0.0, 1.0, "gradient", (1.0 * 8 - 2.0) / 8),  # 0.75
        (1.0, 0.0, 0.1, "gradient", 0.0),  # slack: <f', q'> = 2 > 0.8
        (-1.0, 0.0, 0.1, "gradient", (0.8 + 2.0) / 8),  # 0.35
    ],
)
def test_phi_and_direction_on_hand_cases(a, b, eta, barrier, phi):
    w_lr = 0.1
    method = hg.BOME(hg.inner.SGD(lr=1.0), w_lr=w_lr, inner_steps=1, eta=eta, barrier=barrier)
    r = method.hypergrad(_hand_problem(a, b), W0, LAM0)
    assert r.info.extra["phi"] == pytest.approx(phi, abs=1e-14)
    assert r.info.extra["q"] == pytest.approx(2.0, abs=1e-14)
    assert r.info.extra["grad_q_norm"] == pytest.approx(8**0.5, abs=1e-14)
    d_w, d_lam = a + phi * 2.0, b - phi * 2.0  # d = grad f + phi grad q
    assert r.grad["lam"].item() == pytest.approx(d_lam, abs=1e-14)
    assert r.w["w"].item() == pytest.approx(2.0 - w_lr * d_w, abs=1e-14)
    assert r.state is None and r.info.grad_evals == 3


def test_hand_case_with_several_inner_steps():
    """T = 2 steps of lr 0.5 from w = 2: w_hat = 2 * 0.25 = 0.5, q = 2 - 0.125 = 1.875,
    grad_lam q = -(2 - 0) + (0.5 - 0) = -1.5, grad_w q = 2."""
    method = hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1, inner_steps=2, eta=1.0, barrier="value")
    r = method.hypergrad(_hand_problem(1.0, 0.0), W0, LAM0)
    sq = 2.0**2 + 1.5**2
    phi = (1.0 * 1.875 - 1.0 * 2.0) / sq  # negative: clipped to 0
    assert phi < 0 and r.info.extra["phi"] == 0.0
    assert r.info.extra["q"] == pytest.approx(1.875, abs=1e-14)
    assert r.info.extra["grad_q_norm"] == pytest.approx(sq**0.5, abs=1e-14)
    assert r.grad["lam"].item() == 0.0 and r.w["w"].item() == pytest.approx(2.0 - 0.1 * 1.0)
    r = hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1, inner_steps=2, eta=4.0).hypergrad(
        _hand_problem(1.0, 0.0), W0, LAM0
    )
    phi = (4.0 * 1.875 - 2.0) / sq
    assert r.info.extra["phi"] == pytest.approx(phi, abs=1e-14)
    assert r.grad["lam"].item() == pytest.approx(-1.5 * phi, abs=1e-14)
    assert r.info.grad_evals == 4


def test_bome_phi_function():
    assert bome_phi(2.0, 2.0, 8.0, 3.0, "value") == 0.5
    assert bome_phi(2.0, 2.0, 8.0, 1.0, "gradient") == 0.75
    assert bome_phi(2.0, 10.0, 8.0, 3.0, "value") == 0.0
    assert bome_phi(2.0, -1.0, 0.0, 3.0, "value") == 0.0  # grad q = 0: nothing to correct
    with pytest.raises(ValueError, match="barrier"):
        bome_phi(1.0, 1.0, 1.0, 1.0, "log")


def test_at_the_inner_solution_the_direction_is_grad_f():
    """w = w*(lam): q = 0 and grad q = 0, so phi = 0 and d = grad f."""
    method = hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1, inner_steps=3)
    lam = {"lam": torch.tensor([1.5], dtype=DT)}
    r = method.hypergrad(_hand_problem(2.0, -3.0), {"w": lam["lam"].clone()}, lam)
    assert r.info.extra == {"phi": 0.0, "q": 0.0, "grad_q_norm": 0.0}
    assert r.grad["lam"].item() == -3.0 and r.w["w"].item() == pytest.approx(1.5 - 0.1 * 2.0)


# ---------------------------------------------------------------------------------------------
# Convergence on ridge regression, regularisation strength chosen on validation data.


def _ridge(n: int, d: int, seed: int, lam0: float, noise_v: float):
    r"""g = |X w - y|^2 / 2n + exp(lam) |w|^2 / 2,  f = |Xv w - yv|^2 / 2n  (lam scalar).

    The validation targets come from the ridge fit at ``lam0`` plus noise ``noise_v``, so F has a
    unique minimiser near ``lam0`` and the validation residual there is small (BOME with fixed
    steps stalls at a distance O(w_lr * |grad_w f|) from the solution, see the BOME docstring).
    """
    gen = torch.Generator().manual_seed(seed)
    w_true = torch.randn(d, generator=gen, dtype=DT)
    X, Xv = torch.randn(n, d, generator=gen, dtype=DT), torch.randn(n, d, generator=gen, dtype=DT)
    y = X @ w_true + torch.randn(n, generator=gen, dtype=DT)

    def w_star(lam: torch.Tensor) -> torch.Tensor:
        return torch.linalg.solve(X.T @ X / n + torch.exp(lam) * torch.eye(d, dtype=DT), X.T @ y / n)

    yv = Xv @ w_star(torch.tensor([lam0], dtype=DT)) + noise_v * torch.randn(n, generator=gen, dtype=DT)

    def g(w, lam, batch):
        r = X @ w["w"] - y
        return 0.5 * (r @ r) / n + 0.5 * torch.exp(lam["lam"]).sum() * (w["w"] @ w["w"])

    def f(w, lam, batch):
        r = Xv @ w["w"] - yv
        return 0.5 * (r @ r) / n

    def dF(lam: float) -> float:
        lam_ = torch.tensor([lam], dtype=DT, requires_grad=True)
        r = Xv @ w_star(lam_) - yv
        return torch.autograd.grad(0.5 * (r @ r) / n, lam_)[0].item()

    L = float(torch.linalg.eigvalsh(X.T @ X / n).max()) + 1.0  # bound on the inner curvature
    return hg.BilevelProblem(g, f), w_star, dF, L


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), lam0=st.floats(-1.5, -0.5))
def test_reaches_the_bilevel_solution_of_ridge_regression(seed, lam0):
    d, n = 5, 30
    problem, w_star, dF, L = _ridge(n, d, seed, lam0, noise_v=0.002)
    # The outer optimum is unique: F' changes sign once on a grid; bisection on the closed-form
    # F' inside that bracket gives the reference lam* (to float64 resolution).
    grid = torch.linspace(-4.0, 2.0, 61).tolist()
    signs = [dF(x) > 0 for x in grid]
    assert sum(a != b for a, b in itertools.pairwise(signs)) == 1
    i = signs.index(True)
    assert i > 0  # F' < 0 at the left end: the minimiser is inside the grid
    lo, hi = grid[i - 1], grid[i]
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if dF(mid) < 0 else (lo, mid)
    lam_star = 0.5 * (lo + hi)
    w0, lam_init = {"w": torch.zeros(d, dtype=DT)}, {"lam": torch.zeros(1, dtype=DT)}
    outer = lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.7)  # noqa: E731
    assert abs(lam_init["lam"].item() - lam_star) > 0.4  # BOME has somewhere to go
    for barrier in ("value", "gradient"):
        bome = hg.BOME(hg.inner.SGD(lr=1.0 / L), w_lr=0.3, inner_steps=10, eta=0.5, barrier=barrier)
        # w moves with w_lr = 0.3, lam with a heavy-ball outer optimizer (no inner steps in the
        # driver: BOME advances w itself).
        res = hg.solve(problem, w0, lam_init, bome, outer, steps=300, progress=False)
        lam_bome = res.lam["lam"].item()
        assert abs(lam_bome - lam_star) < 1e-3, (barrier, lam_bome, lam_star)
        assert float((res.w["w"] - w_star(res.lam["lam"])).norm()) < 1e-2


def test_no_double_backward_and_cost(monkeypatch):
    problem, _w_star, _dF, _L = _ridge(20, 3, 1, -1.0, 0.1)
    calls = {"grad": 0, "create_graph": 0}
    orig = torch.autograd.grad

    def grad(*args, **kwargs):
        calls["grad"] += 1
        calls["create_graph"] += bool(kwargs.get("create_graph", False))
        return orig(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", grad)
    for T in (1, 4):
        calls["grad"] = 0
        r = hg.BOME(hg.inner.SGD(lr=0.1), w_lr=0.1, inner_steps=T).hypergrad(
            problem, {"w": torch.zeros(3, dtype=DT)}, {"lam": torch.zeros(1, dtype=DT)}
        )
        assert calls["grad"] == T + 2 == r.info.grad_evals
    assert calls["create_graph"] == 0


def test_non_finite_direction_raises():
    g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()  # noqa: E731
    f = lambda w, lam, b: torch.where(w["x"] > 1e9, torch.sqrt(-w["x"]), w["x"]).sum()  # noqa: E731
    lam = {"c": torch.tensor([1.0, 2.0], dtype=DT)}
    with pytest.raises(hg.NonFiniteError):
        hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1).hypergrad(hg.BilevelProblem(g, f), {"x": lam["c"] + 1}, lam)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"inner_steps": 0}, ValueError, "inner_steps"),
        ({"inner_steps": 2.0}, TypeError, "inner_steps"),
        ({"eta": 0.0}, ValueError, "eta"),
        ({"eta": -1.0}, ValueError, "eta"),
        ({"eta": "big"}, TypeError, "eta"),
        ({"w_lr": 0.0}, ValueError, "w_lr"),
        ({"w_lr": float("nan")}, ValueError, "w_lr"),
        ({"barrier": "log"}, ValueError, "barrier"),
        ({"inner_optimizer": "sgd"}, TypeError, "inner_optimizer"),
    ],
)
def test_invalid_arguments_raise_naming_the_argument(kwargs, error, name):
    args = {"inner_optimizer": hg.inner.SGD(lr=0.1), "w_lr": 0.1} | kwargs
    with pytest.raises(error, match=name):
        hg.BOME(**args)


def test_w_optimizer_steps_w_and_carries_its_state():
    g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()  # noqa: E731
    f = lambda w, lam, b: 0.5 * ((w["x"] - 3.0) ** 2).sum()  # noqa: E731
    problem = hg.BilevelProblem(g, f)
    w, lam = {"x": torch.zeros(2, dtype=torch.float64)}, {"c": torch.ones(2, dtype=torch.float64)}
    plain = hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1, inner_steps=2)
    adam = hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1, inner_steps=2, w_optimizer=hg.inner.Adam(lr=0.1))
    r_plain, r_adam = plain.hypergrad(problem, w, lam), adam.hypergrad(problem, w, lam)
    assert torch.allclose(r_plain.grad["c"], r_adam.grad["c"])  # same direction for lam
    d_w = (w["x"] - r_plain.w["x"]) / 0.1
    # Adam's first step moves every coordinate by lr * sign(d_w).
    assert torch.allclose(r_adam.w["x"], w["x"] - 0.1 * torch.sign(d_w), atol=1e-6)
    assert float(r_adam.state["w_opt_state"]["t"]) == 1.0
    r2 = adam.hypergrad(problem, r_adam.w, lam, state=r_adam.state)
    assert float(r2.state["w_opt_state"]["t"]) == 2.0
    with pytest.raises(TypeError, match="w_optimizer"):
        hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1, w_optimizer="adam")


def test_w_lr_is_optional_with_a_w_optimizer_and_required_without():
    g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()  # noqa: E731
    f = lambda w, lam, b: 0.5 * ((w["x"] - 3.0) ** 2).sum()  # noqa: E731
    problem = hg.BilevelProblem(g, f)
    w, lam = {"x": torch.zeros(2, dtype=DT)}, {"c": torch.ones(2, dtype=DT)}
    with pytest.raises(ValueError, match="w_lr must be a number > 0 unless w_optimizer"):
        hg.BOME(hg.inner.SGD(lr=0.5))
    with_lr = hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1, w_optimizer=hg.inner.Adam(lr=0.1))
    without = hg.BOME(hg.inner.SGD(lr=0.5), w_optimizer=hg.inner.Adam(lr=0.1))
    a, b = with_lr.hypergrad(problem, w, lam), without.hypergrad(problem, w, lam)
    assert torch.equal(a.w["x"], b.w["x"]) and torch.equal(a.grad["c"], b.grad["c"])


def test_converged_means_the_value_function_gap_is_below_tol():
    g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()  # noqa: E731
    f = lambda w, lam, b: 0.5 * ((w["x"] - 3.0) ** 2).sum()  # noqa: E731
    problem = hg.BilevelProblem(g, f)
    lam = {"c": torch.ones(2, dtype=DT)}
    bome = hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1, inner_steps=3, tol=1e-8)
    far = bome.hypergrad(problem, {"x": torch.zeros(2, dtype=DT)}, lam)
    # q = g(0) - g(w_hat_3): g(0) = 1, w_hat_3 = 1 - 0.5^3 per coordinate
    assert far.info.extra["q"] == pytest.approx(1.0 - 0.5**6, rel=1e-12)
    assert far.info.converged is False
    near = bome.hypergrad(problem, {"x": lam["c"] + 1e-5}, lam)
    assert near.info.extra["q"] < 1e-8 and near.info.converged is True
    loose = hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1, inner_steps=3, tol=1.0)
    assert loose.hypergrad(problem, {"x": torch.zeros(2, dtype=DT)}, lam).info.converged is True
    with pytest.raises(ValueError, match="tol"):
        hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1, tol=-1.0)


def test_step_batches_give_a_fresh_batch_per_inner_step_and_count_every_gradient():
    """With StepBatches the T inner steps read T fresh batches; q's second value of g is on the
    first step's batch; f reads one outer batch. grad_evals counts each loss differentiated."""
    seen_g, seen_f = [], []

    def g(w, lam, batch):
        seen_g.append(batch)
        return 0.5 * ((w["x"] - lam["c"] * batch) ** 2).sum()

    def f(w, lam, batch):
        seen_f.append(batch)
        return 0.5 * ((w["x"] - batch) ** 2).sum()

    T = 3
    inner, outer = iter([1.0, 2.0, 3.0, 4.0]), iter([-1.0, -2.0])
    r = hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1, inner_steps=T).hypergrad(
        hg.BilevelProblem(g, f), {"x": torch.zeros(2, dtype=DT)}, {"c": torch.ones(2, dtype=DT)},
        inner_batch=hg.StepBatches(inner), outer_batch=hg.StepBatches(outer))
    assert seen_g == [1.0, 2.0, 3.0, 1.0]     # steps on batches 1..T, then g(w_hat_T) on batch 1
    assert seen_f == [-1.0]
    assert next(inner) == 4.0 and next(outer) == -2.0   # drew exactly what it used
    assert r.info.grad_evals == len(seen_g) + len(seen_f) == T + 2


# ---------------------------------------------------------------------------------------------
# device_scalars: the same step without reading anything back to the host


def _multi_leaf_problem() -> tuple[hg.BilevelProblem, dict, dict]:
    from tests._problems import Quadratic

    q = Quadratic.random(5, 3, 10.0, seed=3)
    g = lambda w, lam, b: q.problem().inner({"w": torch.cat([w["a"], w["b"]])}, lam, b)  # noqa: E731
    f = lambda w, lam, b: q.problem().outer({"w": torch.cat([w["a"], w["b"]])}, lam, b)  # noqa: E731
    w = {"a": torch.linspace(-1, 1, 2, dtype=DT), "b": torch.linspace(0, 2, 3, dtype=DT)}
    return hg.BilevelProblem(g, f), w, {"lam": torch.tensor([0.5, -1.0, 2.0], dtype=DT)}


@pytest.mark.parametrize("barrier", ["value", "gradient"])
@pytest.mark.parametrize("w_optimizer", [None, hg.inner.Adam(lr=0.05)])
def test_device_scalars_give_the_same_step_and_read_nothing_back(barrier, w_optimizer):
    problem, w, lam = _multi_leaf_problem()
    kwargs = dict(w_lr=None if w_optimizer else 0.1, inner_steps=3, eta=50.0, barrier=barrier,
                  w_optimizer=w_optimizer)
    host = hg.BOME(hg.inner.SGD(lr=0.05), **kwargs).hypergrad(problem, w, lam)
    reads = HostReads()
    with reads:
        device = hg.BOME(hg.inner.SGD(lr=0.05), device_scalars=True, **kwargs).hypergrad(problem, w, lam)
    assert reads.count == 0
    for k in lam:
        assert torch.equal(device.grad[k], host.grad[k])
    for k in w:
        assert torch.equal(device.w[k], host.w[k])
    assert set(device.info.extra) == {*host.info.extra, "finite"} and bool(device.info.extra["finite"])
    for k, value in host.info.extra.items():
        assert isinstance(value, float) and isinstance(device.info.extra[k], torch.Tensor)
        assert float(device.info.extra[k]) == value, k
    assert float(device.info.residual) == host.info.residual
    assert bool(device.info.converged) is host.info.converged
    assert host.info.extra["phi"] > 0  # the correction is active: phi reaches the directions


def test_device_scalars_flag_a_non_finite_step_instead_of_raising():
    problem, w, lam = _multi_leaf_problem()
    nan_f = hg.BilevelProblem(problem.inner, lambda w_, l_, b: problem.outer(w_, l_, b) * float("nan"))
    with pytest.raises(hg.NonFiniteError, match="outer loss is nan"):
        hg.BOME(hg.inner.SGD(lr=0.05), w_lr=0.1, inner_steps=2).hypergrad(nan_f, w, lam)
    r = hg.BOME(hg.inner.SGD(lr=0.05), w_lr=0.1, inner_steps=2, device_scalars=True).hypergrad(nan_f, w, lam)
    assert not bool(r.info.extra["finite"])
    ok = hg.BOME(hg.inner.SGD(lr=0.05), w_lr=0.1, inner_steps=2, device_scalars=True).hypergrad(problem, w, lam)
    assert bool(ok.info.extra["finite"])
    with pytest.raises(ValueError, match="device_scalars"):
        hg.BOME(hg.inner.SGD(lr=0.05), w_lr=0.1, compile=True, device_scalars=True)
    with pytest.raises(TypeError, match="device_scalars must be a bool"):
        hg.BOME(hg.inner.SGD(lr=0.05), w_lr=0.1, device_scalars=1)
