"""Pure inner optimizers (hypergrad.inner) against torch.optim, purity and argument checks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hypergrad as hg
from hypergrad.inner import InnerOptimizer

DT = torch.float64
STEPS = 20


def _problem(seed: int) -> tuple[dict[str, torch.Tensor], callable]:
    """A strongly convex quadratic over two leaves (a vector and a matrix) plus a quartic term."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(5, 5, generator=gen, dtype=DT))
    A = (q * torch.logspace(0, 1.3, 5, dtype=DT)) @ q.T
    b = torch.randn(5, generator=gen, dtype=DT)
    M = torch.randn(3, 2, generator=gen, dtype=DT)

    def loss(w: dict[str, torch.Tensor]) -> torch.Tensor:
        x, m = w["x"], w["m"]
        return 0.5 * x @ A @ x - b @ x + 0.5 * ((m - M) ** 2).sum() + 0.05 * (m**4).sum()

    w0 = {
        "x": torch.randn(5, generator=gen, dtype=DT),
        "m": torch.randn(3, 2, generator=gen, dtype=DT),
    }
    return w0, loss


def _ours(opt: InnerOptimizer, w0: dict[str, torch.Tensor], loss) -> list[dict[str, torch.Tensor]]:
    w = {k: v.clone() for k, v in w0.items()}
    state = opt.init(w)
    out = []
    for _ in range(STEPS):
        wg = {k: v.detach().requires_grad_(True) for k, v in w.items()}
        grads = torch.autograd.grad(loss(wg), list(wg.values()))
        with torch.no_grad():
            w, state = opt.update(w, dict(zip(w, grads, strict=True)), state)
        out.append({k: v.clone() for k, v in w.items()})
    return out


def _torch(make_opt, w0: dict[str, torch.Tensor], loss) -> list[dict[str, torch.Tensor]]:
    params = {k: torch.nn.Parameter(v.clone()) for k, v in w0.items()}
    opt = make_opt(list(params.values()))
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss(params).backward()
        opt.step()
        out.append({k: v.detach().clone() for k, v in params.items()})
    return out


def _max_diff(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> float:
    return max(float((x[k] - y[k]).abs().max()) for x, y in zip(a, b, strict=True) for k in x)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), lr=st.floats(0.01, 0.12))
def test_sgd_matches_torch_optim(seed: int, lr: float) -> None:
    w0, loss = _problem(seed)
    ours = _ours(hg.inner.SGD(lr=lr), w0, loss)
    ref = _torch(lambda p: torch.optim.SGD(p, lr=lr), w0, loss)
    assert _max_diff(ours, ref) < 1e-10
    assert _max_diff(ours, [w0] * STEPS) > 1e-3  # it moved


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    lr=st.floats(0.01, 0.08),
    beta=st.floats(0.0, 0.95),
    nesterov=st.booleans(),
)
def test_momentum_matches_torch_optim(seed: int, lr: float, beta: float, nesterov: bool) -> None:
    if nesterov and beta == 0.0:
        beta = 0.5  # torch.optim.SGD refuses nesterov without momentum
    w0, loss = _problem(seed)
    ours = _ours(hg.inner.Momentum(lr=lr, beta=beta, nesterov=nesterov), w0, loss)
    ref = _torch(lambda p: torch.optim.SGD(p, lr=lr, momentum=beta, nesterov=nesterov), w0, loss)
    assert _max_diff(ours, ref) < 1e-10


def test_momentum_and_nesterov_differ_from_sgd() -> None:
    """Guards the comparison above against an optimizer that ignores beta / nesterov."""
    w0, loss = _problem(0)
    sgd = _ours(hg.inner.SGD(lr=0.05), w0, loss)
    heavy = _ours(hg.inner.Momentum(lr=0.05, beta=0.9), w0, loss)
    nest = _ours(hg.inner.Momentum(lr=0.05, beta=0.9, nesterov=True), w0, loss)
    assert _max_diff(sgd, heavy) > 1e-3
    assert _max_diff(heavy, nest) > 1e-3


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    lr=st.floats(0.001, 0.1),
    beta1=st.floats(0.0, 0.95),
    beta2=st.floats(0.9, 0.9999),
    eps=st.sampled_from([1e-8, 1e-6, 1e-3]),
)
def test_adam_matches_torch_optim(
    seed: int, lr: float, beta1: float, beta2: float, eps: float
) -> None:
    w0, loss = _problem(seed)
    ours = _ours(hg.inner.Adam(lr=lr, betas=(beta1, beta2), eps=eps), w0, loss)
    ref = _torch(lambda p: torch.optim.Adam(p, lr=lr, betas=(beta1, beta2), eps=eps), w0, loss)
    assert _max_diff(ours, ref) < 1e-10


