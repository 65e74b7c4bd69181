"""The small smooth problems of the inner-solver comparisons (``benchmarks/inner_solvers.py``) and of their
tests: multinomial logistic regression on the wine data with a per-feature L2, and a binary logistic
regression on random data. Both float64; ``g`` is also the outer loss (only the inner solve is measured).
Also the peer they are measured against: torch's L-BFGS with its strong Wolfe line search.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import hypergrad as hg

DT = torch.float64


def wine(log_l2: float = -4.0) -> tuple[hg.BilevelProblem, dict, dict]:
    """Softmax regression on scikit-learn's wine data (178 x 13, standardised, 3 classes), penalty
    ``0.5 * sum(exp(l2) * W**2)`` per feature; starts at zero.

    Example:
        >>> problem, w0, lam = wine(-4.0)
        >>> sorted(w0), tuple(lam["l2"].shape)
        (['W', 'b'], (13,))
    """
    from sklearn.datasets import load_wine

    X, y = load_wine(return_X_y=True)
    X, y = torch.tensor(X, dtype=DT), torch.tensor(y)
    X = (X - X.mean(0)) / X.std(0)

    def g(w, lam, b):
        return torch.nn.functional.cross_entropy(X @ w["W"].T + w["b"], y) + 0.5 * (lam["l2"].exp() * w["W"] ** 2).sum()

    w0 = {"W": torch.zeros(3, 13, dtype=DT), "b": torch.zeros(3, dtype=DT)}
    return hg.BilevelProblem(g, g), w0, {"l2": torch.full((13,), log_l2, dtype=DT)}


def logistic(n: int = 200, d: int = 20, seed: int = 0) -> tuple[hg.BilevelProblem, dict, dict]:
    """Binary logistic regression on ``n`` random points in ``d`` dimensions (labels drawn from a random
    logistic model), L2 ``0.5 * l2 * ||x||^2`` with ``l2 = 1e-2``; starts at zero.

    Example:
        >>> problem, w0, lam = logistic(n=10, d=3)
        >>> tuple(w0["x"].shape), float(lam["l2"])
        ((3,), 0.01)
    """
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=gen, dtype=DT)
    y = (torch.rand(n, generator=gen, dtype=DT) < torch.sigmoid(X @ torch.randn(d, generator=gen, dtype=DT))).to(DT)
    bce = torch.nn.functional.binary_cross_entropy_with_logits

    def g(w, lam, b):
        return bce(X @ w["x"] + w["c"], y) + 0.5 * lam["l2"] * (w["x"] ** 2).sum()

    w0 = {"x": torch.zeros(d, dtype=DT), "c": torch.zeros((), dtype=DT)}
    return hg.BilevelProblem(g, g), w0, {"l2": torch.tensor(1e-2, dtype=DT)}


def torch_lbfgs(problem: hg.BilevelProblem, w0: dict, lam: dict) -> dict:
    """torch.optim.LBFGS with its strong Wolfe line search from ``w0`` to gradient norm 1e-10 on ``problem``'s
    inner loss (the peer of hypergrad's line-searched L-BFGS): steps, loss evaluations, the final gradient
    norm and whether it reached 1e-10.

    Example:
        >>> r = torch_lbfgs(*logistic(n=20, d=2))
        >>> r["converged"], r["steps"] > 0
        (True, True)
    """
    params = [v.clone().requires_grad_(True) for v in w0.values()]
    opt = torch.optim.LBFGS(params, lr=1, max_iter=5000, tolerance_grad=1e-10, tolerance_change=0.0, history_size=10,
                            line_search_fn="strong_wolfe")

    opt.step(lbfgs_closure(opt, problem, w0, params, lam))
    state = opt.state[opt._params[0]]
    norm = float(torch.cat([p.grad.reshape(-1) for p in params]).norm())
    return {"steps": int(state["n_iter"]), "evaluations": int(state["func_evals"]), "grad_norm": norm,
            "converged": norm <= 1e-10}


def lbfgs_closure(optimizer: torch.optim.Optimizer, problem: hg.BilevelProblem, w0: dict, params: list,
                  lam: dict) -> Callable[[], torch.Tensor]:
    """The closure torch's L-BFGS calls: the inner loss at ``params`` (laid out like ``w0``), its gradient in
    the parameters' ``.grad``.

    Example:
        >>> problem, w0, lam = logistic(n=10, d=3)
        >>> params = [v.clone().requires_grad_(True) for v in w0.values()]
        >>> opt = torch.optim.LBFGS(params)
        >>> float(lbfgs_closure(opt, problem, w0, params, lam)()) > 0 and params[0].grad is not None
        True
    """

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        value = problem.inner(dict(zip(w0, params, strict=True)), lam, None)
        value.backward()
        return value

    return closure
