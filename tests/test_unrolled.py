"""Unrolled differentiation (hypergrad.Unrolled): closed forms, reverse = forward, convergence to
the implicit hypergradient, truncation, the `higher` oracle, nn.Module parameters, memory."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call

import hypergrad as hg
from hypergrad.unrolled import StepBatches

DT = torch.float64

def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """``|a - b|_inf <= tol * max(1, |b|_inf)``."""
    return float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))


# ---------------------------------------------------------------------------------- problems


@dataclass
class Quad:
    r"""g = 0.5 s w'Aw - w'(B lam + c) (s = the batch, default 1);  f = 0.5|Cw - d|^2 + e'lam."""

    A: torch.Tensor
    B: torch.Tensor
    c: torch.Tensor
    C: torch.Tensor
    d: torch.Tensor
    e: torch.Tensor
    mu: float  # smallest eigenvalue of A
    L: float  # largest eigenvalue of A

    @classmethod
    def random(cls, n: int, p: int, cond: float, seed: int, dtype: torch.dtype = DT) -> Quad:
        gen = torch.Generator().manual_seed(seed)
        q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=DT))
        eig = torch.logspace(0.0, math.log10(cond), n, dtype=DT)
        A = (q * eig) @ q.T
        A = 0.5 * (A + A.T)
        rnd = lambda *s: torch.randn(*s, generator=gen, dtype=DT)  # noqa: E731
        parts = [A, rnd(n, p), rnd(n), rnd(n + 2, n), rnd(n + 2), rnd(p)]
        return cls(*(t.to(dtype) for t in parts), mu=1.0, L=float(cond))

    def problem(self) -> hg.BilevelProblem:
        def g(w, lam, batch):
            x = w["w"]
            s = 1.0 if batch is None else batch
            return 0.5 * s * (x @ self.A @ x) - x @ (self.B @ lam["lam"] + self.c)

        def f(w, lam, batch):
            r = self.C @ w["w"] - self.d
            return 0.5 * r @ r + self.e @ lam["lam"]

        return hg.BilevelProblem(g, f)

    def ift(self, lam: torch.Tensor) -> torch.Tensor:
        """Exact IFT hypergradient (dw*/dlam)' grad_w f + grad_lam f, w* = A^-1(B lam + c)."""
        ws = torch.linalg.solve(self.A, self.B @ lam + self.c)
        return self.B.T @ torch.linalg.solve(self.A, self.C.T @ (self.C @ ws - self.d)) + self.e

    def unrolled_reference(
        self,
        lam: torch.Tensor,
        w0: torch.Tensor,
        K: int,
        lr: float,
        beta: float | None = None,
        nesterov: bool = False,
        truncate: int | None = None,
        scales: list[float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_K, dF_K/dlam) by propagating the Jacobians dw_k/dlam, dm_k/dlam in closed matrix form.

        The inner gradient is s_k A w - (B lam + c), so d(grad)/dlam = s_k A Jw - B. SGD:
        Jw <- Jw - lr (s_k A Jw - B). Heavy ball (beta): Jm <- beta Jm + (s_k A Jw - B),
        Jw <- Jw - lr Jm (Nesterov: Jw <- Jw - lr (dgrad + beta Jm)). Truncation: the Jacobians
        are reset to zero at step K - truncate (the iterate there is treated as a constant).
        """
        n, p = self.B.shape
        w, m = w0.clone(), torch.zeros_like(w0)
        Jw = torch.zeros(n, p, dtype=w0.dtype)
        Jm = torch.zeros_like(Jw)
        k = K if truncate is None else truncate
        for i in range(K):
            if i == K - k:
                Jw, Jm = torch.zeros_like(Jw), torch.zeros_like(Jm)
            s = 1.0 if scales is None else scales[i]
            grad = s * (self.A @ w) - (self.B @ lam + self.c)
            dgrad = s * (self.A @ Jw) - self.B
            if beta is None:
                w, Jw = w - lr * grad, Jw - lr * dgrad
            else:
                m, Jm = beta * m + grad, beta * Jm + dgrad
                step, dstep = (grad + beta * m, dgrad + beta * Jm) if nesterov else (m, Jm)
                w, Jw = w - lr * step, Jw - lr * dstep
        return w, Jw.T @ (self.C.T @ (self.C @ w - self.d)) + self.e


@dataclass
class Ridge:
    r"""g = 0.5/N |Xw - y|^2 + 0.5 sum_j exp(lam_j) w_j^2 (lam per feature or a scalar);
    f = 0.5/Nv |Xv w - yv|^2."""

    X: torch.Tensor
    y: torch.Tensor
    Xv: torch.Tensor
    yv: torch.Tensor

    @classmethod
    def random(cls, n_feat: int, seed: int) -> Ridge:
        gen = torch.Generator().manual_seed(seed)
        N = 3 * n_feat + 5
        w_true = torch.randn(n_feat, generator=gen, dtype=DT)
        X = torch.randn(N, n_feat, generator=gen, dtype=DT)
        Xv = torch.randn(N, n_feat, generator=gen, dtype=DT)
        y = X @ w_true + 0.5 * torch.randn(N, generator=gen, dtype=DT)
        yv = Xv @ w_true + 0.5 * torch.randn(N, generator=gen, dtype=DT)
        return cls(X, y, Xv, yv)

    def problem(self) -> hg.BilevelProblem:
        N, Nv = self.X.shape[0], self.Xv.shape[0]

        def g(w, lam, batch):
            r = self.X @ w["w"] - self.y
            return 0.5 * (r @ r) / N + 0.5 * (torch.exp(lam["lam"]) * w["w"] ** 2).sum()

        def f(w, lam, batch):
            r = self.Xv @ w["w"] - self.yv
            return 0.5 * (r @ r) / Nv

        return hg.BilevelProblem(g, f)

    def lipschitz(self, lam: torch.Tensor) -> float:
        H = self.X.T @ self.X / self.X.shape[0]
        return float(torch.linalg.eigvalsh(H + torch.diag(torch.exp(lam).expand(H.shape[0]))).max())

    def sgd_reference(self, lam: torch.Tensor, w0: torch.Tensor, K: int, lr: float) -> torch.Tensor:
        """dF_K/dlam for SGD by forward propagation of J = dw_k/dlam by hand.

        grad = H w + D w - b with D = diag(exp(lam)); d(grad)/dlam = (H + D) J + dD/dlam w, where
        dD/dlam w = diag(exp(lam) * w) per feature, or the column exp(lam) * w for a scalar lam.
        """
        H = self.X.T @ self.X / self.X.shape[0]
        b = self.X.T @ self.y / self.X.shape[0]
        D = torch.exp(lam).expand(H.shape[0])
        w = w0.clone()
        J = torch.zeros(w.shape[0], lam.numel(), dtype=DT)
        for _ in range(K):
            grad = H @ w + D * w - b
            direct = torch.diag(D * w) if lam.numel() > 1 else (D * w)[:, None]
            J = J - lr * (H @ J + D[:, None] * J + direct)
            w = w - lr * grad
        g_w = self.Xv.T @ (self.Xv @ w - self.yv) / self.Xv.shape[0]
        return (J.T @ g_w).reshape(lam.shape)


def _optimizer(kind: str, lr: float) -> hg.inner.InnerOptimizer:
    if kind == "sgd":
        return hg.inner.SGD(lr=lr)
    if kind == "momentum":
        return hg.inner.Momentum(lr=lr, beta=0.7)
    if kind == "nesterov":
        return hg.inner.Momentum(lr=lr, beta=0.7, nesterov=True)
    return hg.inner.Adam(lr=lr)


def _start(n: int, p: int, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed + 1)
    return (
        {"w": torch.randn(n, generator=gen, dtype=DT)},
        {"lam": torch.randn(p, generator=gen, dtype=DT)},
    )


dims = st.integers(2, 8)
n_lam = st.integers(1, 4)
conds = st.floats(1.0, 50.0)
seeds = st.integers(0, 2**16)

# ------------------------------------------------------------------------- closed forms


@settings(max_examples=15, deadline=None)
@given(
    n=dims,
    p=n_lam,
    cond=conds,
    seed=seeds,
    K=st.integers(1, 40),
    lr_frac=st.floats(0.1, 1.9),
    kind=st.sampled_from(["sgd", "momentum", "nesterov"]),
)
def test_reverse_matches_closed_form_quadratic(n, p, cond, seed, K, lr_frac, kind) -> None:
    q = Quad.random(n, p, cond, seed)
    w0, lam = _start(n, p, seed)
    lr = lr_frac / q.L if kind == "sgd" else 0.3 * lr_frac / q.L
    r = hg.Unrolled(_optimizer(kind, lr), steps=K).hypergrad(q.problem(), w0, lam)
    beta = None if kind == "sgd" else 0.7
    w_ref, g_ref = q.unrolled_reference(lam["lam"], w0["w"], K, lr, beta, kind == "nesterov")
    assert _close(r.grad["lam"], g_ref, 1e-10)
    assert _close(r.w["w"], w_ref, 1e-10)
    assert r.info.iterations == K and r.state is None


@settings(max_examples=15, deadline=None)
@given(
    n=dims, seed=seeds, K=st.integers(1, 40), lr_frac=st.floats(0.1, 1.9), per_feature=st.booleans()
)
def test_reverse_matches_closed_form_ridge(n, seed, K, lr_frac, per_feature) -> None:
    rp = Ridge.random(n, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    lam = {"lam": torch.randn(n if per_feature else (), generator=gen, dtype=DT) - 1.0}
    w0 = {"w": torch.randn(n, generator=gen, dtype=DT)}
    lr = lr_frac / rp.lipschitz(lam["lam"])
    r = hg.Unrolled(hg.inner.SGD(lr=lr), steps=K).hypergrad(rp.problem(), w0, lam)
    ref = rp.sgd_reference(lam["lam"], w0["w"], K, lr)
    assert r.grad["lam"].shape == lam["lam"].shape
    assert _close(r.grad["lam"], ref, 1e-10)


# ---------------------------------------------------------------------- reverse = forward


@settings(max_examples=15, deadline=None)
@given(
    n=dims,
    p=n_lam,
    cond=conds,
    seed=seeds,
    K=st.integers(1, 12),
    kind=st.sampled_from(["sgd", "momentum", "nesterov", "adam"]),
    ridge=st.booleans(),
)
def test_forward_equals_reverse(n, p, cond, seed, K, kind, ridge) -> None:
    if ridge:
        rp = Ridge.random(n, seed)
        problem, (w0, lam) = rp.problem(), _start(n, n, seed)
        L = rp.lipschitz(lam["lam"])
    else:
        q = Quad.random(n, p, cond, seed)
        problem, (w0, lam), L = q.problem(), _start(n, p, seed), q.L
    opt = _optimizer(kind, 0.05 if kind == "adam" else 0.5 / L)
    rev = hg.Unrolled(opt, steps=K).hypergrad(problem, w0, lam)
    fwd = hg.Unrolled(opt, steps=K, mode="forward").hypergrad(problem, w0, lam)
    assert fwd.info.extra["vectorized"] is True
    assert _close(fwd.grad["lam"], rev.grad["lam"], 1e-10)
    assert _close(fwd.w["w"], rev.w["w"], 1e-12)


def test_forward_loop_equals_vmap() -> None:
    q = Quad.random(5, 3, 10.0, 0)
    w0, lam = _start(5, 3, 0)
    opt = hg.inner.Adam(lr=0.05)
    vec = hg.Unrolled(opt, steps=6, mode="forward").hypergrad(q.problem(), w0, lam)
    loop = hg.Unrolled(opt, steps=6, mode="forward", vectorize=False).hypergrad(
        q.problem(), w0, lam
    )
    assert vec.info.extra["vectorized"] and not loop.info.extra["vectorized"]
    assert _close(vec.grad["lam"], loop.grad["lam"], 1e-12)


class _SquareNoVmap(torch.autograd.Function):
    """x**2 whose backward is itself a Function (:class:`_TwiceTimes`) that reads its cotangent in
    Python control flow: forward mode's batched backward pass (vmap) must fail, the loop must work."""

    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return _TwiceTimes.apply(x, grad)


class _TwiceTimes(torch.autograd.Function):
    """``2 x grad``; its backward branches on the values of its cotangent (not batchable)."""

    @staticmethod
    def forward(x, grad):
        return 2 * x * grad

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, out):
        x, grad = ctx.saved_tensors
        if bool((out == 0).all()):  # data-dependent control flow: vmap raises here
            return torch.zeros_like(x), torch.zeros_like(grad)
        return 2 * grad * out, 2 * x * out


