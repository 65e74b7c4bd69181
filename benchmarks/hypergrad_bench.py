#!/usr/bin/env python
"""hypergrad against jaxopt, torchopt and higher, side by side: time, memory, accuracy, scaling.

Usage (from the repository root, after ``make setup``)::

    make setup-bench   # optional: jax and jaxopt for the jaxopt rows (skipped without them)
    .venv/bin/python benchmarks/hypergrad_bench.py            # full run (< 15 min on 2 cores),
                                                              # writes benchmarks/results/
    .venv/bin/python benchmarks/hypergrad_bench.py --quick    # about a minute; prints only
    .venv/bin/python benchmarks/hypergrad_bench.py --quick --out /tmp/bench   # quick, to a folder

Problems (same data, dtype and thread count for every library):

1. ridge regression, scalar and per-feature regularisation (closed-form hypergradient);
2. logistic regression with per-feature L2 hyperparameters, d = 100 ... 10,000 features
   (reference: the implicit-function-theorem formula with an explicit/Woodbury solve);
3. data hyper-cleaning on scikit-learn's digits (50 % of the training labels corrupted, one
   weight per training example; single-hypergradient timings plus a short outer loop and the final
   test accuracy);
4. an MLP inner problem on digits, up to about 1M parameters (scaling in the parameter count),
   and a sweep of the unroll length K = 10 ... 1000 on a small MLP.

Timing: all runners of one problem are interleaved (A B C A B C ...) after a warm-up; medians.
Memory: every (problem, method, size) configuration runs in a fresh process: the script re-runs
itself with a hidden ``--worker`` flag, which imports once and forks one child per configuration
(children are fresh processes forked from an import-only parent, so no state leaks between
configurations); the child builds the problem, warms up, resets the kernel's peak-RSS counter and
reports the peak RSS over that baseline for one hypergradient.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from harness.profiling import Phase, measurement_env
from torch import Tensor, nn
from torch.func import functional_call

import hypergrad as hg

warnings.filterwarnings("ignore", category=FutureWarning)  # torchopt's functorch deprecations
warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", category=UserWarning, module="higher")
warnings.filterwarnings("ignore", category=hg.ConvergenceWarning)  # reported in the tables

Tree = dict[str, Tensor]
RESULTS = Path(__file__).resolve().parent / "results"
MB = 1024.0 * 1024.0

# ----------------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class Sizes:
    """Problem sizes and repetition counts of one benchmark mode."""

    name: str
    ridge_n: int = 1000
    ridge_d: int = 200
    logistic_n: int = 500
    logistic_ds: tuple[int, ...] = (100, 1000, 10000)
    logistic_unrolled_max_d: int = 1000  # unrolled runners only up to this d (cost K * grad)
    clean_train: int = 1000
    clean_outer_steps: int = 60
    clean_inner_steps: int = 30
    clean_unroll_k: int = 30
    mlp_widths: tuple[int, ...] = (64, 256, 1000)
    mlp_batch: int = 256
    mlp_k: int = 10
    unroll_k: int = 100
    ks: tuple[int, ...] = (10, 30, 100, 300, 1000)
    ksweep_width: int = 64
    flat_ks: tuple[int, ...] = (10, 1000)  # forward-mode memory check, on the mlp_widths[1] MLP
    tol: float = 1e-6
    neumann_cap: int = 200
    repeats: int = 5
    min_repeats: int = 3
    budget_s: float = 25.0  # per problem instance: stop adding interleaved rounds after this
    memory: bool = True
    memory_only: tuple[str, ...] | None = None  # measure memory only for these problem prefixes
    lbfgs_iters: int = 500  # cap of the LBFGS inner solves that set up the problems
    ridge_large_d: tuple[int, ...] = (1000,)  # per-feature ridge, implicit runners only
    compiled_max_d: int = 10**7  # Implicit(compile=True) rows for problems up to this many parameters (0: none)
    dense_max_d: int = 1000  # Implicit(Dense()) rows for ridge/logistic up to this d (0: none)
    problems: tuple[int, ...] | None = None  # run only these numbered problems (1-6, see _suite); None: all


FULL = Sizes("full")
QUICK = Sizes(
    "quick",
    ridge_n=300,
    ridge_d=50,
    logistic_n=200,
    logistic_ds=(100, 1000),
    clean_train=400,
    clean_outer_steps=8,
    clean_inner_steps=20,
    clean_unroll_k=10,
    mlp_widths=(32, 128),
    mlp_batch=64,
    mlp_k=5,
    unroll_k=20,
    ks=(10, 100),
    ksweep_width=32,
    flat_ks=(10, 100),
    neumann_cap=100,
    repeats=3,
    min_repeats=2,
    budget_s=3.0,
    memory=True,
    memory_only=("ksweep", "fwdflat"),
    lbfgs_iters=150,
    ridge_large_d=(),
    compiled_max_d=1000,
)
TINY = replace(
    QUICK,
    name="tiny",
    ridge_n=120,
    ridge_d=20,
    logistic_n=100,
    logistic_ds=(50,),
    clean_train=200,
    clean_outer_steps=3,
    clean_inner_steps=10,
    clean_unroll_k=5,
    mlp_widths=(16,),
    mlp_batch=32,
    mlp_k=3,
    unroll_k=10,
    ks=(10,),
    ksweep_width=16,
    flat_ks=(),
    neumann_cap=60,
    repeats=2,
    min_repeats=1,
    budget_s=1.0,
    memory=False,
    compiled_max_d=0,  # compilation takes tens of seconds per problem; tests/test_compiled.py checks it
)
MODES = {"full": FULL, "quick": QUICK, "tiny": TINY}

# ------------------------------------------------------------------------- tree helpers


def flat(t: Tree | tuple[Tensor, ...] | list[Tensor]) -> Tensor:
    values = t.values() if isinstance(t, dict) else t
    return torch.cat([v.detach().reshape(-1) for v in values])


def rel_err(a: Tensor, b: Tensor) -> float:
    a, b = a.double(), b.double()
    return float(torch.linalg.vector_norm(a - b) / torch.clamp(torch.linalg.vector_norm(b), min=1e-300))


def _leaves(t: Tree) -> Tree:
    return {k: v.detach().clone().requires_grad_(True) for k, v in t.items()}


# ------------------------------------------------------------------------------ problems


@dataclass
class Bench:
    """One problem instance: a model, data, the two losses and the point of evaluation.

    The losses are written once, in terms of the model's predictions and parameter dict, and
    every library evaluates exactly these: ours through ``torch.func.functional_call``, higher
    through its patched module, torchopt's ``MetaSGD`` through the module itself.
    """

    key: str
    title: str
    dtype: torch.dtype
    model: nn.Module
    data: dict[str, Tensor]
    kind: str  # "ridge" | "logistic" | "clean" | "mlp"
    w: Tree  # the point at which the hypergradient is taken (an inner solution)
    lam: Tree
    lr: float  # inner SGD step (about 1 / L)
    reference: Tensor | None = None
    ref_note: str = ""
    w_sigma: Tree | None = None  # argmin g + sigma f, for Penalty's steady state
    sigma: float = 1e-3
    alpha: float | None = None  # Neumann step shared by both libraries
    damping: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    # -- losses -------------------------------------------------------------------------
    def inner_loss(self, pred: Tensor, params: Tree, lam: Tree) -> Tensor:
        return _INNER[self.kind](self, pred, params, lam)

    def outer_loss(self, pred: Tensor, params: Tree, lam: Tree) -> Tensor:
        return _OUTER[self.kind](self, pred, params, lam)

    def g(self, w: Tree, lam: Tree, batch: Any = None) -> Tensor:
        return self.inner_loss(functional_call(self.model, w, (self.data["X"],)), w, lam)

    def f(self, w: Tree, lam: Tree, batch: Any = None) -> Tensor:
        return self.outer_loss(functional_call(self.model, w, (self.data["Xv"],)), w, lam)

    @property
    def problem(self) -> hg.BilevelProblem:
        return hg.BilevelProblem(self.g, self.f)

    @property
    def n_params(self) -> int:
        return sum(v.numel() for v in self.w.values())

    @property
    def n_hyper(self) -> int:
        return sum(v.numel() for v in self.lam.values())


def _ridge_inner(b: Bench, pred: Tensor, params: Tree, lam: Tree) -> Tensor:
    r = pred[:, 0] - b.data["y"]
    return 0.5 * (r @ r) / r.numel() + 0.5 * (torch.exp(lam["log_l2"]) * params["weight"][0] ** 2).sum()


def _ridge_outer(b: Bench, pred: Tensor, params: Tree, lam: Tree) -> Tensor:
    r = pred[:, 0] - b.data["yv"]
    return 0.5 * (r @ r) / r.numel()


def _logistic_inner(b: Bench, pred: Tensor, params: Tree, lam: Tree) -> Tensor:
    ce = nn.functional.binary_cross_entropy_with_logits(pred[:, 0], b.data["y"])
    return ce + 0.5 * (torch.exp(lam["log_l2"]) * params["weight"][0] ** 2).sum()


def _logistic_outer(b: Bench, pred: Tensor, params: Tree, lam: Tree) -> Tensor:
    return nn.functional.binary_cross_entropy_with_logits(pred[:, 0], b.data["yv"])


def _clean_inner(b: Bench, pred: Tensor, params: Tree, lam: Tree) -> Tensor:
    ce = nn.functional.cross_entropy(pred, b.data["y"], reduction="none")
    weights = torch.sigmoid(lam["logit_weight"])
    return (weights * ce).mean() + 0.5 * b.extra["l2"] * (params["weight"] ** 2).sum()


def _clean_outer(b: Bench, pred: Tensor, params: Tree, lam: Tree) -> Tensor:
    return nn.functional.cross_entropy(pred, b.data["yv"])


def _mlp_inner(b: Bench, pred: Tensor, params: Tree, lam: Tree) -> Tensor:
    decay = sum((p * p).sum() for k, p in params.items() if k.endswith("weight"))
    return nn.functional.cross_entropy(pred, b.data["y"]) + 0.5 * torch.exp(lam["log_wd"]) * decay


_INNER = {"ridge": _ridge_inner, "logistic": _logistic_inner, "clean": _clean_inner, "mlp": _mlp_inner}
_OUTER = {"ridge": _ridge_outer, "logistic": _logistic_outer, "clean": _clean_outer, "mlp": _clean_outer}


def _minimize(loss: Callable[[Tree], Tensor], w0: Tree, max_iter: int = 500, tol: float = 1e-10) -> Tree:
    """LBFGS (strong Wolfe) to a tight gradient tolerance: the inner solution of a benchmark."""
    keys = list(w0)
    params = [v.detach().clone().requires_grad_(True) for v in w0.values()]
    opt = torch.optim.LBFGS(
        params, lr=1.0, max_iter=max_iter, tolerance_grad=tol, tolerance_change=0.0,
        history_size=20, line_search_fn="strong_wolfe",
    )

    def closure() -> Tensor:
        opt.zero_grad()
        value = loss(dict(zip(keys, params, strict=True)))
        value.backward()
        return value

    opt.step(closure)
    return {k: p.detach() for k, p in zip(keys, params, strict=True)}


def _lipschitz(b: Bench) -> float:
    """Largest Hessian eigenvalue of g at ``b.w`` (power iteration with exact HVPs)."""
    from hypergrad.autodiff import RootSystem

    root = RootSystem(b.problem, b.w, b.lam, None)
    system = hg.linear.LinearSystem(matvec=root.rmatvec, rhs=b.w, flat_matvec=root.rmatvec_flat)
    return hg.linear.largest_eigenvalue(system, iterations=30)


_DIGITS: dict[str, Tensor] = {}


def _digits(dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    if not _DIGITS:
        from sklearn.datasets import load_digits

        d = load_digits()
        _DIGITS["X"] = torch.tensor(d.data, dtype=torch.float64) / 16.0
        _DIGITS["y"] = torch.tensor(d.target, dtype=torch.long)
    return _DIGITS["X"].to(dtype), _DIGITS["y"].clone()


def _digits_split(n_train: int, dtype: torch.dtype, corrupt: float, seed: int = 0) -> dict[str, Tensor]:
    X, y = _digits(dtype)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(X.shape[0], generator=gen)
    n_val = 300
    tr, va, te = perm[:n_train], perm[n_train : n_train + n_val], perm[n_train + n_val :]
    y_tr = y[tr].clone()
    n_bad = round(corrupt * n_train)
    bad = torch.randperm(n_train, generator=gen)[:n_bad]
    shift = torch.randint(1, 10, (n_bad,), generator=gen)
    y_tr[bad] = (y_tr[bad] + shift) % 10  # a wrong label, uniformly among the other nine
    clean = torch.ones(n_train, dtype=torch.bool)
    clean[bad] = False
    return {
        "X": X[tr], "y": y_tr, "Xv": X[va], "yv": y[va], "Xt": X[te], "yt": y[te],
        "y_true": y[tr], "clean": clean,
    }


def _linear(d_in: int, d_out: int, bias: bool, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(d_in, d_out, bias=bias).to(dtype)


def _mlp(d_in: int, width: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(d_in, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 10)
    ).to(dtype)


def _implicit_reference(b: Bench) -> Tensor:
    """Exact IFT hypergradient at ``b.w`` from an explicit solve (independent of hypergrad)."""
    w, lam = b.w, b.lam
    if b.kind in ("ridge", "logistic"):
        X = b.data["X"]
        n = X.shape[0]
        wv = w["weight"][0]
        reg = torch.exp(lam["log_l2"]).expand_as(wv)
        if b.kind == "ridge":
            s = torch.ones(n, dtype=X.dtype)
        else:
            p = torch.sigmoid(X @ wv)
            s = torch.sqrt(p * (1 - p))
        grad_f = torch.func.grad(lambda w_: b.f(w_, lam))(w)["weight"][0]
        Xs = X * s[:, None] / math.sqrt(n)  # H = Xs^T Xs + diag(reg)
        if X.shape[1] <= 2000:
            H = Xs.T @ Xs + torch.diag(reg)
            u = torch.linalg.solve(H, grad_f)
        else:  # Woodbury: (D + U^T U)^{-1} = D^{-1} - D^{-1} U^T (I + U D^{-1} U^T)^{-1} U D^{-1}
            Dinv_b = grad_f / reg
            inner = torch.eye(n, dtype=X.dtype) + (Xs / reg) @ Xs.T
            u = Dinv_b - (Xs.T @ torch.linalg.solve(inner, Xs @ Dinv_b)) / reg
        mixed = reg * wv * u  # d/dlam_i of (grad_w g) = exp(lam_i) w_i e_i
        out = -mixed
        return out.sum().reshape(1) if lam["log_l2"].numel() == 1 else out
    # General (small) problems: explicit Hessian and mixed Jacobian with torch.func.
    keys = list(w)
    shapes = [w[k].shape for k in keys]
    sizes = [w[k].numel() for k in keys]

    def unflat(v: Tensor) -> Tree:
        return {k: p.reshape(s) for k, p, s in zip(keys, v.split(sizes), shapes, strict=True)}

    wf = flat(w)
    lf = flat(lam)
    lkeys = list(lam)
    lshapes = [lam[k].shape for k in lkeys]
    lsizes = [lam[k].numel() for k in lkeys]

    def lunflat(v: Tensor) -> Tree:
        return {k: p.reshape(s) for k, p, s in zip(lkeys, v.split(lsizes), lshapes, strict=True)}

    def gflat(wv: Tensor, lv: Tensor) -> Tensor:
        return b.g(unflat(wv), lunflat(lv))

    H = torch.func.hessian(gflat, argnums=0)(wf, lf)
    grad_w_g = torch.func.grad(gflat, argnums=0)
    J = torch.func.jacrev(grad_w_g, argnums=1)(wf, lf)  # (n_w, n_lam)
    grad_f = torch.func.grad(lambda wv: b.f(unflat(wv), lunflat(lf)))(wf)
    u = torch.linalg.solve(H + b.damping * torch.eye(H.shape[0], dtype=H.dtype), grad_f)
    return -(J.T @ u)


def build_bench(spec: dict[str, Any], cache_dir: Path | None = None) -> Bench:
    """Build a problem from its spec; the expensive parts (inner solves) are cached on disk."""
    t_build = time.perf_counter()
    key = spec.get("label", spec["key"])
    path = cache_dir / f"{spec['key']}.pt" if cache_dir is not None else None
    cached = torch.load(path, weights_only=False) if path is not None and path.exists() else None
    kind = spec["kind"]
    gen = torch.Generator().manual_seed(spec.get("seed", 0))
    if kind in ("ridge", "logistic"):
        dt = torch.float64
        n, d = spec["n"], spec["d"]
        w_true = torch.randn(d, generator=gen, dtype=dt)
        X = torch.randn(n, d, generator=gen, dtype=dt)
        Xv = torch.randn(n, d, generator=gen, dtype=dt)
        if kind == "ridge":
            y = X @ w_true / math.sqrt(d) + 0.5 * torch.randn(n, generator=gen, dtype=dt)
            yv = Xv @ w_true / math.sqrt(d) + 0.5 * torch.randn(n, generator=gen, dtype=dt)
            title = f"ridge, {'scalar' if spec['scalar'] else 'per-feature'} lambda (n={n}, d={d})"
            l0 = -1.0
        else:
            logits = X @ w_true / math.sqrt(d)
            y = (torch.rand(n, generator=gen, dtype=dt) < torch.sigmoid(3 * logits)).to(dt)
            lv = Xv @ w_true / math.sqrt(d)
            yv = (torch.rand(n, generator=gen, dtype=dt) < torch.sigmoid(3 * lv)).to(dt)
            title = f"logistic, per-feature L2 (n={n}, d={d})"
            l0 = math.log(0.05)
        lam_shape = (1,) if spec.get("scalar") else (d,)
        lam = {"log_l2": torch.full(lam_shape, l0, dtype=dt)}
        if kind == "logistic":  # spread the per-feature strengths a little
            lam["log_l2"] = lam["log_l2"] + 0.5 * torch.randn(lam_shape, generator=gen, dtype=dt)
        model = _linear(d, 1, False, dt)
        data = {"X": X, "y": y, "Xv": Xv, "yv": yv}
        b = Bench(key, title, dt, model, data, kind, {}, lam, 0.0)
    elif kind == "clean":
        dt = torch.float64
        data = _digits_split(spec["n_train"], dt, corrupt=0.5)
        n_tr = data["X"].shape[0]
        model = _linear(64, 10, True, dt)
        lam = {"logit_weight": torch.zeros(n_tr, dtype=dt)}
        title = f"data hyper-cleaning, digits (n_train={n_tr}, 50% labels corrupted)"
        b = Bench(key, title, dt, model, data, kind, {}, lam, 0.0, extra={"l2": 1e-3})
    elif kind == "mlp":
        dt = torch.float32
        data = _digits_split(1000, dt, corrupt=0.0)
        batch = spec["batch"]
        data = {"X": data["X"][:batch], "y": data["y"][:batch], "Xv": data["Xv"], "yv": data["yv"]}
        model = _mlp(64, spec["width"], dt)
        lam = {"log_wd": torch.tensor(math.log(1e-3), dtype=dt)}
        n_p = sum(p.numel() for p in model.parameters())
        title = f"MLP 64-{spec['width']}-{spec['width']}-10 ({n_p:,} parameters, batch {batch})"
        b = Bench(key, title, dt, model, data, kind, {}, lam, 0.0, damping=1e-2)
    else:
        raise ValueError(f"unknown problem kind {kind!r}")
    b.extra.update(spec)
    if cached is not None:
        b.w, b.lr, b.reference, b.ref_note = cached["w"], cached["lr"], cached["reference"], cached["ref_note"]
        b.w_sigma, b.sigma, b.alpha = cached["w_sigma"], cached["sigma"], cached["alpha"]
        return b
    # inner solution, step size, Penalty's second iterate, Neumann step, reference
    w0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    if kind == "mlp":
        # Non-convex: a few hundred LBFGS iterations give an approximate inner solution.
        b.w = _minimize(lambda w: b.g(w, lam), w0, max_iter=spec.get("inner_iters", 200), tol=1e-7)
    elif kind == "ridge":  # the exact minimiser: the reference below is then the closed form
        X, n = b.data["X"], b.data["X"].shape[0]
        H = X.T @ X / n + torch.diag(torch.exp(lam["log_l2"]).expand(X.shape[1]))
        b.w = {"weight": torch.linalg.solve(H, X.T @ b.data["y"] / n).reshape(1, -1)}
    else:  # logistic: to 1e-10; hyper-cleaning (ill-conditioned, kappa ~ 1e3): to 1e-8
        b.w = _minimize(lambda w: b.g(w, lam), w0, max_iter=spec.get("inner_iters", 500),
                        tol=1e-10 if kind == "logistic" else 1e-8)
    L = _lipschitz(b)
    b.lr = 1.0 / L
    b.alpha = 1.0 / (L + b.damping)
    b.sigma = spec.get("sigma", 1e-3)
    b.w_sigma = _minimize(lambda w: b.g(w, lam) + b.sigma * b.f(w, lam), b.w,
                          max_iter=spec.get("inner_iters", 500),
                          tol={"mlp": 1e-7, "clean": 1e-8}.get(kind, 1e-10))
    if kind == "mlp":
        b.reference, b.ref_note = None, "no reference (non-convex; methods compared with each other)"
    else:
        b.reference = _implicit_reference(b)
        b.ref_note = (
            "closed form" if kind == "ridge" else
            "IFT formula with an explicit (Cholesky/Woodbury) solve" if kind == "logistic" else
            "IFT formula with the explicit Hessian (torch.func.hessian) and an LU solve"
        )
    if path is not None:
        torch.save(
            {"w": b.w, "lr": b.lr, "reference": b.reference, "ref_note": b.ref_note,
             "w_sigma": b.w_sigma, "sigma": b.sigma, "alpha": b.alpha}, path,
        )
    b.extra["build_s"] = time.perf_counter() - t_build
    return b


# ------------------------------------------------------------------------------- runners


@dataclass
class Runner:
    """One hypergradient method on one problem: ``fn()`` returns the flat hypergradient."""

    name: str
    library: str  # "hypergrad" | "torchopt" | "higher" | "(unit)"
    family: str  # "implicit-cg", "implicit-neumann", "unrolled-reverse", ...
    fn: Callable[[], Tensor]
    info: dict[str, Any] = field(default_factory=dict)
    warm: Callable[[], Any] | None = None  # cheaper warm-up for the memory worker
    group: str = ""  # the make_runners selector that builds it
    clock: str = "thread"  # "thread": the calling thread's CPU time; "process": all threads'


def _peers() -> tuple[Any, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import higher
        import torchopt
    return torchopt, higher


def _ours(b: Bench, method: Any, name: str, family: str, state: dict | None = None) -> Runner:
    problem = b.problem
    holder: dict[str, Any] = {"state": state}
    info: dict[str, Any] = {}

    def fn() -> Tensor:
        # Penalty: every call starts from the steady state (w, w_sigma at their optima for this
        # lam, the state a long outer loop carries), so the T=1 step is what a call costs.
        r = method.hypergrad(problem, b.w, b.lam, state=holder["state"])
        info.update(iterations=r.info.iterations, grad_evals=r.info.grad_evals,
                    converged=r.info.converged)
        return flat(r.grad)

    return Runner(name, "hypergrad", family, fn, info)


def _compiled_ours(b: Bench, tol: float, maxiter: int) -> Runner:
    """``Implicit(compile=True)``: the first call (compilation) is timed separately."""
    method = hg.Implicit(hg.linear.CG(tol=tol, maxiter=maxiter, damping=b.damping), compile=True)
    t0 = time.perf_counter()
    first = method.hypergrad(b.problem, b.w, b.lam)
    compile_s = time.perf_counter() - t0
    runner = _ours(b, method, "Implicit CG, compile=True", "implicit-cg-compiled")
    runner.info.update(compile_s=compile_s, compiled=bool(first.info.extra.get("compiled")))
    return runner


def _penalty_state(b: Bench) -> dict[str, Any]:
    return {"w_sigma": b.w_sigma}


def _torchopt_implicit(b: Bench, solve: Any, name: str, family: str) -> Runner:
    torchopt, _ = _peers()
    wk, lk = list(b.w), list(b.lam)
    w_star = tuple(b.w[k] for k in wk)

    def optimality(w_: tuple[Tensor, ...], *lam_t: Tensor) -> tuple[Tensor, ...]:
        lam_ = dict(zip(lk, lam_t, strict=True))
        grads = torch.func.grad(lambda ww: b.g(dict(zip(wk, ww, strict=True)), lam_))(w_)
        return tuple(grads)

    @torchopt.diff.implicit.custom_root(optimality, argnums=tuple(range(1, 1 + len(lk))), solve=solve)
    def solver(w_init: tuple[Tensor, ...], *lam_t: Tensor) -> tuple[Tensor, ...]:
        return w_star  # the inner problem is solved beforehand, as for every method here

    w_init = tuple(torch.zeros_like(v) for v in w_star)

    def fn() -> Tensor:
        lam_ = _leaves(b.lam)
        w_opt = solver(w_init, *lam_.values())
        value = b.f(dict(zip(wk, w_opt, strict=True)), lam_)
        return flat(torch.autograd.grad(value, list(lam_.values())))

    return Runner(name, "torchopt", family, fn)


_JAX: dict[str, Any] = {}


def _jax() -> Any | None:
    """jax (float64, one XLA thread) and jaxopt, or None when the bench extra is not installed."""
    if "mod" not in _JAX:
        # one intra-op thread, like torch.set_num_threads(1) for the other libraries; must be set
        # before jax creates its CPU backend
        os.environ.setdefault(
            "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
        try:
            import jax
            import jaxopt  # noqa: F401

            jax.config.update("jax_enable_x64", True)
            _JAX["mod"] = jax
        except Exception:  # not installed (the bench extra is optional): rows are left out
            _JAX["mod"] = None
    return _JAX["mod"]


def _jaxopt_implicit(b: Bench, tol: float, maxiter: int) -> Runner | None:
    """jaxopt's ``custom_root`` + ``solve_cg`` under ``jax.jit`` on the same data, losses and w*.

    Ridge and logistic regression only (the losses are re-written in jax.numpy; the model is
    ``X @ w``). The first call (tracing and XLA compilation) is timed separately and reported;
    the timed calls reuse the compiled executable.
    """
    jax = _jax()
    if jax is None or b.kind not in ("ridge", "logistic"):
        return None
    from functools import partial

    import jax.numpy as jnp
    import numpy as np
    from jaxopt import implicit_diff, linear_solve

    X, y, Xv, yv = (jnp.asarray(b.data[k].numpy()) for k in ("X", "y", "Xv", "yv"))
    w_star = jnp.asarray(b.w["weight"][0].numpy())
    lam0 = jnp.asarray(b.lam["log_l2"].numpy())
    kind = b.kind

    def data_loss(z: Any, target: Any) -> Any:
        if kind == "ridge":
            r = z - target
            return 0.5 * (r @ r) / r.shape[0]
        return jnp.mean(jnp.logaddexp(0.0, z) - target * z)  # binary_cross_entropy_with_logits

    def g(w: Any, log_l2: Any) -> Any:
        return data_loss(X @ w, y) + 0.5 * jnp.sum(jnp.exp(log_l2) * w**2)

    def f(w: Any, log_l2: Any) -> Any:
        return data_loss(Xv @ w, yv)

    solve = partial(linear_solve.solve_cg, tol=tol, maxiter=maxiter)

    @implicit_diff.custom_root(jax.grad(g, argnums=0), solve=solve)
    def inner(w_init: Any, log_l2: Any) -> Any:
        return w_star  # the inner problem is solved beforehand, as for every method here

    w_init = jnp.zeros_like(w_star)
    hypergrad = jax.jit(jax.grad(lambda log_l2: f(inner(w_init, log_l2), log_l2)))
    t0 = time.perf_counter()
    hypergrad(lam0).block_until_ready()
    compile_s = time.perf_counter() - t0

    def fn() -> Tensor:
        return torch.from_numpy(np.array(hypergrad(lam0).block_until_ready()))

    # XLA runs the executable on its own (single) thread: CPU time of the whole process
    return Runner("custom_root + solve_cg (jax.jit)", "jaxopt", "implicit-cg", fn,
                  {"compile_s": compile_s}, clock="process")


def _load(model: nn.Module, w: Tree, requires_grad: bool) -> nn.Module:
    m = copy.deepcopy(model)
    with torch.no_grad():
        for k, p in m.named_parameters():
            p.copy_(w[k])
            p.requires_grad_(requires_grad)
    return m


def _higher(b: Bench, K: int, warm_K: int = 2) -> Runner:
    _, higher = _peers()
    model = _load(b.model, b.w, True)
    opt = torch.optim.SGD(model.parameters(), lr=b.lr)
    names = [k for k, _ in model.named_parameters()]
    X, Xv = b.data["X"], b.data["Xv"]

    def run(steps: int) -> Tensor:
        lam_ = _leaves(b.lam)
        with higher.innerloop_ctx(model, opt, copy_initial_weights=True) as (fm, diffopt):
            for _ in range(steps):
                params = dict(zip(names, fm.parameters(), strict=True))
                diffopt.step(b.inner_loss(fm(X), params, lam_))
            params = dict(zip(names, fm.parameters(), strict=True))
            value = b.outer_loss(fm(Xv), params, lam_)
            return flat(torch.autograd.grad(value, list(lam_.values())))

    return Runner(f"higher unrolled (K={K})", "higher", "unrolled-reverse", lambda: run(K),
                  warm=lambda: run(min(K, warm_K)))


def _metasgd(b: Bench, K: int, warm_K: int = 2) -> Runner:
    torchopt, _ = _peers()
    model = _load(b.model, b.w, True)
    state0 = torchopt.extract_state_dict(model, by="deepcopy")
    X, Xv = b.data["X"], b.data["Xv"]

    def run(steps: int) -> Tensor:
        lam_ = _leaves(b.lam)
        opt = torchopt.MetaSGD(model, lr=b.lr)
        for _ in range(steps):
            opt.step(b.inner_loss(model(X), dict(model.named_parameters()), lam_))
        value = b.outer_loss(model(Xv), dict(model.named_parameters()), lam_)
        out = flat(torch.autograd.grad(value, list(lam_.values())))
        torchopt.recover_state_dict(model, state0)
        return out

    return Runner(f"torchopt MetaSGD (K={K})", "torchopt", "unrolled-reverse-metasgd",
                  lambda: run(K), warm=lambda: run(min(K, warm_K)))


def _unrolled(b: Bench, K: int, mode: str = "reverse", truncate: int | None = None,
              warm_K: int = 2, checkpoint: bool = False, recompute: bool = True,
              recompute_min_bytes: int | None = None) -> Runner:
    problem = b.problem
    info: dict[str, Any] = {}
    more = {} if recompute_min_bytes is None else {"recompute_min_bytes": recompute_min_bytes}

    def run(steps: int) -> Tensor:
        t = None if truncate is None else min(truncate, steps)
        m = hg.Unrolled(hg.inner.SGD(lr=b.lr), steps=steps, mode=mode, truncate=t, checkpoint=checkpoint,
                        recompute=recompute, **more)
        r = m.hypergrad(problem, b.w, b.lam)
        info.update(iterations=r.info.iterations, grad_evals=r.info.grad_evals)
        return flat(r.grad)

    if mode == "forward":
        name, family = f"Unrolled forward (K={K})", "unrolled-forward"
    elif truncate is not None:
        name, family = f"Unrolled truncated (K={K}, k={truncate})", "unrolled-truncated"
    elif checkpoint:
        name, family = f"Unrolled reverse, checkpoint=True (K={K})", "unrolled-checkpoint"
    elif not recompute:
        name, family = f"Unrolled reverse, recompute=False (K={K})", "unrolled-stored"
    elif recompute_min_bytes is not None:
        name, family = f"Unrolled reverse, recompute_min_bytes={recompute_min_bytes} (K={K})", "unrolled-all"
    else:
        name, family = f"Unrolled reverse (K={K})", "unrolled-reverse"
    return Runner(name, "hypergrad", family, lambda: run(K), info, warm=lambda: run(min(K, warm_K)))


def _grad_unit(b: Bench) -> Runner:
    w_ = _leaves(b.w)
    leaves = list(w_.values())

    def fn() -> Tensor:
        return flat(torch.autograd.grad(b.g(w_, b.lam), leaves))

    return Runner("one inner gradient (unit)", "(unit)", "unit", fn)


def _hvp_unit(b: Bench) -> Runner:
    """One Hessian-vector product on hypergrad's retained graph (the cost of one CG iteration)."""
    from hypergrad.autodiff import RootSystem

    root = RootSystem(b.problem, b.w, b.lam, None)
    gen = torch.Generator().manual_seed(1)
    u = torch.randn(b.n_params, generator=gen, dtype=b.dtype)
    return Runner("one Hessian-vector product (retained graph)", "(unit)", "unit-hvp",
                  lambda: root.rmatvec_flat(u))


