"""The shared harness of the hypergrad benchmarks (``hypergrad_bench.py`` and its parts).

What every part uses, in one place:

- the problem sizes of each mode (:class:`Sizes`, ``FULL``, ``QUICK``, ``TINY``);
- problem construction (:class:`Bench`, :func:`build_bench`): ridge, logistic regression,
  hyper-cleaning on digits and MLPs, each with its inner solution and a reference hypergradient;
- :class:`Runner` (one method on one problem), the peers' lazy imports (:func:`peers`,
  :func:`jax_module`) and :func:`make_runners`, which asks each concern module for its runners;
- interleaved CPU timing (:func:`time_interleaved`) and memory measurement in fresh processes
  (:func:`measure_memory`);
- :class:`Row`, :func:`run_problem` and :func:`suite`: the six numbered problems, each timed with
  the runners of the concerns given;
- :func:`metadata` and :func:`fmt_value` for the reports.

A *concern* is a module (``hg_implicit``, ``hg_unrolled``, ``hg_first_order``) with ``GROUPS``,
the ``make_runners`` selectors it serves, ``add_runners(b, sizes, K, want, add)``, which adds the
runners of the wanted groups, and ``after_problem(b, sizes, log)``, which runs its per-problem
experiments (preconditioning, the hyper-cleaning loop) and returns their result lists by key
(:func:`no_experiments` where there are none). The suite times every runner of one problem
interleaved, whichever concern it comes from; the entry ``hypergrad_bench.py`` passes them all.
"""

from __future__ import annotations

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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.func import functional_call

import hypergrad as hg
from llm_calib.profiling import Phase, measurement_env

warnings.filterwarnings("ignore", category=FutureWarning)  # torchopt's functorch deprecations
warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", category=UserWarning, module="higher")
warnings.filterwarnings("ignore", category=hg.ConvergenceWarning)  # reported in the tables

Tree = dict[str, Tensor]
RESULTS = Path(__file__).resolve().parent / "results"
MB = 1024.0 * 1024.0


# -------------------------------------------------------------------------------- sizes


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
    """The leaves of ``t``, detached, as one flat vector."""
    values = t.values() if isinstance(t, dict) else t
    return torch.cat([v.detach().reshape(-1) for v in values])


