#!/usr/bin/env python
"""Inner solvers to machine precision: hypergrad's L-BFGS (strong Wolfe) and Newton against SciPy and PyTorch.

Steps (iterations) and loss-and-gradient evaluations to a gradient norm of 1e-10 from zero, on:

* the wine problem: multinomial logistic regression on scikit-learn's wine data (178 samples, 13
  standardized features, 3 classes; W (3 x 13) and b), per-feature L2 weights exp(lam_j), for
  lam_j in {-5, -4, -3, -2, 0} (lam = -4 is the problem of ``tests/test_newton.py``);
* a binary logistic regression (200 samples, 20 features, L2 1e-2), for Newton.

Peers, run on the same losses in the same process: SciPy's L-BFGS-B (``gtol=1e-10``, ``ftol=0``,
history 10) and ``trust-ncg`` (Hessian products from torch), ``torch.optim.LBFGS`` with
``line_search_fn="strong_wolfe"`` (history 10, ``tolerance_grad=1e-10``). A peer that stops before
1e-10 is reported with the gradient norm it stopped at. Counts, not times: deterministic.

Usage::

    .venv/bin/python benchmarks/inner_solvers.py            # writes benchmarks/results/inner_solvers.md
    .venv/bin/python benchmarks/inner_solvers.py --out -    # prints only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from harness.inner_problems import logistic, torch_lbfgs, wine
from harness.report import machine_info, machine_line

import hypergrad as hg

DT = torch.float64
RESULTS = Path(__file__).resolve().parent / "results"


class Flat:
    """The loss on a flat numpy vector, for SciPy (counts its evaluations)."""

    def __init__(self, problem: hg.BilevelProblem, w0: dict, lam: dict) -> None:
        self.problem, self.lam, self.keys = problem, lam, list(w0)
        self.shapes, self.sizes = [v.shape for v in w0.values()], [v.numel() for v in w0.values()]
        self.evaluations = 0

    def tree(self, x: np.ndarray) -> dict:
        parts = torch.tensor(x, dtype=DT).split(self.sizes)
        return {k: p.reshape(s) for k, p, s in zip(self.keys, parts, self.shapes, strict=True)}

    def fun(self, x: np.ndarray) -> tuple[float, np.ndarray]:
        self.evaluations += 1
        w = {k: v.requires_grad_(True) for k, v in self.tree(x).items()}
        value = self.problem.inner(w, self.lam, None)
        grads = torch.autograd.grad(value, list(w.values()))
        return float(value), torch.cat([g.reshape(-1) for g in grads]).numpy()

    def hessp(self, x: np.ndarray, p: np.ndarray) -> np.ndarray:
        root = hg.autodiff.RootSystem(self.problem, self.tree(x), self.lam, None)
        return root.rmatvec_flat(torch.tensor(p, dtype=DT)).numpy()


def ours(problem: hg.BilevelProblem, w0: dict, lam: dict, optimizer: object) -> dict:
    """Steps and loss-and-gradient evaluations of inner_solve to 1e-10."""
    out = hg.inner_solve(problem, w0, lam, 1000, optimizer, tol=1e-10)
    return {"steps": out.steps, "evaluations": out.evaluations, "grad_norm": out.grad_norm, "converged": out.converged}


def scipy_run(problem: hg.BilevelProblem, w0: dict, lam: dict, method: str) -> dict:
    from scipy.optimize import minimize

    flat = Flat(problem, w0, lam)
    options = {"gtol": 1e-10}
    if method == "L-BFGS-B":
        options.update(ftol=0.0, maxcor=10, maxiter=5000)
    result = minimize(flat.fun, np.zeros(sum(flat.sizes)), jac=True, method=method, options=options,
                      hessp=flat.hessp if method == "trust-ncg" else None)
    norm = float(np.linalg.norm(flat.fun(result.x)[1]))
    return {"steps": int(result.nit), "evaluations": flat.evaluations - 1, "grad_norm": norm, "converged": norm <= 1e-10}


def cell(r: dict) -> str:
    stop = "" if r["converged"] else f" (stopped at {r['grad_norm']:.1e})"
    return f"{r['steps']} / {r['evaluations']}{stop}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "inner_solvers.md"), help="the report ('-': print only)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    meta = machine_info(1, libraries=("torch", "scipy"))
    lines = ["# Inner solvers to a gradient norm of 1e-10: hypergrad vs SciPy and PyTorch", "",
             "- Command: `python benchmarks/inner_solvers.py`",
             f"- Date: {meta['date']}",
             machine_line(meta, f"torch {meta['torch']}, SciPy {meta['scipy']}, Python {meta['python']}"),
             "- Cells: steps (iterations) / loss-and-gradient evaluations from zero to |grad g| <= 1e-10; a solver that "
             "stops earlier shows where. Deterministic counts (no timing).", "",
             "## L-BFGS on the wine problem", "",
             "| lam_j | hypergrad LBFGS (strong Wolfe) | SciPy L-BFGS-B | steps / SciPy's | torch LBFGS (strong Wolfe) "
             "| hypergrad LBFGS (Armijo) |", "|---|---|---|---|---|---|"]
    for log_l2 in (-5.0, -4.0, -3.0, -2.0, 0.0):
        problem, w0, lam = wine(log_l2)
        a = ours(problem, w0, lam, hg.inner.LBFGS())
        s = scipy_run(problem, w0, lam, "L-BFGS-B")
        t = torch_lbfgs(problem, w0, lam)
        b = ours(problem, w0, lam, hg.inner.LBFGS(line_search="armijo"))
        lines.append(f"| {log_l2:g} | {cell(a)} | {cell(s)} | {a['steps'] / s['steps']:.2f} | {cell(t)} | {cell(b)} |")
        print(lines[-1], flush=True)
    problem, w0, lam = logistic()
    lines += ["", "## Newton on a logistic regression (200 x 20)", "",
              "| solver | steps / evaluations |", "|---|---|"]
    for name, result in (("hypergrad Newton (Dense)", ours(problem, w0, lam, hg.inner.Newton())),
                         ("hypergrad Newton (CG, tol 1e-8)", ours(problem, w0, lam,
                                                                  hg.inner.Newton(solver=hg.linear.CG(tol=1e-8)))),
                         ("SciPy trust-ncg", scipy_run(problem, w0, lam, "trust-ncg")),
                         ("hypergrad LBFGS (strong Wolfe)", ours(problem, w0, lam, hg.inner.LBFGS()))):
        lines.append(f"| {name} | {cell(result)} |")
        print(lines[-1], flush=True)
    norms, w, state = [], w0, None
    newton = hg.inner.Newton()
    for _ in range(10):
        out = hg.inner_solve(problem, w, lam, 1, newton, opt_state=state, tol=1e-15)
        norms.append(out.grad_norm)
        if out.converged:
            break
        w, state = out.w, out.state
    lines += ["", "Newton's gradient norm per step (quadratic convergence: the exponent doubles): "
              + ", ".join(f"{n:.1e}" for n in norms) + "."]
    text = "\n".join(lines) + "\n"
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