def test_forward_falls_back_to_loop_when_vmap_fails() -> None:
    problem = hg.BilevelProblem(
        lambda w, lam, b: 0.5 * _SquareNoVmap.apply(w["x"] - lam["c"]).sum(),
        lambda w, lam, b: 0.5 * (w["x"] ** 2).sum(),
    )
    w0 = {"x": torch.zeros(3, dtype=DT)}
    lam = {"c": torch.tensor([1.0, 2.0, 3.0], dtype=DT)}
    fwd = hg.Unrolled(hg.inner.SGD(lr=0.5), steps=3, mode="forward").hypergrad(problem, w0, lam)
    assert fwd.info.extra["vectorized"] is False
    assert any("vmap" in m for m in fwd.info.warnings)
    # w_3 = (1 - 0.5^3) c, F = 0.5 |w_3|^2, dF/dc = 0.875^2 c
    assert torch.allclose(fwd.grad["c"], 0.875**2 * lam["c"], atol=1e-14, rtol=0)


# ------------------------------------------------------- geometric convergence to the IFT value


@settings(max_examples=15, deadline=None)
@given(n=dims, p=n_lam, cond=conds, seed=seeds, lr_frac=st.floats(0.2, 1.9))
def test_error_to_implicit_decays_geometrically(n, p, cond, seed, lr_frac) -> None:
    # SGD from a constant w0 on g = 0.5 w'Aw - w'(B lam + c), M = I - lr A, rho = ||M||_2
    # = max|1 - lr eig(A)| < 1 (lr < 2/L). With w* = A^-1(B lam + c), J* = A^-1 B (IFT):
    #   w_K - w* = M^K d0,  d0 = w0 - w*;   J_K = lr sum_{j<K} M^j B = A^-1 (I - M^K) B
    #                                              = J* - A^-1 M^K B   (A, M commute).
    # With r* = C'(Cw* - d), r_K = C'(Cw_K - d) = r* + C'C M^K d0, the error
    # e_K = J_K' r_K - J*' r* is
    #   e_K = J*' C'C M^K d0 - B' M^K A^-1 r* - B' M^K A^-1 C'C M^K d0,
    #   |e_K| <= rho^K (|J*| |C|^2 |d0| + |B| |r*| / mu) + rho^(2K) |B| |C|^2 |d0| / mu
    # (spectral norms, |A^-1| = 1/mu). This is C rho^K, sharper than the generic (K+1) rho^K.
    q = Quad.random(n, p, cond, seed)
    w0, lam = _start(n, p, seed)
    lr = lr_frac / q.L
    rho = max(abs(1 - lr * q.mu), abs(1 - lr * q.L))
    norm = lambda M: float(torch.linalg.matrix_norm(M, ord=2))  # noqa: E731
    w_star = torch.linalg.solve(q.A, q.B @ lam["lam"] + q.c)
    J_star = torch.linalg.solve(q.A, q.B)
    r_star = q.C.T @ (q.C @ w_star - q.d)
    d0 = float(torch.linalg.vector_norm(w0["w"] - w_star))
    c1 = (
        norm(J_star) * norm(q.C) ** 2 * d0
        + norm(q.B) * float(torch.linalg.vector_norm(r_star)) / q.mu
    )
    c2 = norm(q.B) * norm(q.C) ** 2 * d0 / q.mu
    ift = q.ift(lam["lam"])
    errors = []
    for K in (1, 2, 5, 10, 30, 100, 300):
        r = hg.Unrolled(hg.inner.SGD(lr=lr), steps=K).hypergrad(q.problem(), w0, lam)
        err = float(torch.linalg.vector_norm(r.grad["lam"] - ift))
        bound = c1 * rho**K + c2 * rho ** (2 * K)
        assert err <= bound * (1 + 1e-8) + 1e-11, (K, err, bound)
        errors.append(err)
    if rho**300 * (c1 + c2) < 1e-6:  # the bound is informative: the error must be tiny by K = 300
        assert errors[-1] < 1e-6