def _neumann_steps(b: Bench, tol: float, cap: int) -> int:
    probe = hg.Implicit(hg.linear.Neumann(alpha=b.alpha, steps=cap, tol=tol))
    return int(probe.hypergrad(b.problem, b.w, b.lam).info.iterations)


def make_runners(b: Bench, sizes: Sizes, which: list[str] | None = None, K: int | None = None) -> list[Runner]:
    """All runners for a problem (``which`` restricts to the named families)."""
    torchopt, _ = _peers()
    tol = sizes.tol
    K = K if K is not None else b.extra.get("K", sizes.unroll_k)
    maxiter = b.extra.get("maxiter")  # fixed CG iterations (MLP: non-convex, no tolerance target)
    cg_tol = 0.0 if maxiter else tol
    cg_maxiter = maxiter or 2000
    runners: list[Runner] = []

    def want(group: str) -> bool:
        return which is None or group in which

    def add(group: str, *new: Runner) -> None:
        for r in new:
            r.group = group
            runners.append(r)

    if want("unit"):
        add("unit", _grad_unit(b))
    if want("unit-hvp"):
        add("unit-hvp", _hvp_unit(b))
    if want("implicit-cg"):
        add("implicit-cg",
            _ours(b, hg.Implicit(hg.linear.CG(tol=cg_tol, maxiter=cg_maxiter, damping=b.damping)),
                  "Implicit CG", "implicit-cg"),
            _torchopt_implicit(
                b, torchopt.linear_solve.solve_cg(rtol=cg_tol, maxiter=cg_maxiter, ridge=b.damping or None),
                "custom_root + solve_cg", "implicit-cg"))
        jx = _jaxopt_implicit(b, cg_tol, cg_maxiter)
        if jx is not None:
            add("implicit-cg", jx)
    if want("implicit-cg-compiled") and b.n_params <= sizes.compiled_max_d:
        add("implicit-cg-compiled", _compiled_ours(b, cg_tol, cg_maxiter))
    if want("implicit-dense") and b.kind in ("ridge", "logistic") and b.n_params <= sizes.dense_max_d:
        # the Hessian from one batched backward, then Cholesky (benchmarks/implicit_dense.py)
        add("implicit-dense", _ours(b, hg.Implicit(hg.linear.Dense()), "Implicit Dense", "implicit-dense"))
    if want("implicit-neumann"):
        steps = b.extra.get("neumann_steps") or _neumann_steps(b, tol, sizes.neumann_cap)
        b.extra["neumann_steps"] = steps
        add("implicit-neumann",
            _ours(b, hg.Implicit(hg.linear.Neumann(alpha=b.alpha, steps=steps, tol=0.0)),
                  f"Implicit Neumann ({steps} terms)", "implicit-neumann"),
            _torchopt_implicit(b, torchopt.linear_solve.solve_inv(ns=True, maxiter=steps, alpha=b.alpha),
                               f"custom_root + solve_inv(ns=True, {steps} terms)", "implicit-neumann"))
    if want("unrolled-reverse"):
        add("unrolled-reverse", _unrolled(b, K), _higher(b, K), _metasgd(b, K))
    if want("unrolled-checkpoint"):
        add("unrolled-checkpoint", _unrolled(b, K, checkpoint=True))
    if want("unrolled-stored"):  # the stored graph without recomputation (the default before)
        add("unrolled-stored", _unrolled(b, K, recompute=False))
    if want("unrolled-all"):  # recomputation of every replaceable tensor, whatever its size
        add("unrolled-all", _unrolled(b, K, recompute_min_bytes=0))
    if want("unrolled-truncated"):
        add("unrolled-truncated", _unrolled(b, K, truncate=max(1, K // 10)))
    if want("unrolled-forward") and b.n_hyper <= 8:
        add("unrolled-forward", _unrolled(b, K, mode="forward"))
    if want("fd"):
        eps = 1e-4 if b.dtype == torch.float64 else 1e-2
        fd_cg = hg.FiniteDifference(
            eps=eps, solver=hg.linear.CG(tol=cg_tol, maxiter=cg_maxiter, damping=b.damping))
        add("fd",
            _ours(b, fd_cg, "FiniteDifference (CG)", "fd-cg"),
            _ours(b, hg.FiniteDifference(solver="identity", xi=b.lr),
                  "FiniteDifference (identity, DARTS)", "fd-identity"))
    if want("penalty"):
        add("penalty", _ours(b, hg.Penalty(sigma=b.sigma, inner_optimizer=hg.inner.SGD(lr=b.lr)),
                             f"Penalty / F2SA (T=1, sigma={b.sigma:g})", "penalty", state=_penalty_state(b)))
        add("penalty", _ours(b, hg.Penalty(sigma=b.sigma, inner_optimizer=hg.inner.SGD(lr=b.lr),
                                           evaluate="advanced"),
                             f"Penalty / F2SA, evaluate='advanced' (T=1, sigma={b.sigma:g})",
                             "penalty-advanced", state=_penalty_state(b)))
    return runners


# ------------------------------------------------------------------------------- timing


def cpu_timer(threads: int) -> Callable[[], float]:
    """CPU time of the computation: the calling thread's with one torch thread (the autograd engine
    and every kernel then run on it), the process's otherwise.

    Wall time is not used: on a shared machine a computation longer than the scheduler's slice is
    preempted by other processes, which inflates long calls more than short ones and would bias
    both the ratios and the gradient-equivalents. On an idle machine with one thread CPU time
    equals wall time.
    """
    return time.thread_time if threads == 1 else time.process_time


def time_interleaved(runners: list[Runner], sizes: Sizes, log: Callable[[str], None],
                     threads: int = 1) -> dict[str, Any]:
    """Warm up, then time rounds A B C ... (rotating the start), until ``repeats`` rounds or the
    time budget. Returns per-runner medians, all samples and the first call's output."""
    thread_clock = cpu_timer(threads)
    clocks = {r.name: time.process_time if r.clock == "process" else thread_clock for r in runners}
    outputs: dict[str, Tensor] = {}
    samples: dict[str, list[float]] = {r.name: [] for r in runners}
    wall: dict[str, list[float]] = {r.name: [] for r in runners}
    start = time.perf_counter()
    for r in runners:  # warm-up (unrolled runners: a 2-step call exercises the same code)
        (r.warm or r.fn)()
    warm_s = time.perf_counter() - start
    start = time.perf_counter()
    rounds = 0
    gc.collect()
    while rounds < sizes.repeats:
        order = runners[rounds % len(runners):] + runners[: rounds % len(runners)]
        gc.disable()  # as timeit does: no collector pauses inside the timed calls
        try:
            for r in order:
                clock = clocks[r.name]
                w0 = time.perf_counter()
                t0 = clock()
                out = r.fn()
                samples[r.name].append(clock() - t0)
                wall[r.name].append(time.perf_counter() - w0)
                outputs.setdefault(r.name, out)  # the accuracy sample: first timed call
        finally:
            gc.enable()
        rounds += 1
        elapsed = time.perf_counter() - start
        per_round = elapsed / rounds
        # expensive instances (a round longer than a third of the budget) may stop after one round
        min_rounds = sizes.min_repeats if per_round < sizes.budget_s / 3 else 1
        if rounds >= min_rounds and elapsed + per_round > sizes.budget_s:
            break
    log(f"    timed {rounds} interleaved round(s) of {len(runners)} runners in "
        f"{time.perf_counter() - start:.1f}s (warm-up {warm_s:.1f}s)")
    return {
        "median": {k: statistics.median(v) for k, v in samples.items()},
        "wall_median": {k: statistics.median(v) for k, v in wall.items()},
        "samples": samples,
        "outputs": outputs,
        "rounds": rounds,
    }


# ------------------------------------------------------------------------------- memory






def _dry_run() -> None:
    """Trigger every lazy import and first-call initialisation (torch.func, torchopt, higher)."""
    spec = {"key": "dry", "kind": "ridge", "n": 20, "d": 4, "scalar": True, "K": 2}
    b = build_bench(spec)
    for r in make_runners(b, replace(TINY, neumann_cap=5), K=2):
        r.fn()


def _measure_one(config: dict[str, Any]) -> dict[str, Any]:
    """Inside a fresh process: build, warm up, reset the peak-RSS counter, run once."""
    torch.set_num_threads(config["threads"])
    sizes = MODES[config["mode"]]
    t_build = time.perf_counter()
    b = build_bench(config["spec"], Path(config["cache"]))
    b.extra.update(config.get("extra", {}))
    runners = make_runners(b, sizes, [config["group"]], K=config.get("K"))
    runner = next(r for r in runners if r.name == config["name"])
    t_warm = time.perf_counter()
    # Methods whose memory does not grow with K warm up at full size (their peak is small, so
    # allocator state matters); the others warm up with K = 2 (their peak dwarfs that noise).
    lean = runner.family in ("unrolled-forward", "unrolled-checkpoint", "unrolled-truncated")
    (runner.fn if lean or runner.warm is None else runner.warm)()
    t_warm_end = time.perf_counter()
    with Phase() as phase:
        runner.fn()
    return {"peak_mb": phase.over / MB, "seconds": phase.seconds, "how": phase.how,
            "build_s": t_warm - t_build, "warm_s": t_warm_end - t_warm}


def _worker(config_path: str) -> None:
    """Hidden ``--worker`` entry: one forked child per configuration, JSON lines on stdout."""
    configs = json.loads(Path(config_path).read_text())
    _JAX["mod"] = None  # no jax in the memory worker: it forks, and jax is multithreaded
    _peers()  # import once in the parent; children start from this import-only state
    import sklearn.datasets  # noqa: F401

    _dry_run()
    gc.collect()
    for config in configs:
        if hasattr(os, "fork"):
            rfd, wfd = os.pipe()
            pid = os.fork()
            if pid == 0:  # child
                os.close(rfd)
                try:
                    out = _measure_one(config)
                except Exception as exc:  # report, do not kill the sweep
                    out = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                os.write(wfd, json.dumps(out).encode())
                os.close(wfd)
                os._exit(0)
            os.close(wfd)
            chunks = []
            while True:
                chunk = os.read(rfd, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
            os.close(rfd)
            os.waitpid(pid, 0)
            text = b"".join(chunks).decode() or '{"error": "child died"}'
            out = json.loads(text)
        else:
            out = _measure_one(config)
        print(json.dumps({"id": config["id"], **out}), flush=True)


def measure_memory(configs: list[dict[str, Any]], threads: int, log: Callable[[str], None]) -> dict[str, dict]:
    """Run the configurations in a worker subprocess (forking a fresh child for each)."""
    if not configs:
        return {}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(configs, fh)
        path = fh.name
    env = measurement_env(threads)  # large allocations through mmap, returned on free: RSS tracks live tensors
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", path, "--threads", str(threads)],
        capture_output=True, text=True, env=env, check=False,
    )
    os.unlink(path)
    results: dict[str, dict] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            item = json.loads(line)
            results[item.pop("id")] = item
    if proc.returncode != 0:
        log(f"    memory worker exited with {proc.returncode}: {proc.stderr[-500:]}")
    log(f"    memory: {len(results)}/{len(configs)} configurations in {time.perf_counter() - t0:.1f}s")
    return results


# ------------------------------------------------------------------------------ the suite


@dataclass
class Row:
    problem: str
    name: str
    library: str
    family: str
    time_s: float
    geq: float
    error: float | None
    agree: float | None = None  # relative difference to the paired runner (same estimator)
    iterations: int | None = None
    grad_evals: int | None = None
    peak_mb: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def fill_memory(rows: list[Row], threads: int, log: Callable[[str], None]) -> None:
    """Measure every row's peak memory in fresh processes, interleaving ours and the peers."""
    todo = [r for r in rows if "memory_config" in r.extra]
    configs = []
    for i, r in enumerate(todo):
        configs.append({"id": str(i), **r.extra.pop("memory_config")})
    mem = measure_memory(configs, threads, log)
    for i, r in enumerate(todo):
        m = mem.get(str(i), {})
        if "peak_mb" in m:
            r.peak_mb = m["peak_mb"]
        elif "error" in m:
            r.extra["memory_error"] = m["error"]


def run_problem(
    b: Bench, sizes: Sizes, runners: list[Runner], cache: Path | None, threads: int,
    log: Callable[[str], None], memory: bool,
) -> list[Row]:
    """Time the runners (interleaved); attach each row's memory configuration (measured later, in
    fresh processes, by :func:`fill_memory`)."""
    log(f"  {b.title} (set-up {b.extra.get('build_s', 0.0):.1f}s)")
    # Implicit Dense builds an n x n matrix (30 MB at d = 1000): interleaved with the others it
    # evicts their data from the caches, and the runner after it in each round pays for that
    # (ridge d = 1000, Penalty: 4.9 gradient-equivalents with Dense in the rounds, 4.2 without,
    # 3.25 timed with the unit gradient alone). It is timed in its own rounds after the others.
    main_runners = [r for r in runners if r.family != "implicit-dense"]
    timing = time_interleaved(main_runners, sizes, log, threads)
    heavy = [r for r in runners if r.family == "implicit-dense"]
    if heavy:
        extra_timing = time_interleaved(heavy, sizes, log, threads)
        for key in ("median", "wall_median", "samples", "outputs"):
            timing[key].update(extra_timing[key])
    unit = timing["median"]["one inner gradient (unit)"]
    outs = timing["outputs"]
    rows = []
    by_family: dict[str, Tensor] = {}
    for r in runners:
        if r.library == "hypergrad" and r.family not in by_family:
            by_family[r.family] = outs[r.name]
    for r in runners:
        t = timing["median"][r.name]
        err = (rel_err(outs[r.name], b.reference)
               if b.reference is not None and not r.family.startswith("unit") else None)
        fam = "unrolled-reverse" if r.family.startswith("unrolled-reverse") else r.family
        agree = None
        if r.library in ("torchopt", "higher", "jaxopt") and fam in by_family:
            agree = rel_err(outs[r.name], by_family[fam])
        if r.family in ("implicit-cg-compiled", "implicit-dense") and "implicit-cg" in by_family:  # vs CG
            agree = rel_err(outs[r.name], by_family["implicit-cg"])
        if r.family in ("unrolled-stored", "unrolled-all") and "unrolled-reverse" in by_family:  # vs default
            agree = rel_err(outs[r.name], by_family["unrolled-reverse"])
        extra = {"n_params": b.n_params, "n_hyper": b.n_hyper, "wall_s": timing["wall_median"][r.name]}
        for key in ("compile_s", "compiled"):
            if key in r.info:
                extra[key] = r.info[key]
        rows.append(Row(b.key, r.name, r.library, r.family, t, t / unit, err, agree,
                        r.info.get("iterations"), r.info.get("grad_evals"), extra=extra))
    if sizes.memory_only is not None and not b.key.startswith(sizes.memory_only):
        memory = False
    if memory and cache is not None:
        for r in runners:
            # jaxopt: XLA's own allocator and threads; not measured (forking after jax starts
            # its threads is unsafe)
            if r.family.startswith("unit") or r.library == "jaxopt" or r.family == "implicit-cg-compiled":
                continue
            row = next(x for x in rows if x.name == r.name)
            row.extra["memory_config"] = {
                "spec": b.extra_spec, "cache": str(cache), "mode": sizes.name, "threads": threads,
                "group": r.group, "name": r.name, "K": b.extra.get("K"),
                "extra": {k: v for k, v in b.extra.items() if k == "neumann_steps"},
            }
    return rows


_TITLES: dict[str, str] = {}
_REF_NOTES: dict[str, str] = {}


def _spec_bench(spec: dict[str, Any], cache: Path | None) -> Bench:
    b = build_bench(spec, cache)
    b.extra_spec = spec  # type: ignore[attr-defined]
    _TITLES[b.key] = b.title + (f", K={spec['K']}" if spec["kind"] == "mlp" else "")
    _REF_NOTES[b.key] = b.ref_note
    return b


def suite(sizes: Sizes, threads: int = 1, log: Callable[[str], None] = print,
          cache: Path | None = None) -> dict[str, Any]:
    """Run every problem; return rows, sweeps, hyper-cleaning results and metadata."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _suite(sizes, threads, log, cache)
    finally:
        torch.set_num_threads(threads_before)


def _suite(sizes: Sizes, threads: int, log: Callable[[str], None], cache: Path | None) -> dict[str, Any]:
    own_cache = cache is None
    if own_cache:
        cache = Path(tempfile.mkdtemp(prefix="hgbench-"))
    memory = sizes.memory
    t_start = time.perf_counter()
    rows: list[Row] = []
    precond: list[dict[str, Any]] = []
    all_families = None

    def run(n: int) -> bool:
        return sizes.problems is None or n in sizes.problems

    cleaning: list[dict[str, Any]] = []
    # 1. ridge
    for scalar in ((True, False) if run(1) else ()):
        spec = {"key": f"ridge_{'scalar' if scalar else 'feature'}", "kind": "ridge", "n": sizes.ridge_n,
                "d": sizes.ridge_d, "scalar": scalar, "K": sizes.unroll_k}
        b = _spec_bench(spec, cache)
        rows += run_problem(b, sizes, make_runners(b, sizes, all_families), cache, threads, log, memory)
        if not scalar:
            precond += preconditioning(b, sizes)

    # 1b. per-feature ridge at a larger d: the implicit runners only (jaxopt's comparison)
    for d in (sizes.ridge_large_d if run(1) else ()):
        spec = {"key": f"ridge_feature_d{d}", "kind": "ridge", "n": sizes.ridge_n, "d": d,
                "scalar": False, "K": sizes.unroll_k}
        b = _spec_bench(spec, cache)
        fams = ["unit", "unit-hvp", "implicit-cg", "implicit-cg-compiled", "implicit-dense", "penalty"]
        rows += run_problem(b, sizes, make_runners(b, sizes, fams), cache, threads, log, memory)
        precond += preconditioning(b, sizes)

    # 2. logistic, d sweep
    for d in (sizes.logistic_ds if run(2) else ()):
        spec = {"key": f"logistic_d{d}", "kind": "logistic", "n": sizes.logistic_n, "d": d,
                "scalar": False, "K": sizes.unroll_k}
        b = _spec_bench(spec, cache)
        fams = ["unit", "unit-hvp", "implicit-cg", "implicit-cg-compiled", "implicit-dense", "implicit-neumann",
                "fd", "penalty"]
        if d <= sizes.logistic_unrolled_max_d:
            fams += ["unrolled-reverse", "unrolled-truncated"]
        rows += run_problem(b, sizes, make_runners(b, sizes, fams), cache, threads, log, memory)
        precond += preconditioning(b, sizes)

    # 3. hyper-cleaning: single hypergradients, then the outer loop
    if run(3):
        spec = {"key": "clean", "kind": "clean", "n_train": sizes.clean_train, "K": sizes.clean_unroll_k,
                "sigma": 1e-2, "inner_iters": sizes.lbfgs_iters}
        b_clean = _spec_bench(spec, cache)
        rows += run_problem(b_clean, sizes, make_runners(b_clean, sizes, all_families), cache, threads,
                            log, memory)
        precond += preconditioning(b_clean, sizes)
        cleaning = hyper_cleaning(b_clean, sizes, log)

    # 4. MLP: scaling in the parameter count
    for width in (sizes.mlp_widths if run(4) else ()):
        spec = {"key": f"mlp_w{width}", "kind": "mlp", "width": width, "batch": sizes.mlp_batch,
                "K": sizes.mlp_k, "maxiter": 10, "sigma": 1e-2,
                "inner_iters": 100 if width >= 512 else min(200, sizes.lbfgs_iters)}
        b = _spec_bench(spec, cache)
        fams = ["unit", "unit-hvp", "implicit-cg", "implicit-cg-compiled", "unrolled-reverse", "unrolled-stored",
                "unrolled-all",
                "unrolled-checkpoint", "unrolled-forward", "fd", "penalty"]
        rows += run_problem(b, sizes, make_runners(b, sizes, fams), cache, threads, log, memory)

    # 5. unroll length sweep on a small MLP
    for K in (sizes.ks if run(5) else ()):
        spec = {"key": f"mlp_w{sizes.ksweep_width}", "label": f"ksweep_K{K}", "kind": "mlp",
                "width": sizes.ksweep_width, "batch": sizes.mlp_batch, "K": K, "maxiter": 10,
                "sigma": 1e-2, "inner_iters": min(200, sizes.lbfgs_iters)}
        b = _spec_bench(spec, cache)
        fams = ["unit", "unrolled-reverse", "unrolled-stored", "unrolled-all", "unrolled-checkpoint",
                "unrolled-truncated", "unrolled-forward"]
        rows += run_problem(b, sizes, make_runners(b, sizes, fams), cache, threads, log, memory)

    # 6. forward-mode memory against K on a larger MLP (a working set well above the ~0.3 MB the
    #    Python interpreter's free lists and heap add to any long loop)
    width = sizes.mlp_widths[min(1, len(sizes.mlp_widths) - 1)]
    for K in (sizes.flat_ks if run(6) else ()):
        spec = {"key": f"mlp_w{width}", "label": f"fwdflat_K{K}", "kind": "mlp", "width": width,
                "batch": sizes.mlp_batch, "K": K, "maxiter": 10, "sigma": 1e-2,
                "inner_iters": 100 if width >= 512 else min(200, sizes.lbfgs_iters)}
        b = _spec_bench(spec, cache)
        rows += run_problem(b, sizes, make_runners(b, sizes, ["unit", "unrolled-forward"]), cache,
                            threads, log, memory)

    if memory:
        fill_memory(rows, threads, log)
    if own_cache:
        shutil.rmtree(cache, ignore_errors=True)
    elapsed = time.perf_counter() - t_start
    return {"rows": rows, "cleaning": cleaning, "precond": precond, "elapsed_s": elapsed, "threads": threads,
            "sizes": sizes, "meta": metadata(threads), "titles": dict(_TITLES),
            "ref_notes": dict(_REF_NOTES)}


# ------------------------------------------------------------------------ hyper-cleaning


def _accuracy(b: Bench, w: Tree) -> float:
    with torch.no_grad():
        pred = functional_call(b.model, w, (b.data["Xt"],)).argmax(1)
    return float((pred == b.data["yt"]).double().mean())


def _retrain(b: Bench, lam: Tree, w0: Tree | None = None) -> Tree:
    return _minimize(lambda w: b.g(w, lam), b.w if w0 is None else w0, max_iter=200, tol=1e-6)


def preconditioning(b: Bench, sizes: Sizes) -> list[dict[str, Any]]:
    """CG iterations, products and time to the same relative residual, with and without Jacobi
    preconditioning (Hutchinson estimate; for ridge/logistic also the exact diagonal, supplied as a
    callable)."""
    variants: list[tuple[str, Any, int]] = [("none", None, 0), ("Jacobi, Hutchinson 10 probes", "jacobi", 10),
                                            ("Jacobi, Hutchinson 50 probes", "jacobi", 50)]
    if b.kind in ("ridge", "logistic"):
        X, n = b.data["X"], b.data["X"].shape[0]
        wv = b.w["weight"][0]
        s = (torch.ones(n, dtype=X.dtype) if b.kind == "ridge"
             else torch.sigmoid(X @ wv) * (1 - torch.sigmoid(X @ wv)))
        diag = (s[:, None] * X**2).sum(0) / n + torch.exp(b.lam["log_l2"]).expand(X.shape[1])
        variants.append(("Jacobi, exact diagonal (user callable)", lambda r: r / diag, 0))
    out = []
    clock = cpu_timer(1)
    for name, pre, probes in variants:
        cg = hg.linear.CG(tol=sizes.tol, maxiter=20000, preconditioner=pre, probes=max(probes, 1))
        method = hg.Implicit(cg)
        r = method.hypergrad(b.problem, b.w, b.lam)
        times = []
        for _ in range(3):
            t0 = clock()
            method.hypergrad(b.problem, b.w, b.lam)
            times.append(clock() - t0)
        err = rel_err(flat(r.grad), b.reference) if b.reference is not None else None
        out.append({"problem": b.key, "variant": name, "iterations": r.info.iterations,
                    "matvecs": r.info.extra["matvecs"], "time_s": min(times), "error": err,
                    "converged": r.info.converged})
    return out


def hyper_cleaning(b: Bench, sizes: Sizes, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """A short outer loop per method (Adam on the per-example logits), then test accuracy."""
    torchopt, higher = _peers()
    problem = b.problem
    steps, inner_steps, K = sizes.clean_outer_steps, sizes.clean_inner_steps, sizes.clean_unroll_k
    inner_opt = hg.inner.SGD(lr=b.lr)
    names = [k for k, _ in b.model.named_parameters()]
    results = []

    def implicit_ours(w: Tree, lam: Tree, st: dict, warm: bool = True, compile: bool = False) -> tuple[Tree, Tree]:
        w, _, _ = hg.inner_solve(problem, w, lam, inner_steps, inner_opt)
        r = hg.Implicit(hg.linear.CG(tol=sizes.tol), warm_start=warm, compile=compile).hypergrad(
            problem, w, lam, state=st.get("s"))
        st["s"] = r.state
        st.setdefault("cg_iters", []).append(r.info.iterations)
        return r.grad, w

    def implicit_cold(w: Tree, lam: Tree, st: dict) -> tuple[Tree, Tree]:
        return implicit_ours(w, lam, st, warm=False)

    def implicit_compiled(w: Tree, lam: Tree, st: dict) -> tuple[Tree, Tree]:
        return implicit_ours(w, lam, st, compile=True)

    def implicit_torchopt(w: Tree, lam: Tree, st: dict) -> tuple[Tree, Tree]:
        w, _, _ = hg.inner_solve(problem, w, lam, inner_steps, inner_opt)
        wk = list(w)
        w_star = tuple(w[k] for k in wk)

        def optimality(w_: tuple[Tensor, ...], lam_t: Tensor) -> tuple[Tensor, ...]:
            return tuple(torch.func.grad(lambda ww: b.g(dict(zip(wk, ww, strict=True)), {"logit_weight": lam_t}))(w_))

        @torchopt.diff.implicit.custom_root(optimality, argnums=1,
                                            solve=torchopt.linear_solve.solve_cg(rtol=sizes.tol, maxiter=2000))
        def solver(w_init: tuple[Tensor, ...], lam_t: Tensor) -> tuple[Tensor, ...]:
            return w_star

        lam_t = lam["logit_weight"].clone().requires_grad_(True)
        w_opt = solver(tuple(torch.zeros_like(v) for v in w_star), lam_t)
        value = b.f(dict(zip(wk, w_opt, strict=True)), {"logit_weight": lam_t})
        (g,) = torch.autograd.grad(value, lam_t)
        return {"logit_weight": g}, w

    def unrolled_ours(w: Tree, lam: Tree, st: dict) -> tuple[Tree, Tree]:
        r = hg.Unrolled(inner_opt, steps=K).hypergrad(problem, w, lam)
        return r.grad, r.w

    def unrolled_higher(w: Tree, lam: Tree, st: dict) -> tuple[Tree, Tree]:
        model = _load(b.model, w, True)
        opt = torch.optim.SGD(model.parameters(), lr=b.lr)
        lam_ = _leaves(lam)
        with higher.innerloop_ctx(model, opt, copy_initial_weights=True) as (fm, diffopt):
            for _ in range(K):
                diffopt.step(b.inner_loss(fm(b.data["X"]), dict(zip(names, fm.parameters(), strict=True)), lam_))
            params = dict(zip(names, fm.parameters(), strict=True))
            (g,) = torch.autograd.grad(b.outer_loss(fm(b.data["Xv"]), params, lam_), list(lam_.values()))
            w_new = {k: v.detach() for k, v in params.items()}
        return {"logit_weight": g}, w_new

    def penalty_ours(w: Tree, lam: Tree, st: dict) -> tuple[Tree, Tree]:
        m = hg.Penalty(sigma=b.sigma, inner_optimizer=inner_opt, inner_steps=inner_steps)
        r = m.hypergrad(problem, w, lam, state=st.get("s"))
        st["s"] = r.state
        return r.grad, r.w

    def fd_ours(w: Tree, lam: Tree, st: dict) -> tuple[Tree, Tree]:
        w, _, _ = hg.inner_solve(problem, w, lam, inner_steps, inner_opt)
        r = hg.FiniteDifference(eps=1e-4, solver=hg.linear.CG(tol=sizes.tol)).hypergrad(problem, w, lam)
        return r.grad, w

    methods = [
        ("Implicit CG (warm start)", "hypergrad", implicit_ours),
        ("Implicit CG (cold start)", "hypergrad", implicit_cold),
        ("Implicit CG (warm start, compile=True; compilation included)", "hypergrad", implicit_compiled),
        ("custom_root + solve_cg", "torchopt", implicit_torchopt),
        (f"Unrolled reverse (K={K})", "hypergrad", unrolled_ours),
        (f"higher unrolled (K={K})", "higher", unrolled_higher),
        ("FiniteDifference (CG)", "hypergrad", fd_ours),
        (f"Penalty / F2SA (T={inner_steps})", "hypergrad", penalty_ours),
    ]
    w0 = {k: v.detach().clone() for k, v in b.model.named_parameters()}
    lam0 = {k: v.clone() for k, v in b.lam.items()}
    log(f"  hyper-cleaning outer loop: {steps} Adam steps per method")
    clock = cpu_timer(torch.get_num_threads())
    for name, library, step in methods:
        lam_p = lam0["logit_weight"].clone().requires_grad_(True)
        opt = torch.optim.Adam([lam_p], lr=0.1)
        w = {k: v.clone() for k, v in w0.items()}
        st: dict[str, Any] = {}
        hyper_s = 0.0
        t0 = clock()
        for _ in range(steps):
            lam = {"logit_weight": lam_p.detach()}
            t1 = clock()
            grad, w = step(w, lam, st)
            hyper_s += clock() - t1
            opt.zero_grad()
            lam_p.grad = grad["logit_weight"].detach().clone()
            opt.step()
        total = clock() - t0
        lam_final = {"logit_weight": lam_p.detach()}
        acc = _accuracy(b, _retrain(b, lam_final, w))
        weights = torch.sigmoid(lam_final["logit_weight"])
        clean = b.data["clean"]
        results.append({
            "name": name, "library": library, "steps": steps, "total_s": total,
            "per_step_s": hyper_s / steps, "test_acc": acc,
            "w_clean": float(weights[clean].mean()), "w_corrupt": float(weights[~clean].mean()),
            "cg_iters": statistics.mean(st["cg_iters"]) if st.get("cg_iters") else None,
        })
        log(f"    {name:34s} test acc {acc:.3f}  {total:.1f}s")
    base = _accuracy(b, b.w)
    oracle_lam = {"logit_weight": torch.where(b.data["clean"], 20.0, -20.0).to(b.dtype)}
    oracle = _accuracy(b, _retrain(b, oracle_lam))
    results.append({"name": "no cleaning (all weights 0.5)", "library": "-", "test_acc": base})
    results.append({"name": "oracle (clean examples only)", "library": "-", "test_acc": oracle})
    return results


# ------------------------------------------------------------------ batched iMAML (sinusoids)


def sinusoid_tasks(n: int, shots: int, gen: torch.Generator, dtype: torch.dtype) -> tuple[tuple, tuple]:
    """``n`` sinusoid regression tasks (amplitude U[0.1, 5], phase U[0, pi], x U[-5, 5]):
    ``((x_support, y_support), (x_query, y_query))``, each ``(n, shots, 1)``."""
    amp = torch.rand(n, 1, 1, generator=gen) * 4.9 + 0.1
    phase = torch.rand(n, 1, 1, generator=gen) * math.pi
    xs = torch.rand(n, shots, 1, generator=gen) * 10 - 5
    xq = torch.rand(n, shots, 1, generator=gen) * 10 - 5
    ys, yq = amp * torch.sin(xs + phase), amp * torch.sin(xq + phase)
    return (xs.to(dtype), ys.to(dtype)), (xq.to(dtype), yq.to(dtype))


def sinusoid_mlp_init(gen: torch.Generator, width: int, dtype: torch.dtype) -> Tree:
    """A 1-width-width-1 tanh MLP's parameters (the meta-parameters theta)."""
    out: Tree = {}
    for name, (i, o) in {"1": (1, width), "2": (width, width), "3": (width, 1)}.items():
        out[f"W{name}"] = (torch.randn(i, o, generator=gen) / math.sqrt(i)).to(dtype)
        out[f"b{name}"] = torch.zeros(o, dtype=dtype)
    return out


def sinusoid_mlp(p: Tree, x: Tensor) -> Tensor:
    h = torch.tanh(x @ p["W1"] + p["b1"])
    h = torch.tanh(h @ p["W2"] + p["b2"])
    return h @ p["W3"] + p["b3"]


@dataclass(frozen=True)
class IMAMLSizes:
    """Sizes of the batched iMAML comparison.

    ``seeds`` independent meta-trainings (seed ``s``: theta0 from ``Generator(s)``, the task stream
    from ``Generator(IMAML_STREAM + s)``) per method in float32; seed 0 is also meta-trained in
    float64 (``float64_trajectory``), where the methods' trajectories are compared step by step.
    """

    name: str
    meta_steps: int = 300
    meta_batch: int = 25
    shots: int = 10
    width: int = 40
    inner_steps: int = 10
    inner_lr: float = 0.02
    rho: float = 5.0  # iMAML's proximal weight (some tasks' inner systems are still indefinite)
    cg_iters: int = 5
    meta_lr: float = 1e-3
    test_tasks: int = 200
    timing_steps: int = 5
    seeds: int = 5
    perturb: float = 1e-6  # the null control: BatchedImplicit from theta0 + perturb * N(0, 1)
    float64_trajectory: bool = True
    check_every: int = 10  # float64 run: every that many meta-steps, all meta-gradients at one theta


IMAML_FULL = IMAMLSizes("full")
IMAML_QUICK = IMAMLSizes("quick", meta_steps=20, test_tasks=50, timing_steps=3, seeds=3, check_every=5)
IMAML_STREAM = 10_000  # task-stream seed offset
IMAML_TEST_SEED = 12345  # the held-out meta-test tasks, the same for every seed and method
IMAML_DRIFT_AT = (1, 10, 30, 100, 300)  # meta-steps at which the trajectory table shows the drift
IMAML_BATCHED = "hypergrad BatchedImplicit (vmap over tasks)"
IMAML_LOOP = "hypergrad Implicit, loop over tasks"
IMAML_TORCHOPT = "torchopt custom_root + solve_cg, loop over tasks"
IMAML_CONTROL = "hypergrad BatchedImplicit, theta0 + perturbation (null control)"

# two-sided 95% quantiles of Student's t, t_{0.975}(df) for df = 1 .. 30
T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
        2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
        2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)


def t_interval(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation and the 95% Student-t interval of the mean of ``values``
    (2 to 31 of them): ``mean -+ t_{0.975}(n - 1) * sd / sqrt(n)``."""
    n = len(values)
    if not 2 <= n <= len(T975) + 1:
        raise ValueError(f"values: 2 to {len(T975) + 1} numbers for a t interval, got {n}")
    mean = statistics.fmean(values)
    sd = statistics.stdev(values)
    half = T975[n - 2] * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "half": half, "lo": mean - half, "hi": mean + half}


def imaml_methods(sizes: IMAMLSizes, dtype: torch.dtype) -> dict[str, Any]:
    """The three iMAML meta-gradients on a meta-batch, ``step(theta, support, query) -> grad``
    (hypergrad's ``BatchedImplicit``, hypergrad's ``Implicit`` in a loop over tasks, torchopt's
    functional ``custom_root`` + ``solve_cg`` in a loop over tasks: same inner steps from theta,
    same CG iterations) and ``meta_test(theta)``, the mean query MSE after adaptation on the
    held-out tasks."""
    torchopt, _ = _peers()
    dt = dtype
    rho, lr, K, cg_iters = sizes.rho, sizes.inner_lr, sizes.inner_steps, sizes.cg_iters

    def g(w: Tree, lam: Tree, b: Any) -> Tensor:
        x, y = b
        prox = sum(((w[k] - lam[k]) ** 2).sum() for k in w)
        return ((sinusoid_mlp(w, x) - y) ** 2).mean() + 0.5 * rho * prox

    def f(w: Tree, lam: Tree, b: Any) -> Tensor:
        x, y = b
        return ((sinusoid_mlp(w, x) - y) ** 2).mean()

    problem = hg.BilevelProblem(g, f)
    batched = hg.batched.BatchedImplicit(inner_steps=K, inner_lr=lr, cg_iters=cg_iters)

    def adapt(theta: Tree, b: Any) -> Tree:
        w = {k: v.detach().clone() for k, v in theta.items()}
        for _ in range(K):
            gw = torch.func.grad(lambda w_: g(w_, theta, b))(w)
            w = {k: w[k] - lr * gw[k] for k in w}
        return w

    def step_batched(theta: Tree, tr: Any, te: Any) -> Tree:
        return batched.hypergrad(problem, theta, theta, tr, te).grad

    loop_method = hg.Implicit(hg.linear.CG(tol=0.0, maxiter=cg_iters))

    def step_loop(theta: Tree, tr: Any, te: Any) -> Tree:
        total = {k: torch.zeros_like(v) for k, v in theta.items()}
        n = tr[0].shape[0]
        for i in range(n):
            b_tr, b_te = (tr[0][i], tr[1][i]), (te[0][i], te[1][i])
            r = loop_method.hypergrad(problem, adapt(theta, b_tr), theta, b_tr, b_te)
            for k in total:
                total[k] += r.grad[k] / n
        return total

    keys = list(sinusoid_mlp_init(torch.Generator().manual_seed(0), sizes.width, dt))

    def step_torchopt(theta: Tree, tr: Any, te: Any) -> Tree:
        def optimality(w_t: tuple[Tensor, ...], *th: Tensor, b: Any = None) -> tuple[Tensor, ...]:
            lam_ = dict(zip(keys, th, strict=True))
            return tuple(torch.func.grad(lambda ww: g(dict(zip(keys, ww, strict=True)), lam_, b))(w_t))

        def make_solver(b_tr: Any, w_star: Tree) -> Callable[..., tuple[Tensor, ...]]:
            def opt_cond(w_t: tuple[Tensor, ...], *th: Tensor) -> tuple[Tensor, ...]:
                return optimality(w_t, *th, b=b_tr)

            @torchopt.diff.implicit.custom_root(
                opt_cond, argnums=tuple(range(1, 1 + len(keys))),
                solve=torchopt.linear_solve.solve_cg(maxiter=cg_iters, rtol=0.0),
            )
            def solver(w_init: tuple[Tensor, ...], *th: Tensor) -> tuple[Tensor, ...]:
                return tuple(w_star[k] for k in keys)  # the inner solve is done by adapt()

            return solver

        total = {k: torch.zeros_like(v) for k, v in theta.items()}
        n = tr[0].shape[0]
        for i in range(n):
            b_tr, b_te = (tr[0][i], tr[1][i]), (te[0][i], te[1][i])
            solver = make_solver(b_tr, adapt(theta, b_tr))
            th = tuple(theta[k].detach().clone().requires_grad_(True) for k in keys)
            w_opt = solver(tuple(torch.zeros_like(t) for t in th), *th)
            loss = f(dict(zip(keys, w_opt, strict=True)), None, b_te)
            grads = torch.autograd.grad(loss, th)
            for k, gk in zip(keys, grads, strict=True):
                total[k] += gk / n
        return total

    test_tr, test_te = sinusoid_tasks(sizes.test_tasks, sizes.shots,
                                      torch.Generator().manual_seed(IMAML_TEST_SEED), dt)

    def meta_test(theta: Tree) -> float:
        res = batched.hypergrad(problem, theta, theta, test_tr, test_te)
        return float(res.outer_loss.mean())

    return {"methods": [(IMAML_BATCHED, "hypergrad", step_batched),
                        (IMAML_LOOP, "hypergrad", step_loop),
                        (IMAML_TORCHOPT, "torchopt", step_torchopt)],
            "meta_test": meta_test}


def imaml_lockstep(steps: list[Callable[[Tree, Any, Any], Tree]], theta0s: list[Tree], sizes: IMAMLSizes,
                   stream_seed: int, dtype: torch.dtype, meta_test: Callable[[Tree], float],
                   check_every: int | None = None) -> dict[str, Any]:
    """Meta-train one theta per ``steps[i]`` (from ``theta0s[i]``, Adam) side by side on one task
    stream: every meta-batch is drawn once and given to every method in turn, so the methods see
    the same tasks and share the machine's load step by step. Returns each method's final
    meta-test loss, its meta-gradient CPU time over the run, ``drift[i][t]``: the relative
    difference of theta_i to theta_0 after meta-step ``t + 1``, and ``grad_diff[i][t]``: that of
    meta-gradient i (at theta_i) to meta-gradient 0 (at theta_0) at meta-step ``t + 1``. With
    ``check_every``, every that many meta-steps each method's meta-gradient is also computed at
    theta_0 on that meta-batch (not timed, not applied): ``checks`` lists ``(step, [rel diff to
    meta-gradient 0])``, the estimators' own disagreement wherever the thetas have separated."""
    clock = cpu_timer(1)
    thetas = [{k: v.clone().requires_grad_(True) for k, v in th.items()} for th in theta0s]
    opts = [torch.optim.Adam(list(th.values()), lr=sizes.meta_lr) for th in thetas]
    cpu = [0.0] * len(steps)
    drift: list[list[float]] = [[] for _ in steps]
    grad_diff: list[list[float]] = [[] for _ in steps]
    checks: list[tuple[int, list[float]]] = []
    gen = torch.Generator().manual_seed(stream_seed)
    for t in range(1, sizes.meta_steps + 1):
        tr, te = sinusoid_tasks(sizes.meta_batch, sizes.shots, gen, dtype)
        grads = []
        for i, (step, theta, opt) in enumerate(zip(steps, thetas, opts, strict=True)):
            t0 = clock()
            grad = step({k: v.detach() for k, v in theta.items()}, tr, te)
            cpu[i] += clock() - t0
            grads.append(flat(grad))
            if check_every and t % check_every == 0 and i == 0:
                at0 = {k: v.detach() for k, v in theta.items()}
                checks.append((t, [0.0] + [rel_err(flat(s(at0, tr, te)), grads[0]) for s in steps[1:]]))
            for k, v in theta.items():
                v.grad = grad[k].detach().clone()
            opt.step()
        ref = flat(thetas[0])
        for i, theta in enumerate(thetas):
            drift[i].append(rel_err(flat(theta), ref))
            grad_diff[i].append(rel_err(grads[i], grads[0]))
    return {"meta_test_loss": [meta_test({k: v.detach() for k, v in th.items()}) for th in thetas],
            "train_s": cpu, "drift": drift, "grad_diff": grad_diff, "checks": checks}


def _imaml_timing(sizes: IMAMLSizes, dtype: torch.dtype, methods: list[tuple[str, str, Callable]],
                  memory: bool) -> list[dict[str, Any]]:
    """Per-method CPU time of one meta-gradient at seed 0's theta0 on one meta-batch: one warm-up
    each, then ``timing_steps`` interleaved rounds (each method once per round), median; the
    agreement of each meta-gradient with BatchedImplicit's there; the RSS peak of one step."""
    clock = cpu_timer(1)
    theta0 = sinusoid_mlp_init(torch.Generator().manual_seed(0), sizes.width, dtype)
    tr0, te0 = sinusoid_tasks(sizes.meta_batch, sizes.shots, torch.Generator().manual_seed(1), dtype)
    grads = [flat(step(theta0, tr0, te0)) for _, _, step in methods]  # also the warm-up
    times: list[list[float]] = [[] for _ in methods]
    for _ in range(sizes.timing_steps):
        for i, (_, _, step) in enumerate(methods):
            t0 = clock()
            step(theta0, tr0, te0)
            times[i].append(clock() - t0)
    rows = []
    for (name, library, step), grad, ts in zip(methods, grads, times, strict=True):
        row = {"name": name, "library": library, "step_s": statistics.median(ts),
               "tasks_per_s": sizes.meta_batch / statistics.median(ts), "agree": rel_err(grad, grads[0])}
        if memory:
            with Phase() as phase:
                step(theta0, tr0, te0)
            row["peak_mb"] = phase.over / MB
        rows.append(row)
    return rows


def imaml_suite(sizes: IMAMLSizes, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Meta-train a sinusoid regressor with iMAML three ways (``imaml_methods``) and compare speed
    and final meta-test loss: tasks per second of one meta-gradient (float32 and float64), the
    float64 trajectories of seed 0 side by side (``imaml_lockstep``), and ``sizes.seeds`` float32
    meta-trainings per method with a null control (BatchedImplicit from a perturbed theta0)."""
    if sizes.seeds < 2:
        raise ValueError(f"IMAMLSizes.seeds: at least 2 (a standard deviation needs two), got {sizes.seeds}")
    f32, f64 = imaml_methods(sizes, torch.float32), imaml_methods(sizes, torch.float64)
    log("  timing (float32, float64)")
    timing = {"float32": _imaml_timing(sizes, torch.float32, f32["methods"], memory=True),
              "float64": _imaml_timing(sizes, torch.float64, f64["methods"], memory=False)}
    names = [name for name, _, _ in f32["methods"]]
    trajectory = None
    if sizes.float64_trajectory:
        theta0 = sinusoid_mlp_init(torch.Generator().manual_seed(0), sizes.width, torch.float64)
        run = imaml_lockstep([s for _, _, s in f64["methods"]], [theta0] * 3, sizes, IMAML_STREAM,
                             torch.float64, f64["meta_test"], check_every=sizes.check_every)
        trajectory = {"names": names, **run}
        log("  float64 trajectory: meta-test MSE "
            + ", ".join(f"{x:.6f}" for x in run["meta_test_loss"])
            + f"; max drift {max(max(d) for d in run['drift']):.1e}")
    seeds = []
    for s in range(sizes.seeds):
        theta0 = sinusoid_mlp_init(torch.Generator().manual_seed(s), sizes.width, torch.float32)
        pg = torch.Generator().manual_seed(7 + s)
        perturbed = {k: v + sizes.perturb * torch.randn(v.shape, generator=pg, dtype=v.dtype)
                     for k, v in theta0.items()}
        steps = [s_ for _, _, s_ in f32["methods"]]
        run = imaml_lockstep([*steps, steps[0]], [*([theta0] * 3), perturbed], sizes, IMAML_STREAM + s,
                             torch.float32, f32["meta_test"])
        seeds.append({"seed": s, "untrained": f32["meta_test"](theta0), "meta_test_loss": run["meta_test_loss"],
                      "train_s": run["train_s"], "drift_max": [max(d) for d in run["drift"]]})
        log(f"  seed {s}: float32 meta-test MSE " + ", ".join(f"{x:.3f}" for x in run["meta_test_loss"]))
    return {"sizes": sizes, "timing": timing, "trajectory": trajectory, "names": [*names, IMAML_CONTROL],
            "seeds": seeds, "meta": metadata(1)}


def imaml_stats(result: dict[str, Any]) -> dict[str, Any]:
    """The float32 seed statistics of ``imaml_suite``'s result: per method the final meta-test
    losses over seeds with ``t_interval``, and the paired differences (per seed) BatchedImplicit
    minus each other method, the null control included."""
    names = result["names"]
    per = {name: [s["meta_test_loss"][i] for s in result["seeds"]] for i, name in enumerate(names)}
    methods = {name: {"values": v, **t_interval(v)} for name, v in per.items()}
    diffs = {}
    for name in names[1:]:
        d = [a - b for a, b in zip(per[names[0]], per[name], strict=True)]
        diffs[name] = {"values": d, **t_interval(d)}
    # exploratory (chosen after the first full run): BatchedImplicit, the Implicit loop and the null
    # control are one estimator up to round-off, so their per-seed mean is a less chaos-noisy sample of it
    ours = [statistics.fmean(vals) for vals in zip(per[IMAML_BATCHED], per[IMAML_LOOP], per[IMAML_CONTROL],
                                                   strict=True)]
    pooled = [a - b for a, b in zip(ours, per[IMAML_TORCHOPT], strict=True)]
    train = {name: statistics.fmean(s["train_s"][i] for s in result["seeds"]) for i, name in enumerate(names)}
    return {"methods": methods, "diffs": diffs, "pooled": {"values": pooled, **t_interval(pooled)},
            "train_s": train}


IMAML_CURVATURE_NOTE = (
    "Why the estimators are not identical: hypergrad's CG (in `Implicit` and in `BatchedImplicit` alike) "
    "stops a task's solve at a non-positive curvature p^T A p <= 0, and torchopt's `solve_cg` iterates on. "
    "They differ wherever a task's inner system rho I + Hessian is indefinite, which happens when the "
    "inner gradient steps do not reach a minimum (a high-amplitude task's curvature times the inner step "
    "size above 2). Checked by hand on the full mode's float64 run (2026-12-01): at meta-step 13 one task "
    "of the meta-batch had inner-Hessian eigenvalues down to -5.76 and an inner gradient norm of 12.7 "
    "after the 10 steps; torchopt's task meta-gradient equals textbook 5-iteration CG (to 5e-13), "
    "hypergrad's equals CG stopped at the non-positive curvature of iteration 5 (to 4e-14), and the two "
    "differ by 94%. This is hypergrad's documented behaviour, not round-off.")


def _first_above(values: list[float], threshold: float) -> int | None:
    """The first 1-based index whose value exceeds ``threshold`` (``None``: none does)."""
    return next((t for t, x in enumerate(values, start=1) if x > threshold), None)


def _short(name: str) -> str:
    return {IMAML_LOOP: "Implicit loop", IMAML_TORCHOPT: "torchopt"}.get(name, name)


def render_imaml(result: dict[str, Any], out: Path | None, command: str) -> str:
    sizes: IMAMLSizes = result["sizes"]
    meta = result["meta"]
    stats = imaml_stats(result)
    t32 = {r["name"]: r for r in result["timing"]["float32"]}
    t64 = {r["name"]: r for r in result["timing"]["float64"]}
    ratio32 = t32[IMAML_BATCHED]["tasks_per_s"] / t32[IMAML_TORCHOPT]["tasks_per_s"]
    ratio64 = t64[IMAML_BATCHED]["tasks_per_s"] / t64[IMAML_TORCHOPT]["tasks_per_s"]
    train_ratio = stats["train_s"][IMAML_TORCHOPT] / stats["train_s"][IMAML_BATCHED]
    n = len(result["seeds"])
    m = stats["methods"]
    d_peer, d_null = stats["diffs"][IMAML_TORCHOPT], stats["diffs"][IMAML_CONTROL]
    seed_sd = m[IMAML_TORCHOPT]["sd"]
    untrained = statistics.fmean(s["untrained"] for s in result["seeds"])
    lines = [
        "# Batched iMAML: hypergrad (vmap) vs torchopt on sinusoid few-shot regression", "",
        f"- Command: `{command}` ({sizes.name} mode)",
        f"- Date: {meta['date']}; machine: {meta['cpu']}, {meta['cores']} cores, shared with other jobs "
        f"(load average at the end {', '.join(f'{x:.1f}' for x in meta['load']) if meta['load'] else '?'}); "
        f"torch {meta['torch']} with 1 thread, torchopt {meta['torchopt']}, hypergrad {meta['hypergrad']}.",
        f"- Tasks: sinusoids (amplitude U[0.1, 5], phase U[0, pi]), {sizes.shots} support and "
        f"{sizes.shots} query points per task; model 1-{sizes.width}-{sizes.width}-1 tanh MLP; iMAML inner "
        f"loss = support MSE + {sizes.rho:g}/2 ||w - theta||^2, {sizes.inner_steps} gradient steps of "
        f"{sizes.inner_lr:g} from theta, {sizes.cg_iters} CG iterations; meta-batch {sizes.meta_batch}, Adam "
        f"{sizes.meta_lr:g}, {sizes.meta_steps} meta-steps; meta-test: the query MSE after adaptation on "
        f"{sizes.test_tasks} held-out tasks (the same tasks for every seed and method).",
        f"- Seeds: seed s draws theta0 from `Generator(s)` and the task stream from "
        f"`Generator({IMAML_STREAM} + s)`; within a seed every method gets the same theta0 and the same "
        "meta-batches, meta-trained side by side (each meta-batch is given to every method in turn). "
        f"The null control is BatchedImplicit again from theta0 + {sizes.perturb:g} N(0, 1): the same "
        "estimator, so its difference to BatchedImplicit is what round-off-sized changes alone do to the "
        "final loss.",
        "- *tasks/s*: meta-batch size / CPU time of one meta-gradient (median of "
        f"{sizes.timing_steps} interleaved rounds after a warm-up, seed 0's theta0, one meta-batch); "
        "*agree*: relative difference of the meta-gradient to BatchedImplicit's there (on that one meta-batch; "
        "the float64 section shows where the estimators differ); *peak MB*: RSS peak "
        "over the baseline during one meta-step (in-process); *meta-training s*: meta-gradient CPU time of "
        f"the {sizes.meta_steps} float32 meta-steps, mean over the {n} seeds. CPU time of the calling "
        "thread (1 torch thread), so other jobs on the shared machine inflate it less than wall time.", "",
        "## Criterion for equal meta-test loss (fixed before the numbers)", "",
        "The three methods implement the same estimator (the same inner steps from theta, then 5 CG "
        "iterations); where their meta-gradients agree to round-off (*agree* below), only round-off, which "
        "meta-training amplifies, can separate their final losses. Two checks:",
        "1. **float64 trajectories** (exact equality): seed 0 meta-trained in float64 by the three methods "
        "side by side; equal if the relative difference of their thetas stays below 1e-6 over the whole run "
        "and the final meta-test MSEs agree to 4 significant digits.",
        f"2. **float32 over {n} seeds** (the speed setting): equal if the 95% Student-t interval of the "
        "mean paired difference BatchedImplicit - torchopt (per seed, same theta0 and tasks) contains 0. "
        "The interval's half-width, stated next to torchopt's across-seed sd, says how large a difference "
        "this could have detected; the null control's interval shows the spread that round-off alone gives.",
        "",
    ]
    # ------------------------------------------------------------------ summary
    summary = [f"**Speed: BatchedImplicit / torchopt = {ratio32:.1f}x the tasks per second in float32** "
               f"(target >= 3x; {ratio64:.1f}x in float64; {train_ratio:.1f}x over the whole float32 "
               "meta-trainings)."]
    traj_equal = None
    if result["trajectory"] is not None:
        tr = result["trajectory"]
        mses = tr["meta_test_loss"]
        max_drift = max(max(d) for d in tr["drift"])
        spread = (max(mses) - min(mses)) / min(mses)
        traj_equal = max_drift < 1e-6 and spread < 5e-5
        sep = {name: _first_above(tr["drift"][i], 1e-6) for i, name in enumerate(tr["names"])}
        summary.append(
            f"**float64: the trajectories {'stay together' if traj_equal else 'separate'}** (largest relative "
            f"theta difference over the {sizes.meta_steps} meta-steps {max_drift:.1e}"
            + ("" if traj_equal else "; above 1e-6 from meta-step "
               + ", ".join(f"{sep[n_]} ({_short(n_)})" for n_ in tr["names"][1:] if sep[n_] is not None))
            + "; final meta-test MSE " + ", ".join(f"{x:.6f}" for x in mses)
            + f", relative spread {spread:.1e}).")
        checks = {name: [c[1][i] for c in tr["checks"]] for i, name in enumerate(tr["names"])}
        n_bad = {name: sum(x > 1e-6 for x in v) for name, v in checks.items()}
        if tr["checks"]:
            summary.append(
                "**Same estimator?** Meta-gradients at the same theta (BatchedImplicit's, every "
                f"{sizes.check_every} meta-steps of that float64 run) differing from BatchedImplicit's by more "
                "than 1e-6: " + "; ".join(
                    f"{_short(n_)} {n_bad[n_]} of {len(v)} (max {max(v):.1e})"
                    for n_, v in checks.items() if n_ != IMAML_BATCHED) + ".")
    contains0 = d_peer["lo"] <= 0.0 <= d_peer["hi"]
    summary.append(
        f"**float32, {n} seeds: BatchedImplicit - torchopt = {d_peer['mean']:+.3f}, 95% interval "
        f"[{d_peer['lo']:+.3f}, {d_peer['hi']:+.3f}], which {'contains' if contains0 else 'does not contain'} 0** "
        f"(half-width {d_peer['half']:.3f} = {d_peer['half'] / seed_sd:.2f} x torchopt's seed sd {seed_sd:.3f}; "
        f"null control BatchedImplicit - perturbed BatchedImplicit: {d_null['mean']:+.3f} "
        f"[{d_null['lo']:+.3f}, {d_null['hi']:+.3f}]; BatchedImplicit lower in "
        f"{sum(x < 0 for x in d_peer['values'])} of {n} seeds).")
    if not contains0:
        verdict = "not established**: the float32 interval excludes 0"
    elif traj_equal or traj_equal is None:
        verdict = "equal** by " + ("both criteria" if traj_equal else "the float32 criterion")
    else:
        tr = result["trajectory"]
        k = sum(c[1][tr["names"].index(IMAML_TORCHOPT)] > 1e-6 for c in tr["checks"])
        verdict = ("not exact**: the float64 trajectories separate (criterion 1 fails)"
                   + (f" and torchopt's meta-gradient differs from BatchedImplicit's at the same theta in {k} of "
                      f"{len(tr['checks'])} checks (the curvature handling below)" if k else
                      ", through round-off alone (every same-theta check agrees to 1e-6)")
                   + "; over the float32 seeds no difference in final meta-test loss is detected (the interval "
                   f"contains 0, resolution +-{d_peer['half']:.3f}, while round-off alone, the null control, "
                   f"moves it by sd {d_null['sd']:.3f})")
    summary.append(f"Conclusion: equal meta-test loss is **{verdict}. Untrained meta-test MSE "
                   f"{untrained:.3f} (mean over seeds).")
    pool = stats["pooled"]
    summary.append(
        "Exploratory, chosen after seeing the first full run (not the criterion above): hypergrad's estimator "
        "averaged over its three runs per seed (BatchedImplicit, Implicit loop, null control) minus torchopt: "
        f"{pool['mean']:+.3f}, 95% interval [{pool['lo']:+.3f}, {pool['hi']:+.3f}] "
        f"({'contains' if pool['lo'] <= 0.0 <= pool['hi'] else 'excludes'} 0; lower in "
        f"{sum(x < 0 for x in pool['values'])} of {n} seeds).")
    lines += ["## Result", ""] + [s + "\n" for s in summary]
    # ------------------------------------------------------------------ speed table
    lines += ["## Speed", "",
              "| method | library | tasks/s float32 | ms / meta-step float32 | tasks/s float64 | peak MB | "
              "meta-training s | agree float32 | agree float64 |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name in result["names"][:3]:
        a, b = t32[name], t64[name]
        lines.append(
            f"| {name} | {a['library']} | {a['tasks_per_s']:.0f} | {a['step_s'] * 1e3:.1f} | "
            f"{b['tasks_per_s']:.0f} | {_fmt(a.get('peak_mb'), '.1f')} | {stats['train_s'][name]:.1f} | "
            f"{a['agree']:.0e} | {b['agree']:.0e} |")
    lines.append("")
    # ------------------------------------------------------------------ float64 trajectory
    if result["trajectory"] is not None:
        tr = result["trajectory"]
        at = [t for t in IMAML_DRIFT_AT if t <= sizes.meta_steps]
        if sizes.meta_steps not in at:
            at.append(sizes.meta_steps)
        lines += ["## float64 trajectories (seed 0)", "",
                  "Seed 0's theta0 and meta-batches (the float32 ones, cast), meta-trained in float64 by the three "
                  "methods side by side. *t = ...*: relative difference of the method's theta to BatchedImplicit's "
                  "after meta-step t; *theta > 1e-6*: the first meta-step where it exceeds 1e-6; *grad > 1e-6*: "
                  "the first meta-step where the meta-gradients differ by more than 1e-6 (each at its own theta); "
                  f"*same-theta checks*: every {sizes.check_every} meta-steps all meta-gradients computed at "
                  "BatchedImplicit's theta on that meta-batch: how many of these differ from BatchedImplicit's "
                  "by more than 1e-6, and the largest difference.", "",
                  "| method | " + " | ".join(f"t = {t}" for t in at)
                  + " | max | theta > 1e-6 | grad > 1e-6 | same-theta checks > 1e-6 | final meta-test MSE |",
                  "|---|" + "---|" * (len(at) + 5)]
        for i, name in enumerate(tr["names"]):
            d = tr["drift"][i]
            checks = [c[1][i] for c in tr["checks"]]
            n_bad = sum(x > 1e-6 for x in checks)
            lines.append(f"| {name} | " + " | ".join(f"{d[t - 1]:.1e}" for t in at)
                         + f" | {max(d):.1e} | {_fmt(_first_above(d, 1e-6), 'd')} | "
                         f"{_fmt(_first_above(tr['grad_diff'][i], 1e-6), 'd')} | "
                         f"{n_bad} of {len(checks)} (max {max(checks, default=0.0):.1e}) | "
                         f"{tr['meta_test_loss'][i]:.6f} |")
        lines += ["", IMAML_CURVATURE_NOTE, ""]
    # ------------------------------------------------------------------ float32 seeds
    lines += [f"## float32 final meta-test MSE over {n} seeds", "",
              "| method | " + " | ".join(f"seed {s['seed']}" for s in result["seeds"])
              + " | mean | sd | max theta drift to BatchedImplicit (median over seeds) |",
              "|---|" + "---|" * (n + 3)]
    for i, name in enumerate(result["names"]):
        v = m[name]
        drift = statistics.median(s["drift_max"][i] for s in result["seeds"])
        lines.append(f"| {name} | " + " | ".join(f"{x:.4f}" for x in v["values"])
                     + f" | {v['mean']:.4f} | {v['sd']:.4f} | {drift:.1e} |")
    lines.append("| no meta-training (theta0) | " + " | ".join(f"{s['untrained']:.4f}" for s in result["seeds"])
                 + f" | {untrained:.4f} | - | - |")
    lines += ["", "Paired differences per seed (BatchedImplicit minus the method), mean and 95% t interval "
              f"(t_0.975({n - 1}) = {T975[n - 2]}):", "",
              "| BatchedImplicit minus | " + " | ".join(f"seed {s['seed']}" for s in result["seeds"])
              + " | mean | sd | 95% interval | contains 0 |",
              "|---|" + "---|" * (n + 4)]
    for name, d in stats["diffs"].items():
        lines.append(f"| {name} | " + " | ".join(f"{x:+.4f}" for x in d["values"])
                     + f" | {d['mean']:+.4f} | {d['sd']:.4f} | [{d['lo']:+.4f}, {d['hi']:+.4f}] | "
                     + ("yes" if d["lo"] <= 0.0 <= d["hi"] else "no") + " |")
    pool = stats["pooled"]
    lines.append("| (exploratory) torchopt, from the mean of BatchedImplicit, Implicit loop and null control | "
                 + " | ".join(f"{x:+.4f}" for x in pool["values"])
                 + f" | {pool['mean']:+.4f} | {pool['sd']:.4f} | [{pool['lo']:+.4f}, {pool['hi']:+.4f}] | "
                 + ("yes" if pool["lo"] <= 0.0 <= pool["hi"] else "no") + " |")
    lines.append("")
    text = "\n".join(lines)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "hypergrad_imaml.md").write_text(text)
    return text


# ----------------------------------------------------------------------------- reporting


def _find(rows: list[Row], problem: str, family: str, library: str) -> Row | None:
    for r in rows:
        if r.problem == problem and r.family == family and r.library == library:
            return r
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def pair_ratios(rows: list[Row]) -> list[dict[str, Any]]:
    """ours/peer per problem for every comparable pair: time and peak memory."""
    pairs = [
        ("implicit-cg", "implicit-cg", "torchopt", "Implicit CG / torchopt custom_root+solve_cg"),
        ("implicit-cg", "implicit-cg", "jaxopt", "Implicit CG / jaxopt custom_root+solve_cg (jit)"),
        ("implicit-cg-compiled", "implicit-cg", "jaxopt", "Implicit CG compile=True / jaxopt (jit)"),
        ("implicit-cg-compiled", "implicit-cg", "torchopt", "Implicit CG compile=True / torchopt"),
        ("implicit-cg-compiled", "implicit-cg", "hypergrad", "Implicit CG compile=True / eager"),
        ("implicit-dense", "implicit-cg", "jaxopt", "Implicit Dense (not the default) / jaxopt CG (jit)"),
        ("implicit-dense", "implicit-cg", "torchopt", "Implicit Dense (not the default) / torchopt CG"),
        ("implicit-dense", "implicit-cg", "hypergrad", "Implicit Dense / Implicit CG"),
        ("implicit-neumann", "implicit-neumann", "torchopt", "Implicit Neumann / torchopt solve_inv(ns)"),
        ("unrolled-reverse", "unrolled-reverse", "higher", "Unrolled reverse / higher"),
        ("unrolled-reverse", "unrolled-reverse-metasgd", "torchopt", "Unrolled reverse / torchopt MetaSGD"),
    ]
    out = []
    problems = list(dict.fromkeys(r.problem for r in rows))
    for ours_fam, peer_fam, peer_lib, label in pairs:
        for p in problems:
            a = _find(rows, p, ours_fam, "hypergrad")
            b = _find(rows, p, peer_fam, peer_lib)
            if a is None or b is None:
                continue
            out.append({
                "pair": label, "problem": p, "time_ratio": _ratio(a.time_s, b.time_s),
                "mem_ratio": _ratio(a.peak_mb, b.peak_mb), "ours_err": a.error, "peer_err": b.error,
                "agree": b.agree if b.agree is not None else a.agree,
                "ours_ms": a.time_s * 1e3, "peer_ms": b.time_s * 1e3,
                "ours_mb": a.peak_mb, "peer_mb": b.peak_mb,
            })
    return out


def side_by_side(rows: list[Row]) -> list[str]:
    """Implicit CG on ridge/logistic: jaxopt (jit), hypergrad eager and compiled, torchopt."""
    lines = [
        "| problem | d | CG iterations | jaxopt-jit ms | hypergrad ms | hypergrad compile=True ms | "
        "torchopt ms | hypergrad / jaxopt | compile=True / jaxopt | hypergrad / torchopt | "
        "compile=True / torchopt | wall-time hypergrad / jaxopt | jit compile s | torch.compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    n = 0
    for p in dict.fromkeys(r.problem for r in rows):
        a = _find(rows, p, "implicit-cg", "hypergrad")
        j = _find(rows, p, "implicit-cg", "jaxopt")
        t = _find(rows, p, "implicit-cg", "torchopt")
        c = _find(rows, p, "implicit-cg-compiled", "hypergrad")
        if a is None or j is None or t is None:
            continue
        n += 1
        wall = _ratio(a.extra.get("wall_s"), j.extra.get("wall_s"))
        lines.append(
            f"| {p} | {a.extra.get('n_params', '-')} | {_fmt(a.iterations, 'd')} | {_fmt_time(j.time_s)} | "
            f"{_fmt_time(a.time_s)} | {_fmt_time(c.time_s) if c else '-'} | {_fmt_time(t.time_s)} | "
            f"**{_fmt(_ratio(a.time_s, j.time_s))}** | {_fmt(_ratio(c.time_s, j.time_s)) if c else '-'} | "
            f"{_fmt(_ratio(a.time_s, t.time_s))} | {_fmt(_ratio(c.time_s, t.time_s)) if c else '-'} | "
            f"{_fmt(wall)} | {_fmt(j.extra.get('compile_s'))} | "
            f"{_fmt(c.extra.get('compile_s')) if c else '-'} |")
    return lines if n else []


def targets(rows: list[Row], sizes: Sizes) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured value and pass/fail (None: not measured)."""
    out: list[dict[str, Any]] = []

    def add(target: str, where: str, value: float | None, limit: float, note: str = "",
            ok: bool | str | None = "auto") -> None:
        passed = ok if ok != "auto" else (None if value is None else value <= limit)
        out.append({"target": target, "where": where, "value": value, "limit": limit,
                    "pass": passed, "note": note})

    problems = list(dict.fromkeys(r.problem for r in rows))
    for p in problems:
        if not (p.startswith("ridge") or p.startswith("logistic")):
            continue
        a = _find(rows, p, "implicit-cg", "hypergrad")
        b = _find(rows, p, "implicit-cg", "torchopt")
        if a and b:
            note = f"errors {a.error:.1e} vs {b.error:.1e}" if a.error is not None and b.error is not None else ""
            add("Implicit CG time <= 0.5x torchopt", p, _ratio(a.time_s, b.time_s), 0.5, note)
        j = _find(rows, p, "implicit-cg", "jaxopt")
        if a and j:
            limit = 1.0 if a.extra.get("n_params", 0) >= 1000 else 2.0
            note = (f"{a.time_s * 1e3:.3g} vs {j.time_s * 1e3:.3g} ms; jit compile "
                    f"{j.extra.get('compile_s', float('nan')):.2f} s excluded")
            add(f"Implicit CG time <= {limit:g}x jaxopt-jit", p, _ratio(a.time_s, j.time_s), limit, note)
        c = _find(rows, p, "implicit-cg-compiled", "hypergrad")
        if c and b:
            add("  same, Implicit(compile=True): time <= 0.5x torchopt", p, _ratio(c.time_s, b.time_s), 0.5,
                f"compile {c.extra.get('compile_s', float('nan')):.1f} s excluded")
        if c and j:
            limit = 1.0 if c.extra.get("n_params", 0) >= 1000 else 2.0
            add(f"  same, Implicit(compile=True): time <= {limit:g}x jaxopt-jit", p, _ratio(c.time_s, j.time_s),
                limit, f"{c.time_s * 1e3:.3g} vs {j.time_s * 1e3:.3g} ms")
    k_target = 100 if 100 in sizes.ks else max(sizes.ks)
    label = f"ksweep_K{k_target}"
    a = _find(rows, label, "unrolled-reverse", "hypergrad")
    b = _find(rows, label, "unrolled-reverse", "higher")
    if a and b:
        add(f"Unrolled reverse peak memory <= 0.8x higher (K={k_target})", label,
            _ratio(a.peak_mb, b.peak_mb), 0.8,
            f"{a.peak_mb:.1f} vs {b.peak_mb:.1f} MB" if a.peak_mb and b.peak_mb else "not measured")
        add(f"Unrolled reverse time <= 1.0x higher (K={k_target})", label, _ratio(a.time_s, b.time_s), 1.0,
            f"{a.time_s * 1e3:.0f} vs {b.time_s * 1e3:.0f} ms")
        for family, variant in (("unrolled-stored", "recompute=False"), ("unrolled-all", "recompute_min_bytes=0"),
                                ("unrolled-checkpoint", "checkpoint=True")):
            v = _find(rows, label, family, "hypergrad")
            if v:
                add(f"  same, Unrolled({variant}): peak memory <= 0.8x higher (K={k_target})", label,
                    _ratio(v.peak_mb, b.peak_mb), 0.8,
                    f"{v.peak_mb:.1f} vs {b.peak_mb:.1f} MB" if v.peak_mb and b.peak_mb else "not measured")
                add(f"  same, Unrolled({variant}): time <= 1.0x higher (K={k_target})", label,
                    _ratio(v.time_s, b.time_s), 1.0, f"{v.time_s * 1e3:.0f} vs {b.time_s * 1e3:.0f} ms")
    for prefix in ("fwdflat_K", "ksweep_K"):
        fwd = [r for r in rows if r.problem.startswith(prefix) and r.family == "unrolled-forward"]
        if len(fwd) < 2:
            continue
        lo = min(fwd, key=lambda r: int(r.problem.split("K")[-1]))
        hi = max(fwd, key=lambda r: int(r.problem.split("K")[-1]))
        value = _ratio(hi.peak_mb, lo.peak_mb)
        ok = None if value is None else abs(value - 1.0) <= 0.10
        where = f"{prefix[:-2]} ({lo.extra.get('n_params', 0):,} parameters)"
        note = f"{lo.peak_mb:.2f} -> {hi.peak_mb:.2f} MB" if value is not None else "not measured"
        if prefix == "ksweep_K" and value is not None:
            # A ~1.5 MB working set is within the RSS the interpreter itself adds over a long loop
            # (free lists, heap: about 0.3 MB at K = 1000, measured with tracemalloc): shown, not
            # judged; the fwdflat problem above is the check.
            ok = None
            note += " (informational: below the ~0.3 MB RSS noise of a 1000-step Python loop)"
        add(f"Unrolled forward memory flat in K (K={lo.problem.split('K')[-1]} -> "
            f"{hi.problem.split('K')[-1]}, within 10%)", where, value, 1.10, note, ok=ok)
    for fam, label in (("fd-identity", "FiniteDifference (identity)"), ("fd-cg", "FiniteDifference (CG)"),
                       ("penalty", "Penalty (T=1, default evaluate='current')"),
                       ("penalty-advanced", "Penalty (T=1, evaluate='advanced')")):
        sel = [r for r in rows if r.family == fam]
        if sel:
            worst = max(sel, key=lambda r: r.geq)
            add(f"{label} <= 4 gradient-equivalents", f"worst: {worst.problem}", worst.geq, 4.0,
                f"median over problems {statistics.median(r.geq for r in sel):.1f}")
    return out


CORE_CHANGES = [
    "## Changes to the core made while profiling for this benchmark",
    "",
    "- `hypergrad/linear/cg.py`: CG iterates on one flat vector with in-place updates instead of "
    "dicts of tensors (on a 100-feature ridge problem the pytree bookkeeping cost about as much as "
    "the Hessian-vector product itself); `LinearSystem.flat_matvec` (new, optional) lets `Implicit` "
    "hand the solvers a flat product. `Neumann` and `largest_eigenvalue` use the same path.",
    "- `hypergrad/autodiff.py`: `RootSystem.rmatvec_flat` calls the autograd engine entry directly "
    "for the repeated products on the retained graph (falls back to `torch.autograd.grad`), "
    "skipping its per-call argument normalisation (about 25 of 115 us per product on that problem).",
    "- `hypergrad/inner.py`: SGD and momentum updates are one fused `torch.add(..., alpha=)` per "
    "leaf (fewer ops recorded per unrolled step and replayed in the backward pass).",
    "- `hypergrad/unrolled.py`: forward mode with a single scalar hyperparameter propagates the "
    "tangent with one reverse-over-reverse Hessian-vector product per step on that step's retained "
    "graph plus a dual-number JVP of the elementwise update; before, `torch.func.jvp` over "
    "`torch.func.grad` through the whole step made forward mode 5-7x slower than reverse mode on the "
    "K-sweep MLP (542 ms vs 90 ms at K = 30); it is now about 1.0-1.3x. New option "
    "`Unrolled(checkpoint=True)`: reverse mode storing only the iterates and rebuilding one step's "
    "graph at a time in the backward sweep (same estimate; memory vs time trade-off above).",
    "- `hypergrad/tree.py`: `tree_flatten_view` (no copy for a single leaf); `tree_unflatten` "
    "restores each leaf's dtype.",
    "",
    "## Changes in this round (issue 18)",
    "",
    "- jaxopt (`custom_root` + `solve_cg` under `jax.jit`, float64, one XLA thread) on ridge and "
    "logistic regression, from the optional `bench` extra (`pip install -e \".[bench]\"`); rows "
    "are left out when jax is not installed.",
    "- `hypergrad/compiled.py`, `Implicit(compile=True)` (rewritten in the last round): one stage "
    "traced by torch.compile (outer gradients, inner gradient, a Hessian-vector product and the "
    "mixed product, by torch.func), its ATen graph split by dependence on the product vectors, each "
    "part compiled by inductor; the solver calls the compiled product, or for plain CG a compiled "
    "CG step (`LinearSystem.flat_cg_step`), directly. Any `hypergrad.linear` solver; equal to the "
    "eager path to 1e-10 in float64 and no recompiles on later calls (tested with torch._dynamo "
    "counters); tensors the losses read from closures are graph inputs, read afresh on every call "
    "(tested); eager fallback with a log line when compilation fails. Not the default (rows above).",
    "- `hypergrad.linear.CG(preconditioner=...)`: Jacobi from a Hutchinson diagonal estimate or a "
    "user callable; stops on the unpreconditioned residual (table above).",
    "- `Penalty(evaluate=\"current\")`, now the default: the F2SA estimate from the backward passes "
    "that step the iterates, 2T evaluations (`evaluate=\"advanced\"`, 2T + 2, is Algorithm 1 as "
    "written); `Penalty` and `BOME` now report `converged` from the inner "
    "residuals / the value-function gap against a `tol`; `BOME(w_lr=None)` with a `w_optimizer`.",
    "- `Unrolled(recompute=True)`: the first step finds the replaceable saved tensors under "
    "saved-tensor hooks and records where they sit in its graph; the later steps run without hooks "
    "and replace just those (`SavedTensor.register_hooks`), so only they reach Python; "
    "`recompute_min_bytes` (default 48 KiB) skips tensors that free less per save; the per-step "
    "gradient calls the autograd engine directly (rows `recompute_min_bytes=0` above: every "
    "replaceable tensor).",
    "",
]


def notes(result: dict[str, Any]) -> list[str]:
    """What limits each target, with the numbers of this run."""
    rows: list[Row] = result["rows"]
    out: list[str] = []
    # 1. Implicit CG against torchopt
    parts = []
    for p in dict.fromkeys(r.problem for r in rows):
        a = _find(rows, p, "implicit-cg", "hypergrad")
        b = _find(rows, p, "implicit-cg", "torchopt")
        h = _find(rows, p, "unit-hvp", "(unit)")
        if a and b and h and a.iterations:
            parts.append(f"{p}: {a.iterations} CG iterations, one HVP = {h.geq:.2f} gradients, ours "
                         f"{a.geq:.1f} vs torchopt {b.geq:.1f} gradient-equivalents ({a.time_s / b.time_s:.2f}x)")
    if parts:
        out += [
            "**Implicit CG vs torchopt.** Both run the same conjugate-gradient iterations to the same "
            "relative residual (identical errors, agreement ~1e-15). Per hypergradient hypergrad spends "
            "one outer gradient, one inner gradient with a graph, one Hessian-vector product (HVP) per "
            "iteration as one backward pass through that retained graph, and one mixed product; "
            "torchopt's `custom_root` spends the outer gradient, two functorch `vjp` set-ups (each an "
            "inner gradient with a graph), K + 1 HVPs through functorch's `vjp_fn` (with pytree and "
            "functorch-level overhead per call) and the mixed product. The 0.5x target is met where "
            "those fixed and per-call overheads dominate; where the HVP itself dominates (its BLAS work "
            "is the same for both libraries) the ratio tends to the ratio of per-iteration costs. "
            "Measured: " + "; ".join(parts) + ". Closing the rest of the gap at equal accuracy needs "
            "fewer iterations (preconditioning, problem-specific) or a cheaper HVP than one backward "
            "pass of the user's loss, which no library controls. In an outer loop hypergrad's "
            "`Implicit(warm_start=True)` also reuses the previous solution, which `custom_root` cannot "
            "(see the hyper-cleaning loop below).",
            "",
        ]
    # 2. Unrolled reverse memory
    k100 = [r for r in rows if r.problem == "ksweep_K100"]
    if k100:
        ours = _find(rows, "ksweep_K100", "unrolled-reverse", "hypergrad")
        hig = _find(rows, "ksweep_K100", "unrolled-reverse", "higher")
        ck = _find(rows, "ksweep_K100", "unrolled-checkpoint", "hypergrad")
        fw = _find(rows, "ksweep_K100", "unrolled-forward", "hypergrad")
        st = _find(rows, "ksweep_K100", "unrolled-stored", "hypergrad")
        al = _find(rows, "ksweep_K100", "unrolled-all", "hypergrad")
        if ours and hig and ours.peak_mb and hig.peak_mb:
            line = (
                "**Unrolled reverse memory vs higher.** hypergrad, higher and torchopt's MetaSGD record the "
                "same autograd graph for the K steps (every step's parameters, activations and "
                "double-backward buffers). hypergrad's default (`recompute=True`) then replaces saved "
                "tensors it can recompute cheaply and bitwise equal (tanh/sigmoid backward outputs, matrix "
                "products summed over <= 16 terms) with references to the ops that produced them. The "
                "first step finds them under saved-tensor hooks and records where they sit in its graph; "
                "the other steps run without hooks and replace just those tensors "
                "(`SavedTensor.register_hooks`), each at a cost of about 15-30 us of Python per step, so "
                "by default only tensors that free at least 48 KiB per save are replaced "
                "(`recompute_min_bytes`; here the 256 x 64 matrix product into the last hidden layer, "
                "saved once, and not the tanh backward output of the same size, saved twice): "
                f"{ours.peak_mb:.1f} MB vs higher's {hig.peak_mb:.1f} MB at K = 100 "
                f"({ours.peak_mb / hig.peak_mb:.2f}x) at {ours.time_s / hig.time_s:.2f}x its time")
            if al and al.peak_mb:
                line += (f"; `recompute_min_bytes=0` replaces both: {al.peak_mb:.1f} MB "
                         f"({al.peak_mb / hig.peak_mb:.2f}x) at {al.time_s / hig.time_s:.2f}x")
            if st and st.peak_mb:
                line += (f"; `recompute=False` keeps every saved tensor: {st.peak_mb:.1f} MB "
                         f"({st.peak_mb / hig.peak_mb:.2f}x) at {st.time_s / hig.time_s:.2f}x")
            line += (". Keeping only the iterates takes more recomputation: `Unrolled(checkpoint=True)` "
                     "rebuilds one step's graph at a time in the backward sweep")
            if ck and ck.peak_mb:
                line += (f": {ck.peak_mb:.1f} MB ({ck.peak_mb / hig.peak_mb:.2f}x higher's) but "
                         f"{ck.time_s / hig.time_s:.2f}x its time, one extra inner gradient per step")
            if fw and fw.peak_mb:
                line += (f". For a few hyperparameters forward mode needs neither: {fw.peak_mb:.1f} MB at "
                         f"{fw.time_s / hig.time_s:.2f}x higher's time at K = 100")
            both = [r for r in (ours, al, st, ck) if r and r.peak_mb
                    and r.peak_mb <= 0.8 * hig.peak_mb and r.time_s <= hig.time_s]
            out += [line + (". No reverse-mode variant meets both halves of the target (memory <= 0.8x, "
                            "time <= 1.0x) at once." if not both else
                            f". {' and '.join(r.name for r in both)} {'meets' if len(both) == 1 else 'meet'} "
                            "both halves of the target."), ""]
    # 2b. Implicit CG against jaxopt under jit, and the compiled path
    parts = []
    for p in dict.fromkeys(r.problem for r in rows):
        a = _find(rows, p, "implicit-cg", "hypergrad")
        j = _find(rows, p, "implicit-cg", "jaxopt")
        h = _find(rows, p, "unit-hvp", "(unit)")
        c = _find(rows, p, "implicit-cg-compiled", "hypergrad")
        if a and j and h and a.iterations:
            hvp_ms = a.iterations * h.time_s * 1e3
            part = (f"{p}: ours {a.time_s * 1e3:.3g} ms, of which {a.iterations} products x "
                    f"{h.time_s * 1e6:.0f} us = {hvp_ms:.3g} ms, vs jaxopt {j.time_s * 1e3:.3g} ms "
                    f"({a.time_s / j.time_s:.2f}x)")
            if c:
                part += f"; compile=True {c.time_s * 1e3:.3g} ms ({c.time_s / a.time_s:.2f}x eager)"
            parts.append(part)
    if parts:
        out += [
            "**Implicit CG vs jaxopt (jit).** Same iterations to the same residual (agreement ~1e-15). "
            "XLA compiles the whole hypergradient (both gradients, the CG loop, the mixed product) into "
            "one executable; eager PyTorch pays the autograd engine per product (one backward pass "
            "through the retained graph of the inner gradient: about 10 autograd nodes, 5-10 us of "
            "engine overhead each; profiled with torch.profiler during development on logistic d = 100: 75 us per product, "
            "1.2 of 2.3 ms per hypergradient; the rest is the outer gradient, the inner gradient with its "
            "graph and the mixed product). Measured: " + "; ".join(parts) + ". `Implicit(compile=True)` "
            "(`hypergrad.compiled`) traces the outer gradients, the inner gradient, the product and the "
            "mixed product once with torch.compile, splits the ATen graph into the part that does not "
            "depend on the product vector (run once per hypergradient) and the product (run per CG "
            "iteration, fused with the CG update), and compiles each part with inductor, keeping the "
            "BLAS calls for the matrix products. It removes the engine overhead and is faster than "
            "eager on every problem here (compile=True / eager rows), but not enough for the jaxopt "
            "targets. Profiled with torch.profiler on logistic d = 100 (quiet machine): each compiled "
            "CG step costs about 33 us, two BLAS matrix-vector calls through ATen of about 8 us each "
            "and 17 us of inductor wrapper and fused kernels, and dynamo's guard check plus the one-off "
            "part cost about 0.3 ms per call, while jaxopt's whole hypergradient takes 0.15-0.65 ms "
            "(10-43 us per CG iteration; quiet machine to interleaved rounds). At d >= 1000 the two matrix-vector products per iteration are "
            "memory-bound and take as long in MKL as in XLA (133-150 us each for the 500 x 1000 float64 "
            "matrix, against about 280 us for jaxopt's whole iteration), so the remaining gap is about "
            "50 us of wrapper and kernels per iteration and the one-off part (two gradients, about 1 ms). "
            "It is not the default: the first compilation in a process takes 17-44 s with an empty "
            "inductor cache (5-8 s with a warm one, 1-6 s for later problems in the same process; the "
            "compile column is the latter), which a call saves back only after hundreds "
            "to thousands of outer steps.",
            "",
        ]
    # 3. FD and Penalty
    pen = [r for r in rows if r.family == "penalty"]
    adv = [r for r in rows if r.family == "penalty-advanced"]
    if pen:
        worst = max(pen, key=lambda r: r.geq)
        line = (
            "**Penalty (F2SA) gradient-equivalents.** The default `evaluate=\"current\"` takes the "
            "estimate from the backward passes that step the iterates (g at w, g + sigma f at w_sigma, "
            "w- and lambda-gradients from the same pass): 2T = 2 evaluations at `inner_steps=1`, about "
            f"2 + c_f inner gradients, c_f = cost(f) / cost(g) - measured {statistics.median(r.geq for r in pen):.1f} "
            f"(median), worst {worst.geq:.1f} on {worst.problem}")
        if worst.problem == "ridge_feature_d1000":
            line += (" (3.25 there when timed in rounds with the unit gradient only, measured during "
                     "development: the other runners' data, 8 MB design matrices and jaxopt's copies of "
                     "them, evict X and Xv from the caches between the calls)")
        if adv:
            line += (". `evaluate=\"advanced\"` (Algorithm 1 of Kwon et al. as written) evaluates both "
                     "losses once more at the advanced iterates, 2T + 2 = 4 evaluations, about 2 + 2(1 + c_f) - "
                     f"measured {statistics.median(r.geq for r in adv):.1f} (median); at the steady state used "
                     "here both variants return the same estimate (same error column)")
        out += [line + ".", ""]
    if pen:
        out += [
            "**FiniteDifference.** With `solver=\"identity\"` (DARTS) it costs three gradients and meets "
            "the target; with a linear solve it costs 3 + 2 x (solver iterations) gradients by "
            "construction (two gradients per finite-difference HVP), like any solve-based estimator, "
            "so the 4-gradient target cannot apply to that configuration.",
            "",
        ]
    return out


def _fmt(x: float | None, spec: str = ".2f", none: str = "-") -> str:
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _fmt_time(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


_SERIES = {
    ("implicit-cg", "hypergrad"): "hypergrad Implicit CG",
    ("implicit-cg", "torchopt"): "torchopt custom_root + CG",
    ("implicit-neumann", "hypergrad"): "hypergrad Implicit Neumann",
    ("implicit-neumann", "torchopt"): "torchopt custom_root + Neumann",
    ("unrolled-reverse", "hypergrad"): "hypergrad Unrolled reverse",
    ("unrolled-reverse", "higher"): "higher innerloop_ctx",
    ("unrolled-reverse-metasgd", "torchopt"): "torchopt MetaSGD",
    ("unrolled-checkpoint", "hypergrad"): "hypergrad Unrolled reverse, checkpoint",
    ("unrolled-truncated", "hypergrad"): "hypergrad Unrolled truncated (k = K/10)",
    ("unrolled-forward", "hypergrad"): "hypergrad Unrolled forward",
    ("fd-cg", "hypergrad"): "hypergrad FiniteDifference (CG)",
    ("fd-identity", "hypergrad"): "hypergrad FiniteDifference (identity)",
    ("penalty", "hypergrad"): "hypergrad Penalty (F2SA)",
}


def _plot_pair(rows: list[Row], x_of: Callable[[Row], float], xlabel: str, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    style = {"hypergrad": "-o", "higher": "--s", "torchopt": ":^"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label in _SERIES.items():
        sel = sorted((r for r in rows if (r.family, r.library) == key), key=x_of)
        if not sel:
            continue
        xs = [x_of(r) for r in sel]
        fmt = style.get(key[1], "-")
        axes[0].plot(xs, [r.time_s * 1e3 for r in sel], fmt, label=label)
        mem = [(x, r.peak_mb) for x, r in zip(xs, sel, strict=True) if r.peak_mb is not None]
        if mem:
            axes[1].plot([m[0] for m in mem], [max(m[1], 1e-2) for m in mem], fmt, label=label)
    axes[0].set(xscale="log", yscale="log", xlabel=xlabel, ylabel="CPU time per hypergradient (ms)")
    axes[1].set(xscale="log", yscale="log", xlabel=xlabel, ylabel="peak RSS over baseline (MB)")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    axes[1].legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plots(result: dict[str, Any], out: Path) -> list[str]:
    rows: list[Row] = [r for r in result["rows"] if not r.family.startswith("unit")]
    files = []
    k_of = lambda r: int(r.problem.split("K")[-1])  # noqa: E731
    for prefix, fname, title, xlabel, x_of in (
        ("ksweep_K", "hypergrad_k_scaling.png",
         "Scaling in the unroll length K (MLP 64-64-64-10 on digits, scalar weight decay)",
         "unroll length K", k_of),
        ("mlp_w", "hypergrad_mlp_scaling.png",
         "Scaling in the parameter count (MLP on digits, K = 10 / 10 CG iterations)", "parameters",
         lambda r: r.extra.get("n_params", 1)),
        ("logistic_d", "hypergrad_logistic_scaling.png",
         "Scaling in d (logistic regression, per-feature L2, n = 500)", "features d",
         lambda r: int(re.sub(r"\D", "", r.problem))),
    ):
        sel = [r for r in rows if r.problem.startswith(prefix)]
        if sel:
            _plot_pair(sel, x_of, xlabel, title, out / fname)
            files.append(fname)
    return files


def render(result: dict[str, Any], out: Path | None) -> str:
    """The markdown report (written to ``out/hypergrad.md`` with the plots when ``out`` is set)."""
    rows: list[Row] = result["rows"]
    meta = result["meta"]
    sizes: Sizes = result["sizes"]
    lines = [
        "# hypergrad vs jaxopt, torchopt and higher",
        "",
        f"- Command: `{result.get('command', 'python benchmarks/hypergrad_bench.py')}` "
        f"({sizes.name} mode; wall time {result['elapsed_s'] / 60:.1f} min)",
        f"- Date: {meta['date']}",
        f"- Machine: {meta['cpu']}, {meta['cores']} cores; torch threads = {meta['threads']} for every "
        f"library (load average of the shared machine at the end: "
        f"{', '.join(f'{x:.1f}' for x in meta['load']) if meta['load'] else '?'})",
        f"- Versions: torch {meta['torch']}, torchopt {meta['torchopt']}, higher {meta['higher']}, "
        f"jax {meta.get('jax', '-')}, jaxopt {meta.get('jaxopt', '-')}, "
        f"hypergrad {meta['hypergrad']}, Python {meta['python']}",
        "- Timing: CPU time of the computation (with one torch thread every kernel and the autograd "
        "engine run on the calling thread, so on an idle machine this is the wall time; on a shared "
        "machine wall time would penalise long calls, which the scheduler preempts, more than short "
        "ones). The runners of one problem are interleaved (A B C ... with a rotating start) after a "
        "warm-up call; medians over the rounds (5, fewer for calls of several seconds).",
        "- Memory: peak RSS over a baseline taken after imports, data and a warm-up call (reset of the "
        "kernel's high-water mark, `/proc/self/clear_refs`), one fresh process per configuration, "
        "large allocations through mmap (`MALLOC_MMAP_THRESHOLD_`) so that freed tensors leave RSS"
        + (" - measured only for the K sweeps in this quick mode." if sizes.name != "full" else "."),
        "- Raw numbers (every row, sizes, machine): `hypergrad.json` next to this file.",
        "- *grad-eq*: time per hypergradient divided by the time of one inner gradient "
        "(`torch.autograd.grad` of g w.r.t. w) on the same problem, in the same interleaved rounds.",
        "- *error*: relative error ||est - ref|| / ||ref|| against the reference named in each section; "
        "unrolled methods estimate the gradient of the K-step objective, so their error includes the "
        "truncation bias rho^K. *agree*: relative difference of a peer to the same estimator of ours.",
        "",
        "## Targets",
        "",
        "| target | where | measured | limit | result | note |",
        "|---|---|---|---|---|---|",
    ]
    for t in targets(rows, sizes):
        res = {True: "pass", False: "**FAIL**", None: "n/a"}[t["pass"]]
        lines.append(f"| {t['target']} | {t['where']} | {_fmt(t['value'])} | {t['limit']:g} | {res} | {t['note']} |")
    lines += ["", "## Ratio table (ours / peer)", "",
              "| pair | problem | ours ms | peer ms | time ratio | ours MB | peer MB | memory ratio | ours error | peer error | agree |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in pair_ratios(rows):
        lines.append(
            f"| {p['pair']} | {p['problem']} | {p['ours_ms']:.3g} | {p['peer_ms']:.3g} | {_fmt(p['time_ratio'])} | "
            f"{_fmt(p['ours_mb'], '.1f')} | {_fmt(p['peer_mb'], '.1f')} | {_fmt(p['mem_ratio'])} | "
            f"{_fmt(p['ours_err'], '.1e')} | {_fmt(p['peer_err'], '.1e')} | {_fmt(p['agree'], '.0e')} |")
    sbs = side_by_side(rows)
    if sbs:
        lines += [
            "", "## Implicit CG side by side: jaxopt (jit), hypergrad, torchopt", "",
            "Same data, losses, inner solution `w*` and CG tolerance; jaxopt runs `custom_root` + "
            "`solve_cg` under `jax.jit` in float64 with one XLA thread (`XLA_FLAGS="
            "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1`), its CPU time "
            "taken over the whole process (XLA executes on its own thread); compile times are "
            "excluded from the medians and listed. The wall-time column is the same ratio from "
            "wall clocks: on a loaded shared machine it is dominated by preemption (a long eager call "
            "is interrupted more often than a short compiled one) and is shown only for transparency.",
            "", *sbs]
    lines += ["", "## Per problem", ""]
    titles = result.get("titles", {})
    for problem in dict.fromkeys(r.problem for r in rows):
        sel = [r for r in rows if r.problem == problem]
        lines += [f"### {titles.get(problem, problem)}", ""]
        if problem in result.get("ref_notes", {}):
            lines += [f"Reference: {result['ref_notes'][problem]}.", ""]
        lines += ["| method | library | CPU ms / hypergradient | grad-eq | iterations | peak MB | error | agree |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in sel:
            lines.append(
                f"| {r.name} | {r.library} | {_fmt_time(r.time_s)} | {r.geq:.1f} | {_fmt(r.iterations, 'd')} | "
                f"{_fmt(r.peak_mb, '.2f')} | {_fmt(r.error, '.1e')} | {_fmt(r.agree, '.0e')} |")
        lines.append("")
    if result.get("cleaning"):
        lines += ["## Data hyper-cleaning: outer loop and test accuracy", "",
                  f"Adam (lr 0.1) on the per-example logits for {sizes.clean_outer_steps} outer steps; "
                  f"implicit methods take {sizes.clean_inner_steps} warm-started inner SGD steps before each "
                  "hypergradient; the final weights are then used to retrain the classifier to convergence.",
                  "", "| method | library | s / outer step | total s | test accuracy | mean weight clean | mean weight corrupted | mean CG iterations |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in result["cleaning"]:
            lines.append(
                f"| {c['name']} | {c['library']} | {_fmt(c.get('per_step_s'), '.3f')} | {_fmt(c.get('total_s'), '.1f')} | "
                f"{c['test_acc']:.3f} | {_fmt(c.get('w_clean'), '.2f')} | {_fmt(c.get('w_corrupt'), '.2f')} | "
                f"{_fmt(c.get('cg_iters'), '.1f')} |")
        lines.append("")
    if result.get("precond"):
        lines += ["## CG preconditioning: iterations to the same relative residual", "",
                  f"`hg.linear.CG(tol={sizes.tol:g}, preconditioner=...)` at the benchmark's `w*`; the "
                  "Hutchinson estimate's probes are products too (counted in *products*); CPU time is "
                  "the best of 3 calls.", "",
                  "| problem | preconditioner | iterations | products | ms | error | converged |",
                  "|---|---|---|---|---|---|---|"]
        for c in result["precond"]:
            lines.append(f"| {c['problem']} | {c['variant']} | {c['iterations']} | {c['matvecs']} | "
                         f"{_fmt_time(c['time_s'])} | {_fmt(c['error'], '.1e')} | {c['converged']} |")
        lines.append("")
    lines += ["## What limits the targets", "", *notes(result), *result.get("notes", [])]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        raw = {
            "meta": meta, "command": result.get("command"), "elapsed_s": result["elapsed_s"],
            "sizes": asdict(sizes), "cleaning": result.get("cleaning"), "precond": result.get("precond"),
            "titles": result.get("titles", {}), "ref_notes": result.get("ref_notes", {}),
            "notes": result.get("notes", []), "rows": [asdict(r) for r in rows],
        }
        (out / "hypergrad.json").write_text(json.dumps(raw, indent=1, default=str))
        files = _plots(result, out)
        if files:
            lines += ["## Plots", ""] + [f"![{f}]({f})" for f in files] + [""]
        (out / "hypergrad.md").write_text("\n".join(lines))
    return "\n".join(lines)



def metadata(threads: int) -> dict[str, Any]:
    cpu = "unknown"
    with_path = Path("/proc/cpuinfo")
    if with_path.exists():
        match = re.search(r"model name\s*:\s*(.+)", with_path.read_text())
        cpu = match.group(1).strip() if match else cpu
    torchopt, _ = _peers()
    from importlib.metadata import PackageNotFoundError, version

    def _version(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"
    return {
        "date": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu, "cores": os.cpu_count(), "threads": threads,
        "torch": torch.__version__, "torchopt": torchopt.__version__, "higher": _version("higher"),
        "jax": _version("jax"), "jaxopt": _version("jaxopt"),
        "hypergrad": hg.__version__, "python": platform.python_version(),
        "load": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="about one minute; no files unless --out")
    parser.add_argument("--out", type=Path, default=None, help="write the report here")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, same for every library")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-configuration processes")
    parser.add_argument("--problems", default=None,
                        help="comma-separated problems to run: 1 ridge, 2 logistic, 3 hyper-cleaning, "
                             "4 MLP widths, 5 unroll-length sweep, 6 forward-mode memory in K; default all. "
                             "The report then covers only these (give --out to keep results/ intact)")
    parser.add_argument("--imaml", action="store_true",
                        help="only the batched iMAML comparison (writes hypergrad_imaml.md)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--render", type=Path, help=argparse.SUPPRESS)  # re-render a hypergrad.json
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        _worker(args.worker)
        return 0
    if args.render and args.imaml:  # re-render a hypergrad_imaml.json
        raw = json.loads(args.render.read_text())
        raw["sizes"] = IMAMLSizes(**raw["sizes"])
        render_imaml(raw, args.out if args.out is not None else args.render.parent, raw["command"])
        return 0
    if args.render:
        raw = json.loads(args.render.read_text())
        raw["sizes"] = Sizes(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw["sizes"].items()})
        raw["rows"] = [Row(**r) for r in raw["rows"]]
        raw["notes"] = CORE_CHANGES
        render(raw, args.out if args.out is not None else args.render.parent)
        return 0
    if args.imaml:
        isizes = IMAML_QUICK if args.quick else IMAML_FULL
        out = args.out if args.out is not None else (None if args.quick else RESULTS)
        command = "python benchmarks/hypergrad_bench.py --imaml" + (" --quick" if args.quick else "")
        result = imaml_suite(isizes, log=lambda m: print(m, flush=True))
        text = render_imaml(result, out, command)
        if out is not None:  # the raw numbers, for --imaml --render
            raw = {**result, "sizes": asdict(result["sizes"]), "command": command}
            (out / "hypergrad_imaml.json").write_text(json.dumps(raw, indent=1) + "\n")
        print(text if out is None else f"wrote {out / 'hypergrad_imaml.md'}")
        return 0
    sizes = QUICK if args.quick else FULL
    if args.no_memory:
        sizes = replace(sizes, memory=False)
    if args.problems:
        chosen = tuple(int(x) for x in args.problems.split(","))
        if not set(chosen) <= set(range(1, 7)):
            parser.error(f"--problems: numbers in 1-6, got {args.problems!r}")
        sizes = replace(sizes, problems=chosen)
    out = args.out if args.out is not None else (None if args.quick else RESULTS)
    command = "python benchmarks/hypergrad_bench.py" + (" --quick" if args.quick else "") + (
        f" --threads {args.threads}" if args.threads != 1 else "") + (
        f" --problems {args.problems}" if args.problems else "")
    print(f"hypergrad benchmark ({sizes.name}), torch {torch.__version__}, {args.threads} thread(s)")
    result = suite(sizes, threads=args.threads, log=lambda m: print(m, flush=True))
    result["command"] = command
    result["notes"] = CORE_CHANGES
    text = render(result, out)
    if out is None:
        print(text)
    else:
        print(f"wrote {out / 'hypergrad.md'}")
    print(f"total {result['elapsed_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
