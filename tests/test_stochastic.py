"""Stochastic bilevel solvers (SOBA, SABA, AmIGO, StocBiO) on finite-sum quadratics with a closed form.

The problem: ``n`` inner samples split into ``n_batches`` fixed batches, ``m`` outer samples,

    g_i(w, lam) = 0.5 (x_i . w)^2 + 0.5 mu |w|^2 - w . (B_i lam + c_i)
    f_j(w, lam) = 0.5 |w - d_j|^2 + 0.5 alpha |lam|^2

so that ``H = mu I + mean x_i x_i^T`` (its condition number is drawn), ``w*(lam) = H^-1 (B lam + c)``
with the means ``B``, ``c``, and ``lam*`` solves a ridge system. Every batch loss is a mean over
its samples, so the mean of the batch losses is the full loss (SABA's convention).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hypergrad as hg
from hypergrad.stochastic import Decreasing, ScheduledSGD

DT = torch.float64


@dataclass
class Quadratic:
    """A finite-sum quadratic bilevel problem and its closed-form solution."""

    x: torch.Tensor  # (n, d) inner features
    B: torch.Tensor  # (n, d, p) per-sample cross terms
    c: torch.Tensor  # (n, d)
    d: torch.Tensor  # (m, d) outer targets
    mu: float
    alpha: float
    n_batches: int

    @property
    def batches(self) -> list[torch.Tensor]:
        return list(torch.arange(self.x.shape[0]).chunk(self.n_batches))

    def inner(self, w: dict, lam: dict, batch: object) -> torch.Tensor:
        idx = self._samples(batch, self.batches)
        x, B, c = self.x[idx], self.B[idx], self.c[idx]
        wx = w["w"]
        return (0.5 * (x @ wx) ** 2 - (torch.einsum("ndp,p->nd", B, lam["lam"]) + c) @ wx).mean() + 0.5 * self.mu * wx @ wx

    def outer(self, w: dict, lam: dict, batch: object) -> torch.Tensor:
        idx = self._samples(batch, list(torch.arange(self.d.shape[0]).chunk(self.d.shape[0])))
        return 0.5 * ((w["w"] - self.d[idx]) ** 2).sum(-1).mean() + 0.5 * self.alpha * lam["lam"] @ lam["lam"]

    @staticmethod
    def _samples(batch: object, parts: list[torch.Tensor]) -> torch.Tensor:
        if batch is None:  # full batch
            return torch.arange(sum(len(p) for p in parts))
        return parts[batch[0]]

    @property
    def problem(self) -> hg.BilevelProblem:
        return hg.BilevelProblem(self.inner, self.outer)

    @property
    def hessian(self) -> torch.Tensor:
        n, dim = self.x.shape
        return self.mu * torch.eye(dim, dtype=DT) + self.x.T @ self.x / n

    def batch_hessian_max(self) -> float:
        return max(
            float(torch.linalg.eigvalsh(self.mu * torch.eye(self.x.shape[1], dtype=DT) + self.x[i].T @ self.x[i] / len(i))[-1])
            for i in self.batches
        )

    def outer_smoothness(self) -> float:
        """The largest eigenvalue of the Hessian of ``F(lam) = f(w*(lam), lam)``."""
        M = torch.linalg.solve(self.hessian, self.B.mean(0))
        return float(torch.linalg.eigvalsh(M.T @ M)[-1]) + self.alpha

    def lam_star_neumann(self, eta: float, terms: int) -> torch.Tensor:
        """The solution of StocBiO's expected equation: ``H^-1`` replaced by ``eta * sum_{q < terms} (I - eta H)^q``."""
        H, B = self.hessian, self.B.mean(0)
        eye = torch.eye(H.shape[0], dtype=DT)
        truncated = torch.linalg.solve(H, eye - torch.linalg.matrix_power(eye - eta * H, terms))
        M = torch.linalg.solve(H, B)
        r = torch.linalg.solve(H, self.c.mean(0)) - self.d.mean(0)
        p = M.shape[1]
        # F_Q'(lam) = alpha lam + B^T truncated (M lam + r) = 0
        return torch.linalg.solve(self.alpha * torch.eye(p, dtype=DT) + B.T @ truncated @ M, -B.T @ truncated @ r)

    def w_star(self, lam: torch.Tensor) -> torch.Tensor:
        return torch.linalg.solve(self.hessian, self.B.mean(0) @ lam + self.c.mean(0))

    def lam_star(self) -> torch.Tensor:
        M = torch.linalg.solve(self.hessian, self.B.mean(0))
        r = torch.linalg.solve(self.hessian, self.c.mean(0)) - self.d.mean(0)
        p = M.shape[1]
        return torch.linalg.solve(M.T @ M + self.alpha * torch.eye(p, dtype=DT), -M.T @ r)

    def hypergrad(self, lam: torch.Tensor) -> torch.Tensor:
        M = torch.linalg.solve(self.hessian, self.B.mean(0))
        return M.T @ (self.w_star(lam) - self.d.mean(0)) + self.alpha * lam