# -------------------------------------------------------------------------------- truncation


@pytest.mark.parametrize("kind", ["sgd", "momentum", "adam"])
def test_truncate_all_steps_equals_untruncated(kind) -> None:
    q = Quad.random(6, 2, 20.0, 3)
    w0, lam = _start(6, 2, 3)
    opt = _optimizer(kind, 0.05 if kind == "adam" else 0.3 / q.L)
    full = hg.Unrolled(opt, steps=9).hypergrad(q.problem(), w0, lam)
    trunc = hg.Unrolled(opt, steps=9, truncate=9).hypergrad(q.problem(), w0, lam)
    assert torch.equal(full.grad["lam"], trunc.grad["lam"])
    assert trunc.info.extra["differentiated_steps"] == 9


@settings(max_examples=15, deadline=None)
@given(
    n=dims,
    p=n_lam,
    cond=conds,
    seed=seeds,
    K=st.integers(2, 30),
    data=st.data(),
    kind=st.sampled_from(["sgd", "momentum", "nesterov"]),
)
def test_truncated_equals_derivative_of_last_k_steps(n, p, cond, seed, K, data, kind) -> None:
    k = data.draw(st.integers(1, K - 1))
    q = Quad.random(n, p, cond, seed)
    w0, lam = _start(n, p, seed)
    lr = 0.8 / q.L if kind == "sgd" else 0.3 / q.L
    r = hg.Unrolled(_optimizer(kind, lr), steps=K, truncate=k).hypergrad(q.problem(), w0, lam)
    beta = None if kind == "sgd" else 0.7
    w_ref, g_ref = q.unrolled_reference(
        lam["lam"], w0["w"], K, lr, beta, kind == "nesterov", truncate=k
    )
    assert _close(r.grad["lam"], g_ref, 1e-10)
    assert _close(r.w["w"], w_ref, 1e-10)
    assert r.info.extra["differentiated_steps"] == k
    assert r.info.grad_evals == K + k + 1


