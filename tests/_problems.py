"""Bilevel test problems with closed-form hypergradients (float64)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import hypergrad as hg

DT = torch.float64


def random_spd(n: int, cond: float, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=DT))
    eig = torch.logspace(0, torch.log10(torch.tensor(cond)).item(), n, dtype=DT)
    return (q * eig) @ q.T


@dataclass
class Quadratic:
    r"""g = 0.5 w'Aw - w'(B lam + c);  f = 0.5 |C w - d|^2 + e' lam."""

    A: torch.Tensor
    B: torch.Tensor
    c: torch.Tensor
    C: torch.Tensor
    d: torch.Tensor
    e: torch.Tensor

    @classmethod
    def random(cls, n: int, p: int, cond: float, seed: int) -> Quadratic:
        gen = torch.Generator().manual_seed(seed)
        return cls(
            random_spd(n, cond, gen),
            torch.randn(n, p, generator=gen, dtype=DT),
            torch.randn(n, generator=gen, dtype=DT),
            torch.randn(n + 2, n, generator=gen, dtype=DT),
            torch.randn(n + 2, generator=gen, dtype=DT),
            torch.randn(p, generator=gen, dtype=DT),
        )

    def problem(self) -> hg.BilevelProblem:
        def g(w, lam, batch):
            x = w["w"]
            return 0.5 * x @ self.A @ x - x @ (self.B @ lam["lam"] + self.c)

        def f(w, lam, batch):
            r = self.C @ w["w"] - self.d
            return 0.5 * r @ r + self.e @ lam["lam"]

        return hg.BilevelProblem(g, f)

    def w_star(self, lam: torch.Tensor) -> torch.Tensor:
        return torch.linalg.solve(self.A, self.B @ lam + self.c)

    def hypergrad(self, lam: torch.Tensor) -> torch.Tensor:
        ws = self.w_star(lam)
        return self.B.T @ torch.linalg.solve(self.A, self.C.T @ (self.C @ ws - self.d)) + self.e


@dataclass
class Ridge:
    r"""g = 0.5|X w - y|^2 + 0.5 sum exp(lam) w^2 (lam scalar or per feature); f = 0.5|Xv w - yv|^2."""

    X: torch.Tensor
    y: torch.Tensor
    Xv: torch.Tensor
    yv: torch.Tensor

    @classmethod
    def random(cls, n: int, d: int, seed: int, noise: float = 0.5) -> Ridge:
        gen = torch.Generator().manual_seed(seed)
        w_true = torch.randn(d, generator=gen, dtype=DT)
        X = torch.randn(n, d, generator=gen, dtype=DT)
        Xv = torch.randn(n, d, generator=gen, dtype=DT)
        y = X @ w_true + noise * torch.randn(n, generator=gen, dtype=DT)
        yv = Xv @ w_true + noise * torch.randn(n, generator=gen, dtype=DT)
        return cls(X, y, Xv, yv)

    def problem(self) -> hg.BilevelProblem:
        def g(w, lam, batch):
            r = self.X @ w["w"] - self.y
            return 0.5 * r @ r + 0.5 * (torch.exp(lam["lam"]) * w["w"] ** 2).sum()

        def f(w, lam, batch):
            r = self.Xv @ w["w"] - self.yv
            return 0.5 * r @ r

        return hg.BilevelProblem(g, f)

    def hessian(self, lam: torch.Tensor) -> torch.Tensor:
        d = self.X.shape[1]
        return self.X.T @ self.X + torch.diag(torch.exp(lam).expand(d))

    def w_star(self, lam: torch.Tensor) -> torch.Tensor:
        return torch.linalg.solve(self.hessian(lam), self.X.T @ self.y)

    def outer_value(self, lam: torch.Tensor) -> torch.Tensor:
        r = self.Xv @ self.w_star(lam) - self.yv
        return 0.5 * r @ r

    def hypergrad(self, lam: torch.Tensor) -> torch.Tensor:
        ws = self.w_star(lam)
        v = torch.linalg.solve(self.hessian(lam), self.Xv.T @ (self.Xv @ ws - self.yv))
        per_feature = -torch.exp(lam) * ws * v
        return per_feature if lam.numel() > 1 else per_feature.sum().reshape(lam.shape)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.clamp(torch.linalg.vector_norm(b), min=1e-300))


def mlp_classification(build_model, classes: int = 3):
    """A small classifier's bilevel problem: inner = CE of temperature-scaled logits (log_t) + weight
    decay (log_wd) on 40 examples, outer = validation CE on 30; 5 input features, float64.

    ``build_model()`` is called after ``torch.manual_seed(0)`` and before the data are drawn.
    Returns ``(problem, w0, lam, model)``."""
    torch.manual_seed(0)
    model = build_model().to(DT)
    X, y = torch.randn(40, 5, dtype=DT), torch.randint(0, classes, (40,))
    Xv, yv = torch.randn(30, 5, dtype=DT), torch.randint(0, classes, (30,))
    ce = torch.nn.functional.cross_entropy
    call = hg.functional(model)

    def inner(w, lam, batch):
        decay = sum((torch.exp(lam["log_wd"]) * (p * p).sum()) for k, p in w.items() if "weight" in k)
        return ce(call(w, X) * torch.exp(lam["log_t"]), y) + decay

    def outer(w, lam, batch):
        return ce(call(w, Xv), yv)

    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    lam = {"log_wd": torch.tensor(-3.0, dtype=DT), "log_t": torch.tensor(0.1, dtype=DT)}
    return hg.BilevelProblem(inner, outer), w0, lam, model
