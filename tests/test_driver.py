"""The outer loop: convergence to the closed-form optimum, history, batches, validation."""

from __future__ import annotations

import pytest
import torch

import hypergrad as hg
from tests._problems import DT, Ridge


def _golden_section(fn, lo, hi, iters=200):
    phi = (5**0.5 - 1) / 2
    a, b = lo, hi
    for _ in range(iters):
        c, d = b - phi * (b - a), a + phi * (b - a)
        if fn(c) < fn(d):
            b = d
        else:
            a = c
    return 0.5 * (a + b)


def test_solve_with_implicit_reaches_the_outer_optimum():
    ridge = Ridge.random(40, 10, seed=3, noise=2.0)
    lam_star = _golden_section(lambda t: float(ridge.outer_value(torch.tensor([t], dtype=DT))), -6.0, 6.0)
    problem = ridge.problem()
    L = float(torch.linalg.eigvalsh(ridge.X.T @ ridge.X).max())
    res = hg.solve(
        problem,
        {"w": torch.zeros(10, dtype=DT)},
        {"lam": torch.zeros(1, dtype=DT)},
        hg.Implicit(hg.linear.CG(tol=1e-10)),
        outer_optimizer=lambda p: torch.optim.Adam(p, lr=0.1),
        steps=300,
        inner_steps=50,
        inner_optimizer=hg.inner.SGD(lr=1.0 / (L + 10)),
        progress=False,
    )
    assert abs(float(res.lam["lam"]) - lam_star) < 1e-3
    assert len(res.history["outer_loss"]) == 300
    assert res.history["outer_loss"][-1] < res.history["outer_loss"][0]
    assert res.history["inner_residual"][-1] < 1e-6


def test_batches_are_cycled_and_passed_to_the_losses():
    seen_inner, seen_outer = [], []

    def g(w, lam, batch):
        seen_inner.append(batch)
        return 0.5 * ((w["x"] - lam["c"]) ** 2).sum()

    def f(w, lam, batch):
        seen_outer.append(batch)
        return 0.5 * (w["x"] ** 2).sum()

    hg.solve(
        hg.BilevelProblem(g, f), {"x": torch.zeros(2)}, {"c": torch.ones(2)}, hg.Implicit(hg.linear.Dense()),
        steps=2, inner_steps=1, inner_batches=["i0", "i1", "i2"], outer_batches=["o0"], progress=False,
    )
    assert "i0" in seen_inner and "i1" in seen_inner and "i2" in seen_inner
    assert set(seen_outer) == {"o0"}


def test_callback_and_state_are_threaded_through():
    class Counting:
        def hypergrad(self, problem, w, lam, inner_batch=None, outer_batch=None, state=None):
            r = hg.Implicit(hg.linear.Dense()).hypergrad(problem, w, lam, inner_batch, outer_batch)
            r.state = {"calls": (state or {}).get("calls", 0) + 1}
            return r

    g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()  # noqa: E731
    steps_seen = []
    res = hg.solve(hg.BilevelProblem(g, g), {"x": torch.zeros(1)}, {"c": torch.ones(1)}, Counting(),
                   steps=4, progress=False, callback=lambda step, w, lam, r: steps_seen.append(step))
    assert res.state == {"calls": 4}
    assert steps_seen == [0, 1, 2, 3]


def test_non_finite_hypergradient_stops_the_run():
    g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()  # noqa: E731
    f = lambda w, lam, b: torch.sqrt(w["x"]).sum()  # noqa: E731  (NaN gradient at x < 0)
    with pytest.raises(hg.NonFiniteError):
        hg.solve(hg.BilevelProblem(g, f), {"x": -torch.ones(1)}, {"c": -torch.ones(1)},
                 hg.Implicit(hg.linear.Dense()), steps=1, progress=False)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"steps": 0}, "steps"), ({"inner_steps": -1}, "inner_steps"), ({"method": object()}, "method"),
     ({"outer_optimizer": lambda p: None}, "outer_optimizer")],
)
def test_invalid_arguments(kwargs, name):
    g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()  # noqa: E731
    args = {"method": hg.Implicit(hg.linear.Dense()), "progress": False, **kwargs}
    with pytest.raises((ValueError, TypeError), match=name):
        hg.solve(hg.BilevelProblem(g, g), {"x": torch.zeros(1)}, {"c": torch.ones(1)}, **args)