def test_truncated_adam_matches_hand_built_reference_and_is_biased() -> None:
    q = Quad.random(5, 2, 10.0, 7)
    w0, lam = _start(5, 2, 7)
    opt, problem, K, k = hg.inner.Adam(lr=0.05), q.problem(), 12, 4
    # Reference by hand: K-k plain steps, then k steps differentiated with autograd.
    w, s = dict(w0), opt.init(w0)
    for _ in range(K - k):
        x = w["w"].detach().requires_grad_(True)
        (gx,) = torch.autograd.grad(problem.inner({"w": x}, lam, None), x)
        with torch.no_grad():
            w, s = opt.update(w, {"w": gx}, s)
    lam_leaf = lam["lam"].clone().requires_grad_(True)
    x = w["w"].detach().requires_grad_(True)
    for _ in range(k):
        (gx,) = torch.autograd.grad(
            problem.inner({"w": x}, {"lam": lam_leaf}, None), x, create_graph=True
        )
        new, s = opt.update({"w": x}, {"w": gx}, s)
        x = new["w"]
    (ref,) = torch.autograd.grad(problem.outer({"w": x}, {"lam": lam_leaf}, None), lam_leaf)
    trunc = hg.Unrolled(opt, steps=K, truncate=k).hypergrad(problem, w0, lam)
    full = hg.Unrolled(opt, steps=K).hypergrad(problem, w0, lam)
    assert _close(trunc.grad["lam"], ref, 1e-10)
    assert float((trunc.grad["lam"] - full.grad["lam"]).abs().max()) > 1e-4  # truncation is biased