def make_quadratic(seed: int, dim: int, p: int, kappa: float, n: int = 12, n_batches: int = 4, m: int = 3) -> Quadratic:
    """Inner Hessian ``mu I + X^T X / n`` with eigenvalues spread over [1/kappa, 1] exactly."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, dim, generator=gen, dtype=DT))
    rot, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=DT))
    mu = 1.0 / kappa
    spectrum = torch.linspace(0.0, 1.0 - mu, dim, dtype=DT)
    x = n**0.5 * q @ torch.diag(spectrum.sqrt()) @ rot.T
    B = torch.randn(dim, p, generator=gen, dtype=DT) + 0.3 * torch.randn(n, dim, p, generator=gen, dtype=DT)
    c = 0.3 * torch.randn(n, dim, generator=gen, dtype=DT)
    d = torch.randn(dim, generator=gen, dtype=DT) + 0.3 * torch.randn(m, dim, generator=gen, dtype=DT)
    q = Quadratic(x, B, c, d, mu=mu, alpha=0.5, n_batches=n_batches)
    # scale B so that |dw*/dlam| = |H^-1 B| = 1: F's Hessian then has eigenvalues in [alpha, 1 + alpha]
    q.B = B / torch.linalg.matrix_norm(torch.linalg.solve(q.hessian, B.mean(0)), ord=2)
    return q


def shuffled_batches(n: int, seed: int):
    """An endless stream of ``(index, None)`` batches: every epoch visits the ``n`` batches in a new random order."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        for i in torch.randperm(n, generator=gen).tolist():
            yield (i, None)


