"""``llm-calib demo``: the main job on the embedded default."""

from __future__ import annotations

import torch

import hypergrad as hg

__all__ = ["ridge_hypergradient_demo", "run_demo"]


def ridge_hypergradient_demo(seed: int = 0, n: int = 50, d: int = 8) -> dict[str, float]:
    """Hypergradient of the validation loss of ridge regression w.r.t. per-feature log-penalties.

    Computes it with every ``hypergrad`` method and with the closed form, and returns the
    relative error of each method.

    Example:
        >>> errors = ridge_hypergradient_demo()
        >>> errors["Implicit(Dense)"] < 1e-9
        True
    """
    gen = torch.Generator().manual_seed(seed)
    dt = torch.float64
    w_true = torch.randn(d, generator=gen, dtype=dt)
    X, Xv = torch.randn(n, d, generator=gen, dtype=dt), torch.randn(n, d, generator=gen, dtype=dt)
    y = X @ w_true + 0.5 * torch.randn(n, generator=gen, dtype=dt)
    yv = Xv @ w_true + 0.5 * torch.randn(n, generator=gen, dtype=dt)

    def inner(w, lam, batch):
        return 0.5 * ((X @ w["w"] - y) ** 2).sum() + 0.5 * (lam["log_l2"].exp() * w["w"] ** 2).sum()

    def outer(w, lam, batch):
        return 0.5 * ((Xv @ w["w"] - yv) ** 2).sum()

    lam = {"log_l2": torch.zeros(d, dtype=dt)}
    H = X.T @ X + torch.diag(lam["log_l2"].exp())
    w_star = torch.linalg.solve(H, X.T @ y)
    closed_form = -lam["log_l2"].exp() * w_star * torch.linalg.solve(H, Xv.T @ (Xv @ w_star - yv))

    problem = hg.BilevelProblem(inner, outer)
    w = {"w": w_star}
    step = 1.0 / float(torch.linalg.eigvalsh(H).max())
    methods: dict[str, hg.HypergradMethod] = {
        "Implicit(Dense)": hg.Implicit(hg.linear.Dense()),
        "Implicit(CG)": hg.Implicit(hg.linear.CG(tol=1e-10)),
        "Implicit(Neumann)": hg.Implicit(hg.linear.Neumann(steps=5000, tol=1e-10)),
    }
    optional = {
        "Unrolled(reverse, K=500)": lambda: hg.Unrolled(hg.inner.SGD(step), steps=500, mode="reverse"),
        "FiniteDifference": lambda: hg.FiniteDifference(eps=1e-4, solver=hg.linear.CG(tol=1e-10)),
    }
    for name, make in optional.items():
        try:
            methods[name] = make()
        except AttributeError:  # method not available in this build
            continue
    print(f"ridge regression, n={n}, d={d}: dF/dlog_l2 (first 4 entries)")
    print(f"  {'closed form':<26} {closed_form[:4].numpy().round(6)}")
    errors = {}
    for name, method in methods.items():
        start = {"w": torch.zeros(d, dtype=dt)} if name.startswith("Unrolled") else w
        r = method.hypergrad(problem, start, lam)
        errors[name] = float((r.grad["log_l2"] - closed_form).norm() / closed_form.norm())
        print(f"  {name:<26} {r.grad['log_l2'][:4].numpy().round(6)}   rel. error {errors[name]:.1e}")
    return errors


def run_demo() -> None:
    """Run the demo (printed to stdout)."""
    ridge_hypergradient_demo()