# --------------------------------------------------------------------- external oracle: higher


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", ["sgd", "momentum", "nesterov", "adam"])
def test_matches_higher(kind) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        higher = pytest.importorskip("higher", reason="the external oracle `higher` (the test extra) is not installed")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(DT)
    X, y = torch.randn(20, 4, dtype=DT), torch.randn(20, 2, dtype=DT)
    Xv, yv = torch.randn(15, 4, dtype=DT), torch.randn(15, 2, dtype=DT)
    lam = {"log_scale": torch.tensor(0.2, dtype=DT), "log_wd": torch.tensor([-1.0, -0.5], dtype=DT)}

    def inner(pred, weight, lam):  # lam enters the loss: output scale and per-output weight decay
        decay = (torch.exp(lam["log_wd"])[:, None] * weight**2).sum()
        return ((pred * torch.exp(lam["log_scale"]) - y) ** 2).mean() + decay

    def outer(pred):
        return ((pred - yv) ** 2).mean()

    K, lr = 10, 0.1
    if kind == "adam":
        # higher's Adam is the pre-2018 form lr*sqrt(bc2)/bc1 * m/(sqrt(v)+eps), which differs from
        # torch.optim.Adam (and ours) by O(eps); with eps = 0 both are m_hat / sqrt(v_hat).
        torch_opt = torch.optim.Adam(model.parameters(), lr=0.05, eps=0.0)
        ours_opt = hg.inner.Adam(lr=0.05, eps=0.0)
    else:
        mom, nest = {"sgd": (0.0, False), "momentum": (0.9, False), "nesterov": (0.9, True)}[kind]
        torch_opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=mom, nesterov=nest)
        ours_opt = (
            hg.inner.SGD(lr=lr)
            if kind == "sgd"
            else hg.inner.Momentum(lr=lr, beta=mom, nesterov=nest)
        )

    lam_leaves = {k: v.clone().requires_grad_(True) for k, v in lam.items()}
    with higher.innerloop_ctx(model, torch_opt, copy_initial_weights=True) as (fmodel, diffopt):
        for _ in range(K):
            diffopt.step(inner(fmodel(X), fmodel.weight, lam_leaves))
        ref = torch.autograd.grad(outer(fmodel(Xv)), list(lam_leaves.values()))

    problem = hg.BilevelProblem(
        lambda w, lam, b: inner(functional_call(model, w, (X,)), w["weight"], lam),
        lambda w, lam, b: outer(functional_call(model, w, (Xv,))),
    )
    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    for mode in ("reverse", "forward"):
        r = hg.Unrolled(ours_opt, steps=K, mode=mode).hypergrad(problem, w0, lam)
        for key, expected in zip(lam, ref, strict=True):
            assert _close(r.grad[key], expected, 1e-8), (mode, key, r.grad[key], expected)
    assert float(ref[0].abs()) > 1e-3  # non-trivial hypergradient


