"""The problems of the hypergrad benchmarks: sizes, construction, reference hypergradients.

:class:`Sizes` (``FULL``, ``QUICK``, ``TINY``) holds every problem size and repetition count of a
mode; :func:`build_bench` builds one problem from its spec: ridge and logistic regression,
hyper-cleaning on digits, MLPs, each with its inner solution (LBFGS, cached on disk), the inner
step size, Penalty's second iterate and a reference hypergradient independent of hypergrad
(closed form or the implicit-function-theorem formula with an explicit solve).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

import hypergrad as hg

Tree = dict[str, Tensor]

# -------------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class Sizes:
    """Problem sizes and repetition counts of one benchmark mode."""

    name: str
    ridge_n: int = 1000
    ridge_d: int = 200
    logistic_n: int = 500
    logistic_ds: tuple[int, ...] = (100, 1000, 2000, 10000)
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