def rel_err(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float(torch.linalg.vector_norm(a - b) / torch.clamp(torch.linalg.vector_norm(b), min=1e-300))


def fresh_leaves(t: Tree) -> Tree:
    """Detached copies of ``t``'s tensors that require grad (new leaves of a graph)."""
    return {k: v.detach().clone().requires_grad_(True) for k, v in t.items()}


# ----------------------------------------------------------------------------- problems


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


def minimize(loss: Callable[[Tree], Tensor], w0: Tree, max_iter: int = 500, tol: float = 1e-10) -> Tree:
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
        b.w = minimize(lambda w: b.g(w, lam), w0, max_iter=spec.get("inner_iters", 200), tol=1e-7)
    elif kind == "ridge":  # the exact minimiser: the reference below is then the closed form
        X, n = b.data["X"], b.data["X"].shape[0]
        H = X.T @ X / n + torch.diag(torch.exp(lam["log_l2"]).expand(X.shape[1]))
        b.w = {"weight": torch.linalg.solve(H, X.T @ b.data["y"] / n).reshape(1, -1)}
    else:  # logistic: to 1e-10; hyper-cleaning (ill-conditioned, kappa ~ 1e3): to 1e-8
        b.w = minimize(lambda w: b.g(w, lam), w0, max_iter=spec.get("inner_iters", 500),
                       tol=1e-10 if kind == "logistic" else 1e-8)
    L = _lipschitz(b)
    b.lr = 1.0 / L
    b.alpha = 1.0 / (L + b.damping)
    b.sigma = spec.get("sigma", 1e-3)
    b.w_sigma = minimize(lambda w: b.g(w, lam) + b.sigma * b.f(w, lam), b.w,
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


# ------------------------------------------------------------------------------ runners


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


def peers() -> tuple[Any, Any]:
    """torchopt and higher, imported on first use (their import warnings silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import higher
        import torchopt
    return torchopt, higher

_JAX: dict[str, Any] = {}


def jax_module() -> Any | None:
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


def ours(b: Bench, method: Any, name: str, family: str, state: dict | None = None) -> Runner:
    """hypergrad's ``method`` on ``b`` as a runner (its iterations and gradient evaluations in ``info``)."""
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


def loaded_copy(model: nn.Module, w: Tree, requires_grad: bool) -> nn.Module:
    """A deep copy of ``model`` holding the parameters ``w`` (for higher and MetaSGD)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for k, p in m.named_parameters():
            p.copy_(w[k])
            p.requires_grad_(requires_grad)
    return m


def _grad_unit(b: Bench) -> Runner:
    w_ = fresh_leaves(b.w)
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


def cg_settings(b: Bench, sizes: Sizes) -> tuple[float, int]:
    """The CG tolerance and iteration cap of the solve-based runners on ``b``: ``sizes.tol`` and 2000
    iterations, or exactly ``b.extra["maxiter"]`` iterations where the spec fixes them."""
    maxiter = b.extra.get("maxiter")  # fixed CG iterations (MLP: non-convex, no tolerance target)
    cg_tol = 0.0 if maxiter else sizes.tol
    cg_maxiter = maxiter or 2000
    return cg_tol, cg_maxiter


Want = Callable[[str], bool]
Add = Callable[..., None]


class Concern(Protocol):
    """A concern module (``hg_implicit``, ``hg_unrolled``, ``hg_first_order``), see the module doc."""

    GROUPS: tuple[str, ...]

    def add_runners(self, b: Bench, sizes: Sizes, K: int, want: Want, add: Add) -> None: ...

    def after_problem(self, b: Bench, sizes: Sizes, log: Callable[[str], None]) -> dict[str, list]: ...


def no_experiments(b: Bench, sizes: Sizes, log: Callable[[str], None]) -> dict[str, list]:
    """``after_problem`` of a concern with no experiment beyond the timings."""
    return {}


def make_runners(b: Bench, sizes: Sizes, concerns: tuple[Concern, ...], which: list[str] | None = None,
                 K: int | None = None) -> list[Runner]:
    """All runners of the ``concerns`` for a problem, in their order, after the unit runners
    (``which`` restricts to the named groups)."""
    peers()
    K = K if K is not None else b.extra.get("K", sizes.unroll_k)
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
    for concern in concerns:
        concern.add_runners(b, sizes, K, want, add)
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

# The memory worker: the entry script, whose hidden ``--worker`` flag calls :func:`worker` with
# every concern, so any part's configurations can be measured from any script.
WORKER_SCRIPT = Path(__file__).resolve().parent / "hypergrad_bench.py"


def _dry_run(concerns: tuple[Concern, ...]) -> None:
    """Trigger every lazy import and first-call initialisation (torch.func, torchopt, higher)."""
    spec = {"key": "dry", "kind": "ridge", "n": 20, "d": 4, "scalar": True, "K": 2}
    b = build_bench(spec)
    for r in make_runners(b, replace(TINY, neumann_cap=5), concerns, K=2):
        r.fn()


def _measure_one(config: dict[str, Any], concerns: tuple[Concern, ...]) -> dict[str, Any]:
    """Inside a fresh process: build, warm up, reset the peak-RSS counter, run once."""
    torch.set_num_threads(config["threads"])
    sizes = MODES[config["mode"]]
    t_build = time.perf_counter()
    b = build_bench(config["spec"], Path(config["cache"]))
    b.extra.update(config.get("extra", {}))
    runners = make_runners(b, sizes, concerns, [config["group"]], K=config.get("K"))
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


def worker(config_path: str, concerns: tuple[Concern, ...]) -> None:
    """Hidden ``--worker`` entry: one forked child per configuration, JSON lines on stdout
    (``concerns``: those whose runner groups the configurations name)."""
    configs = json.loads(Path(config_path).read_text())
    _JAX["mod"] = None  # no jax in the memory worker: it forks, and jax is multithreaded
    peers()  # import once in the parent; children start from this import-only state
    import sklearn.datasets  # noqa: F401

    _dry_run(concerns)
    gc.collect()
    for config in configs:
        if hasattr(os, "fork"):
            rfd, wfd = os.pipe()
            pid = os.fork()
            if pid == 0:  # child
                os.close(rfd)
                try:
                    out = _measure_one(config, concerns)
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
            out = _measure_one(config, concerns)
        print(json.dumps({"id": config["id"], **out}), flush=True)


def measure_memory(configs: list[dict[str, Any]], threads: int, log: Callable[[str], None]) -> dict[str, dict]:
    """Run the configurations in a worker subprocess (``WORKER_SCRIPT --worker``, forking a fresh
    child for each)."""
    if not configs:
        return {}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(configs, fh)
        path = fh.name
    env = measurement_env(threads)  # large allocations through mmap, returned on free: RSS tracks live tensors
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(WORKER_SCRIPT), "--worker", path, "--threads", str(threads)],
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


# ---------------------------------------------------------------------------- the suite


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


def suite(sizes: Sizes, concerns: tuple[Concern, ...], threads: int = 1, log: Callable[[str], None] = print,
          cache: Path | None = None) -> dict[str, Any]:
    """Run every problem with the runners of ``concerns`` (a problem none of them serves is left
    out); return rows, the concerns' per-problem results (``after_problem``) and metadata."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _suite(sizes, concerns, threads, log, cache)
    finally:
        torch.set_num_threads(threads_before)


def _suite(sizes: Sizes, concerns: tuple[Concern, ...], threads: int, log: Callable[[str], None],
           cache: Path | None) -> dict[str, Any]:
    own_cache = cache is None
    if own_cache:
        cache = Path(tempfile.mkdtemp(prefix="hgbench-"))
    memory = sizes.memory
    t_start = time.perf_counter()
    rows: list[Row] = []
    extras: dict[str, list[dict[str, Any]]] = {}  # the concerns' per-problem results, by key
    all_families = None
    served = {group for concern in concerns for group in concern.GROUPS}  # units alone compare nothing

    def run(n: int) -> bool:
        return sizes.problems is None or n in sizes.problems

    def serves(fams: list[str] | None) -> bool:
        """A concern serves one of ``fams`` (``None``: every family)."""
        return bool(served) if fams is None else bool(served & set(fams))

    def after(b: Bench) -> None:
        for concern in concerns:
            for key, items in concern.after_problem(b, sizes, log).items():
                extras.setdefault(key, []).extend(items)

    # 1. ridge
    for scalar in ((True, False) if run(1) and serves(all_families) else ()):
        spec = {"key": f"ridge_{'scalar' if scalar else 'feature'}", "kind": "ridge", "n": sizes.ridge_n,
                "d": sizes.ridge_d, "scalar": scalar, "K": sizes.unroll_k}
        b = _spec_bench(spec, cache)
        rows += run_problem(b, sizes, make_runners(b, sizes, concerns, all_families), cache, threads, log,
                            memory)
        after(b)

    # 1b. per-feature ridge at a larger d: the implicit runners only (jaxopt's comparison)
    fams = ["unit", "unit-hvp", "implicit-cg", "implicit-cg-compiled", "implicit-dense", "penalty"]
    for d in (sizes.ridge_large_d if run(1) and serves(fams) else ()):
        spec = {"key": f"ridge_feature_d{d}", "kind": "ridge", "n": sizes.ridge_n, "d": d,
                "scalar": False, "K": sizes.unroll_k}
        b = _spec_bench(spec, cache)
        rows += run_problem(b, sizes, make_runners(b, sizes, concerns, fams), cache, threads, log, memory)
        after(b)

    # 2. logistic, d sweep
    for d in (sizes.logistic_ds if run(2) else ()):
        fams = ["unit", "unit-hvp", "implicit-cg", "implicit-cg-compiled", "implicit-dense", "implicit-neumann",
                "fd", "penalty"]
        if d <= sizes.logistic_unrolled_max_d:
            fams += ["unrolled-reverse", "unrolled-truncated"]
        if not serves(fams):
            continue
        spec = {"key": f"logistic_d{d}", "kind": "logistic", "n": sizes.logistic_n, "d": d,
                "scalar": False, "K": sizes.unroll_k}
        b = _spec_bench(spec, cache)
        rows += run_problem(b, sizes, make_runners(b, sizes, concerns, fams), cache, threads, log, memory)
        after(b)

    # 3. hyper-cleaning: single hypergradients, then the outer loop (hg_implicit's after_problem)
    if run(3) and serves(all_families):
        spec = {"key": "clean", "kind": "clean", "n_train": sizes.clean_train, "K": sizes.clean_unroll_k,
                "sigma": 1e-2, "inner_iters": sizes.lbfgs_iters}
        b_clean = _spec_bench(spec, cache)
        rows += run_problem(b_clean, sizes, make_runners(b_clean, sizes, concerns, all_families), cache,
                            threads, log, memory)
        after(b_clean)

    # 4. MLP: scaling in the parameter count
    fams = ["unit", "unit-hvp", "implicit-cg", "implicit-cg-compiled", "unrolled-reverse", "unrolled-stored",
            "unrolled-all",
            "unrolled-checkpoint", "unrolled-forward", "fd", "penalty"]
    for width in (sizes.mlp_widths if run(4) and serves(fams) else ()):
        spec = {"key": f"mlp_w{width}", "kind": "mlp", "width": width, "batch": sizes.mlp_batch,
                "K": sizes.mlp_k, "maxiter": 10, "sigma": 1e-2,
                "inner_iters": 100 if width >= 512 else min(200, sizes.lbfgs_iters)}
        b = _spec_bench(spec, cache)
        rows += run_problem(b, sizes, make_runners(b, sizes, concerns, fams), cache, threads, log, memory)
        after(b)

    # 5. unroll length sweep on a small MLP
    fams = ["unit", "unrolled-reverse", "unrolled-stored", "unrolled-all", "unrolled-checkpoint",
            "unrolled-truncated", "unrolled-forward"]
    for K in (sizes.ks if run(5) and serves(fams) else ()):
        spec = {"key": f"mlp_w{sizes.ksweep_width}", "label": f"ksweep_K{K}", "kind": "mlp",
                "width": sizes.ksweep_width, "batch": sizes.mlp_batch, "K": K, "maxiter": 10,
                "sigma": 1e-2, "inner_iters": min(200, sizes.lbfgs_iters)}
        b = _spec_bench(spec, cache)
        rows += run_problem(b, sizes, make_runners(b, sizes, concerns, fams), cache, threads, log, memory)
        after(b)

    # 6. forward-mode memory against K on a larger MLP (a working set well above the ~0.3 MB the
    #    Python interpreter's free lists and heap add to any long loop)
    width = sizes.mlp_widths[min(1, len(sizes.mlp_widths) - 1)]
    fams = ["unit", "unrolled-forward"]
    for K in (sizes.flat_ks if run(6) and serves(fams) else ()):
        spec = {"key": f"mlp_w{width}", "label": f"fwdflat_K{K}", "kind": "mlp", "width": width,
                "batch": sizes.mlp_batch, "K": K, "maxiter": 10, "sigma": 1e-2,
                "inner_iters": 100 if width >= 512 else min(200, sizes.lbfgs_iters)}
        b = _spec_bench(spec, cache)
        rows += run_problem(b, sizes, make_runners(b, sizes, concerns, fams), cache, threads, log, memory)
        after(b)

    if memory:
        fill_memory(rows, threads, log)
    if own_cache:
        shutil.rmtree(cache, ignore_errors=True)
    elapsed = time.perf_counter() - t_start
    return {"rows": rows, **extras, "elapsed_s": elapsed, "threads": threads,
            "sizes": sizes, "meta": metadata(threads), "titles": dict(_TITLES),
            "ref_notes": dict(_REF_NOTES)}


# ----------------------------------------------------------------------- report helpers


def fmt_value(x: float | None, spec: str = ".2f", none: str = "-") -> str:
    """``x`` formatted with ``spec``; ``none`` for None or NaN."""
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def metadata(threads: int) -> dict[str, Any]:
    """Date, machine, load and library versions for a report header."""
    cpu = "unknown"
    with_path = Path("/proc/cpuinfo")
    if with_path.exists():
        match = re.search(r"model name\s*:\s*(.+)", with_path.read_text())
        cpu = match.group(1).strip() if match else cpu
    torchopt, _ = peers()
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