# ------------------------------------------------------------------------------- nn.Module


def _mlp_problem(dtype: torch.dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(
        dtype
    )
    for prm in model[0].parameters():
        prm.requires_grad_(False)  # frozen; only the last layer is the inner variable w
    train = (torch.randn(32, 4, dtype=dtype), torch.randint(0, 3, (32,)))
    val = (torch.randn(24, 4, dtype=dtype), torch.randint(0, 3, (24,)))
    ce = torch.nn.functional.cross_entropy

    def g(w, lam, batch):
        x, t = batch
        logits = functional_call(model, w, (x,)) * torch.exp(-lam["log_t"]) + lam["shift"]
        return ce(logits, t) + 0.5 * torch.exp(lam["log_wd"]) * (w["2.weight"] ** 2).sum()

    def f(w, lam, batch):
        x, t = batch
        return ce(functional_call(model, w, (x,)), t)

    w0 = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    lam = {
        "log_t": torch.tensor(0.3, dtype=dtype),
        "log_wd": torch.tensor(-2.0, dtype=dtype),
        "shift": torch.tensor([0.1, -0.2, 0.05], dtype=dtype),
    }
    return model, hg.BilevelProblem(g, f), w0, lam, train, val


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nn_module_subset_reverse_forward_and_finite_differences(dtype) -> None:
    model, problem, w0, lam, train, val = _mlp_problem(dtype)
    assert set(w0) == {"2.weight", "2.bias"}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt, K = hg.inner.Momentum(lr=0.5, beta=0.5), 15
    rev = hg.Unrolled(opt, steps=K).hypergrad(
        problem, w0, lam, train, val
    )  # one (x, y) batch reused
    fwd = hg.Unrolled(opt, steps=K, mode="forward").hypergrad(problem, w0, lam, train, val)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert set(rev.w) == set(w0) and all(
        v.dtype == dtype for v in (*rev.w.values(), *rev.grad.values())
    )
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    for key in lam:
        assert rev.grad[key].shape == lam[key].shape
        assert _close(fwd.grad[key], rev.grad[key], tol), key
    assert fwd.info.extra["directions"] == 5
    if dtype != torch.float64:
        return

    def F(lam_):  # re-run the unroll by hand, no graph
        w, s = dict(w0), opt.init(w0)
        for _ in range(K):
            wl = {k: v.detach().requires_grad_(True) for k, v in w.items()}
            grads = torch.autograd.grad(problem.inner(wl, lam_, train), list(wl.values()))
            with torch.no_grad():
                w, s = opt.update(w, dict(zip(wl, grads, strict=True)), s)
        return float(problem.outer(w, lam_, val))

    h = 1e-6
    for key, value in lam.items():
        for i in range(value.numel()):
            e = torch.zeros_like(value).reshape(-1)
            e[i] = h
            plus = {**lam, key: value + e.reshape(value.shape)}
            minus = {**lam, key: value - e.reshape(value.shape)}
            fd = (F(plus) - F(minus)) / (2 * h)
            assert abs(fd - float(rev.grad[key].reshape(-1)[i])) <= 1e-7 * max(1.0, abs(fd)), (
                key,
                i,
            )


# ------------------------------------------------------------------- memory / graph (forward)


def _peak_allocated(fn) -> int:
    """Peak of the running sum of CPU allocations (bytes) recorded by the profiler while fn runs.

    Allocation-level bookkeeping, deterministic (not RSS)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = prof.profiler.kineto_results.events()
    sizes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    peak = current = 0
    for _, nbytes in sizes:
        current += nbytes
        peak = max(peak, current)
    return peak


def test_forward_mode_memory_is_independent_of_steps() -> None:
    n = 20_000
    a = torch.linspace(1.0, 2.0, n, dtype=DT)
    b = torch.randn(n, dtype=DT, generator=torch.Generator().manual_seed(0))
    problem = hg.BilevelProblem(
        lambda w, lam, _: 0.5 * (a * w["x"] ** 2).sum() - lam["s"] * (b * w["x"]).sum(),
        lambda w, lam, _: 0.5 * (w["x"] ** 2).sum(),
    )
    w0, lam = {"x": torch.zeros(n, dtype=DT)}, {"s": torch.tensor(1.0, dtype=DT)}
    opt, vec = hg.inner.Momentum(lr=0.3, beta=0.5), 8 * n

    def peak(mode: str, K: int) -> int:
        method = hg.Unrolled(opt, steps=K, mode=mode)
        method.hypergrad(problem, w0, lam)  # warm-up (lazy initialisation inside torch)
        return _peak_allocated(lambda: method.hypergrad(problem, w0, lam))

    fwd4, fwd32 = peak("forward", 4), peak("forward", 32)
    rev4, rev32 = peak("reverse", 4), peak("reverse", 32)
    assert fwd32 <= fwd4 + vec  # no growth with K (up to one vector of slack)
    assert rev32 >= rev4 + 28 * vec  # the proxy is sensitive: reverse keeps >= 1 vector per step


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_result_holds_no_graph(mode) -> None:
    q = Quad.random(4, 2, 5.0, 0)
    w0, lam = _start(4, 2, 0)
    lam = {"lam": lam["lam"].clone().requires_grad_(True)}  # e.g. an outer optimizer's leaf
    r = hg.Unrolled(hg.inner.Adam(lr=0.1), steps=5, mode=mode, warm_start=True).hypergrad(
        q.problem(), w0, lam
    )
    for t in (*r.grad.values(), *r.w.values(), *r.state["opt_state"].values()):
        assert not t.requires_grad and t.grad_fn is None
    assert lam["lam"].grad is None  # the caller's tensors are not touched


def test_works_inside_no_grad() -> None:
    """The driver may call methods under torch.no_grad(); both modes still differentiate."""
    q = Quad.random(4, 2, 5.0, 1)
    w0, lam = _start(4, 2, 1)
    expected = q.unrolled_reference(lam["lam"], w0["w"], 7, 0.1)[1]
    with torch.no_grad():
        for mode in ("reverse", "forward"):
            r = hg.Unrolled(hg.inner.SGD(lr=0.1), steps=7, mode=mode).hypergrad(
                q.problem(), w0, lam
            )
            assert _close(r.grad["lam"], expected, 1e-10)


# ------------------------------------------------------------------- batches, state, dtypes


@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_per_step_batches(mode) -> None:
    q = Quad.random(5, 2, 8.0, 4)
    w0, lam = _start(5, 2, 4)
    scales = [0.5 + 0.1 * i for i in range(12)]  # batch i scales the curvature at step i
    lr, K = 0.15, 6
    method = hg.Unrolled(hg.inner.Momentum(lr=lr, beta=0.7), steps=K, mode=mode)
    r = method.hypergrad(q.problem(), w0, lam, inner_batch=StepBatches(scales))
    w_ref, g_ref = q.unrolled_reference(lam["lam"], w0["w"], K, lr, 0.7, scales=scales)
    assert _close(r.grad["lam"], g_ref, 1e-10) and _close(r.w["w"], w_ref, 1e-10)
    # a list restarts at its beginning on each call; an iterator is consumed across calls
    again = method.hypergrad(q.problem(), w0, lam, inner_batch=StepBatches(scales))
    assert torch.equal(again.grad["lam"], r.grad["lam"])
    it = StepBatches(iter(scales))
    first = method.hypergrad(q.problem(), w0, lam, inner_batch=it)
    second = method.hypergrad(q.problem(), w0, lam, inner_batch=it)
    assert torch.equal(first.grad["lam"], r.grad["lam"])
    _, g_second = q.unrolled_reference(lam["lam"], w0["w"], K, lr, 0.7, scales=scales[K:])
    assert _close(second.grad["lam"], g_second, 1e-10)
    with pytest.raises(ValueError, match="inner_batch"):
        method.hypergrad(q.problem(), w0, lam, inner_batch=it)  # exhausted


@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_warm_start_carries_optimizer_state(kind) -> None:
    q = Quad.random(5, 2, 8.0, 5)
    w0, lam = _start(5, 2, 5)
    opt = _optimizer(kind, 0.05 if kind == "adam" else 0.2 / q.L)
    warm = hg.Unrolled(opt, steps=4, warm_start=True)
    r1 = warm.hypergrad(q.problem(), w0, lam)
    r2 = warm.hypergrad(q.problem(), r1.w, lam, state=r1.state)
    long = hg.Unrolled(opt, steps=8).hypergrad(q.problem(), w0, lam)
    assert _close(r2.w["w"], long.w["w"], 1e-12)
    cold = hg.Unrolled(opt, steps=4).hypergrad(q.problem(), r1.w, lam)
    assert float((cold.w["w"] - long.w["w"]).abs().max()) > 1e-6  # the state matters
    with pytest.raises(ValueError, match="opt_state"):
        warm.hypergrad(q.problem(), w0, lam, state={"opt_state": {"bogus": torch.zeros(1)}})


def test_float32_and_unused_hyperparameters() -> None:
    q = Quad.random(4, 2, 5.0, 2, dtype=torch.float32)
    w0 = {"w": torch.randn(4)}
    lam = {"lam": torch.randn(2), "unused": torch.ones(3)}
    for mode in ("reverse", "forward"):
        r = hg.Unrolled(hg.inner.SGD(lr=0.1), steps=5, mode=mode).hypergrad(q.problem(), w0, lam)
        assert r.grad["lam"].dtype == torch.float32 and r.w["w"].dtype == torch.float32
        assert torch.equal(r.grad["unused"], torch.zeros(3))
        Q64 = Quad(*(t.double() for t in (q.A, q.B, q.c, q.C, q.d, q.e)), mu=q.mu, L=q.L)
        ref = Q64.unrolled_reference(lam["lam"].double(), w0["w"].double(), 5, 0.1)[1]
        assert _close(r.grad["lam"].double(), ref, 1e-5)


def test_info_counts() -> None:
    q = Quad.random(4, 3, 5.0, 0)
    w0, lam = _start(4, 3, 0)
    rev = hg.Unrolled(hg.inner.SGD(lr=0.1), steps=7, truncate=2).hypergrad(q.problem(), w0, lam)
    fwd = hg.Unrolled(hg.inner.SGD(lr=0.1), steps=7, mode="forward").hypergrad(q.problem(), w0, lam)
    assert (rev.info.iterations, rev.info.grad_evals, rev.info.extra["mode"]) == (
        7,
        7 + 2 + 1,
        "reverse",
    )
    assert (fwd.info.iterations, fwd.info.grad_evals, fwd.info.extra["mode"]) == (
        7,
        7 * 4 + 1,
        "forward",
    )
    assert isinstance(hg.Unrolled(hg.inner.SGD(lr=0.1), steps=1), hg.HypergradMethod)


# --------------------------------------------------------------------------------- validation


SGD = hg.inner.SGD(lr=0.1)


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"optimizer": "sgd", "steps": 3}, TypeError, "optimizer"),
        ({"optimizer": torch.optim.SGD, "steps": 3}, TypeError, "optimizer"),
        ({"optimizer": SGD, "steps": 0}, ValueError, "steps"),
        ({"optimizer": SGD, "steps": -2}, ValueError, "steps"),
        ({"optimizer": SGD, "steps": 2.0}, TypeError, "steps"),
        ({"optimizer": SGD, "steps": True}, TypeError, "steps"),
        ({"optimizer": SGD, "steps": 3, "mode": "backward"}, ValueError, "mode"),
        ({"optimizer": SGD, "steps": 3, "truncate": 0}, ValueError, "truncate"),
        ({"optimizer": SGD, "steps": 3, "truncate": 4}, ValueError, "truncate"),
        ({"optimizer": SGD, "steps": 3, "truncate": 1.0}, TypeError, "truncate"),
        ({"optimizer": SGD, "steps": 3, "truncate": 2, "mode": "forward"}, ValueError, "truncate"),
        ({"optimizer": SGD, "steps": 3, "warm_start": "yes"}, TypeError, "warm_start"),
        ({"optimizer": SGD, "steps": 3, "vectorize": 1}, TypeError, "vectorize"),
    ],
)
def test_invalid_constructor_arguments(kwargs, exc, name) -> None:
    with pytest.raises(exc, match=name):
        hg.Unrolled(**kwargs)


def test_invalid_call_arguments() -> None:
    q = Quad.random(3, 1, 2.0, 0)
    w0, lam = _start(3, 1, 0)
    method = hg.Unrolled(SGD, steps=3)
    with pytest.raises(TypeError, match="w"):
        method.hypergrad(q.problem(), [w0["w"]], lam)
    with pytest.raises(ValueError, match="lam"):
        method.hypergrad(q.problem(), w0, {})
    with pytest.raises(ValueError, match="inner_batch"):
        method.hypergrad(q.problem(), w0, lam, inner_batch=StepBatches([1.0, 1.0]))


@pytest.mark.parametrize(
    ("mode", "truncate"), [("reverse", None), ("reverse", 2), ("forward", None)]
)
def test_non_finite_raises(mode, truncate) -> None:
    q = Quad.random(4, 2, 50.0, 0)
    w0, lam = _start(4, 2, 0)
    diverging = hg.Unrolled(
        hg.inner.SGD(lr=5.0), steps=150, mode=mode, truncate=truncate
    )  # lr > 2/L
    with pytest.raises(hg.NonFiniteError):
        diverging.hypergrad(q.problem(), w0, lam)
    nan_lam = {"lam": torch.tensor([math.nan, 0.0], dtype=DT)}
    with pytest.raises(hg.NonFiniteError):
        hg.Unrolled(SGD, steps=3, mode=mode, truncate=truncate).hypergrad(q.problem(), w0, nan_lam)