def test_adam_zero_gradient_coordinate_is_finite_and_differentiable() -> None:
    opt = hg.inner.Adam(lr=0.1)
    w = {"x": torch.tensor([1.0, 2.0], dtype=DT)}
    g = torch.tensor([0.0, 3.0], dtype=DT, requires_grad=True)
    new_w, _ = opt.update(w, {"x": g}, opt.init(w))
    assert new_w["x"][0] == 1.0  # a zero gradient does not move the coordinate
    (dg,) = torch.autograd.grad(new_w["x"].sum(), g)
    assert torch.isfinite(dg).all()


@pytest.mark.parametrize(
    "opt",
    [
        hg.inner.SGD(lr=0.1),
        hg.inner.Momentum(lr=0.1, beta=0.9, nesterov=True),
        hg.inner.Adam(lr=0.1),
    ],
    ids=["sgd", "momentum", "adam"],
)
def test_update_is_pure(opt: InnerOptimizer) -> None:
    """update() must not modify its inputs in place: unrolling relies on every iterate surviving."""
    assert isinstance(opt, InnerOptimizer)
    w = {"x": torch.randn(4, dtype=DT)}
    state = opt.init(w)
    state = opt.update(w, {"x": torch.randn(4, dtype=DT)}, state)[1]  # non-zero buffers
    grad = {"x": torch.randn(4, dtype=DT)}
    before = [t.clone() for t in (*w.values(), *grad.values(), *state.values())]
    new_w, new_state = opt.update(w, grad, state)
    after = [*w.values(), *grad.values(), *state.values()]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert set(new_state) == set(state)
    assert not torch.equal(new_w["x"], w["x"])


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: hg.inner.SGD(lr=0.0), "lr"),
        (lambda: hg.inner.SGD(lr=-0.1), "lr"),
        (lambda: hg.inner.SGD(lr=math.nan), "lr"),
        (lambda: hg.inner.SGD(lr=math.inf), "lr"),
        (lambda: hg.inner.SGD(lr=True), "lr"),
        (lambda: hg.inner.SGD(lr="0.1"), "lr"),
        (lambda: hg.inner.Momentum(lr=0.0), "lr"),
        (lambda: hg.inner.Momentum(lr=0.1, beta=1.0), "beta"),
        (lambda: hg.inner.Momentum(lr=0.1, beta=-0.1), "beta"),
        (lambda: hg.inner.Adam(lr=-1.0), "lr"),
        (lambda: hg.inner.Adam(lr=0.1, betas=(1.0, 0.999)), "betas[0]"),
        (lambda: hg.inner.Adam(lr=0.1, betas=(0.9, 1.5)), "betas[1]"),
        (lambda: hg.inner.Adam(lr=0.1, betas=0.9), "betas"),
        (lambda: hg.inner.Adam(lr=0.1, eps=-1e-8), "eps"),
        (lambda: hg.inner.Adam(lr=0.1, eps_root=-1.0), "eps_root"),
        (lambda: hg.inner.Adam(lr=0.1, leaf_lr={"x": 0.0}), r"leaf_lr['x']"),
        (lambda: hg.inner.SGD(lr=0.1, leaf_lr={"x": math.inf}), r"leaf_lr['x']"),
        (lambda: hg.inner.Momentum(lr=0.1, leaf_lr={"x": -1.0}), r"leaf_lr['x']"),
    ],
)
def test_invalid_arguments_raise_value_error(make, name: str) -> None:
    with pytest.raises(ValueError, match=name.replace("[", r"\[").replace("]", r"\]")):
        make()


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (lambda lr, leaf: hg.inner.SGD(lr=lr, leaf_lr=leaf), lambda groups: torch.optim.SGD(groups)),
        (
            lambda lr, leaf: hg.inner.Momentum(lr=lr, beta=0.8, nesterov=True, leaf_lr=leaf),
            lambda groups: torch.optim.SGD(groups, momentum=0.8, nesterov=True),
        ),
        (lambda lr, leaf: hg.inner.Adam(lr=lr, leaf_lr=leaf), lambda groups: torch.optim.Adam(groups)),
    ],
    ids=["sgd", "momentum", "adam"],
)
def test_leaf_lr_matches_torch_parameter_groups(ours, theirs) -> None:
    """``leaf_lr`` is torch.optim's per-parameter-group learning rate, leaf by leaf."""
    w0, loss = _problem(3)
    got = _ours(ours(0.02, {"m": 0.07}), w0, loss)
    ref = _torch(lambda p: theirs([{"params": [p[0]], "lr": 0.02}, {"params": [p[1]], "lr": 0.07}]), w0, loss)
    assert _max_diff(got, ref) < 1e-10
    assert _max_diff(got, _ours(ours(0.02, {}), w0, loss)) > 1e-3  # the override takes effect


def test_leaf_lr_must_be_a_mapping_of_names() -> None:
    with pytest.raises(TypeError, match="leaf_lr"):
        hg.inner.Adam(lr=0.1, leaf_lr=[("x", 0.1)])


def test_nesterov_must_be_bool() -> None:
    with pytest.raises(TypeError, match="nesterov"):
        hg.inner.Momentum(lr=0.1, nesterov="yes")