def iid_batches(n: int, seed: int):
    """An endless stream of ``(index, None)`` batches drawn independently and uniformly (with replacement)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield (int(torch.randint(n, (1,), generator=gen)), None)


def run_averaged(
    q: Quadratic, method: object, outer_optimizer, steps: int, seed: int, step_batches: bool = False, iid: bool = False
) -> torch.Tensor:
    """Run ``hg.solve`` on shuffled minibatch streams; return the mean of lam over the last half of the run.

    Averaging the iterates (Polyak-Ruppert) removes most of the noise of the last iterate, so the
    tolerances below measure the bias of the method, not the luck of the last batch.
    """
    dim, p = q.x.shape[1], q.B.shape[2]
    stream = iid_batches if iid else shuffled_batches
    inner = stream(q.n_batches, seed)
    outer = stream(q.d.shape[0], seed + 1)
    total = torch.zeros(p, dtype=DT)
    count = 0

    def average(step: int, w: dict, lam: dict, result: object) -> None:
        nonlocal total, count
        if step >= steps // 2:
            total, count = total + lam["lam"], count + 1

    hg.solve(
        q.problem, {"w": torch.zeros(dim, dtype=DT)}, {"lam": torch.zeros(p, dtype=DT)}, method, outer_optimizer,
        steps=steps, inner_batches=[hg.StepBatches(inner)] if step_batches else inner, outer_batches=outer,
        progress=False, callback=average,
    )
    return total / count


def relative_error(lam: torch.Tensor, q: Quadratic) -> float:
    star = q.lam_star()
    return float((lam - star).norm() / star.norm())


PROBLEMS = st.tuples(
    st.integers(0, 2**16), st.integers(2, 4), st.integers(1, 3), st.floats(1.5, 3.0)
).map(lambda a: make_quadratic(seed=a[0], dim=a[1], p=a[2], kappa=a[3]))
CONVERGENCE = settings(max_examples=3, deadline=None, derandomize=True)


@CONVERGENCE
@given(q=PROBLEMS)
def test_saba_constant_steps_converge_to_lam_star(q: Quadratic) -> None:
    # Variance reduction: constant steps converge linearly to the exact solution, so the
    # tolerance is a float64 round-off level, not a noise level.
    L = q.batch_hessian_max()
    method = hg.SABA(0.5 / L, n_inner=q.n_batches, n_outer=q.d.shape[0])
    lam = run_averaged(q, method, lambda p: torch.optim.SGD(p, lr=0.5 / q.outer_smoothness()), steps=400, seed=0)
    assert relative_error(lam, q) < 1e-5


@CONVERGENCE
@given(q=PROBLEMS)
def test_soba_decreasing_steps_converge_to_lam_star(q: Quadratic) -> None:
    # Steps c / sqrt(t + 1) on w, v and lam (the paper's and benchmark_bilevel's schedule). The
    # estimate is unbiased but noisy; after 600 steps the averaged iterate is within 2% of lam*
    # (measured: 1e-4 to 3e-2 over kappa in [1.5, 4]); a wrong sign or a stale product is off by O(1).
    L, LF = q.batch_hessian_max(), q.outer_smoothness()
    lam = run_averaged(
        q, hg.SOBA(Decreasing(1.0 / L, 0.5)), lambda p: ScheduledSGD(p, Decreasing(0.5 / LF, 0.5)), steps=600, seed=1
    )
    assert relative_error(lam, q) < 2e-2


@CONVERGENCE
@given(q=PROBLEMS)
def test_amigo_converges_to_lam_star(q: Quadratic) -> None:
    # Warm-started inner and linear SGD (3 + 3 steps, fresh batch each): no bias at the fixed
    # point; decreasing outer steps and averaging leave a noise level of a few percent.
    L, LF = q.batch_hessian_max(), q.outer_smoothness()
    method = hg.AmIGO(0.5 / L, inner_steps=3, linear_steps=3)
    lam = run_averaged(q, method, lambda p: ScheduledSGD(p, Decreasing(0.5 / LF, 0.5)), steps=200, seed=2, step_batches=True)
    assert relative_error(lam, q) < 5e-2


@CONVERGENCE
@given(q=PROBLEMS)
def test_stocbio_converges_to_its_truncated_neumann_solution(q: Quadratic) -> None:
    # With independent batches the Neumann estimate is, in expectation, eta sum_{q<=Q} (I - eta H)^q
    # grad_w f: StocBiO converges to the root lam*_Q of that truncated hypergradient (closed form
    # below), which tends to lam* geometrically in Q (at Q = 6 here it is 0.2% to 10% away from
    # lam*). Comparing with lam*_Q rather than lam* keeps Q, and the test, small.
    L, LF = q.batch_hessian_max(), q.outer_smoothness()
    eta, Q = 0.9 / L, 6
    method = hg.StocBiO(0.5 / L, inner_steps=3, neumann_steps=Q, neumann_step_size=eta)
    lam = run_averaged(
        q, method, lambda p: ScheduledSGD(p, Decreasing(0.5 / LF, 0.5)), steps=200, seed=3, step_batches=True, iid=True
    )
    target = q.lam_star_neumann(eta, Q + 1)
    assert float((lam - target).norm() / target.norm()) < 3e-2
