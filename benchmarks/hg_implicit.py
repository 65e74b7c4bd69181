#!/usr/bin/env python
"""Implicit differentiation against torchopt and jaxopt: CG, Dense, Neumann, ``compile=True``.

The runners of the ``implicit-*`` groups (hypergrad's ``Implicit`` with CG, Dense, Neumann and
``compile=True``; torchopt's ``custom_root`` with ``solve_cg`` / ``solve_inv``; jaxopt's
``custom_root`` + ``solve_cg`` under ``jax.jit``), and two experiments run after a problem's timings:
CG preconditioning (iterations to the same residual) and the data hyper-cleaning outer loop (test
accuracy; every family's method, the unrolled and first-order ones included).

Alone, on the problems these runners serve (the report covers only them; printed unless ``--out``)::

    .venv/bin/python benchmarks/hg_implicit.py --quick
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from harness import hypergrad_cli
from harness.hypergrad_problems import Bench, Sizes, Tree, flat, fresh_leaves, minimize, rel_err
from harness.hypergrad_suite import (
    Add,
    Runner,
    Want,
    cg_settings,
    cpu_timer,
    jax_module,
    loaded_copy,
    ours,
    peers,
)
from torch import Tensor
from torch.func import functional_call

import hypergrad as hg

GROUPS = ("implicit-cg", "implicit-cg-compiled", "implicit-dense", "implicit-neumann")


# ------------------------------------------------------------------------------ runners


def _compiled_ours(b: Bench, tol: float, maxiter: int) -> Runner:
    """``Implicit(compile=True)``: the first call (compilation) is timed separately."""
    method = hg.Implicit(hg.linear.CG(tol=tol, maxiter=maxiter, damping=b.damping), compile=True)
    t0 = time.perf_counter()
    first = method.hypergrad(b.problem, b.w, b.lam)
    compile_s = time.perf_counter() - t0
    runner = ours(b, method, "Implicit CG, compile=True", "implicit-cg-compiled")
    runner.info.update(compile_s=compile_s, compiled=bool(first.info.extra.get("compiled")))
    return runner


def _torchopt_implicit(b: Bench, solve: Any, name: str, family: str) -> Runner:
    torchopt, _ = peers()
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
        lam_ = fresh_leaves(b.lam)
        w_opt = solver(w_init, *lam_.values())
        value = b.f(dict(zip(wk, w_opt, strict=True)), lam_)
        return flat(torch.autograd.grad(value, list(lam_.values())))

    return Runner(name, "torchopt", family, fn)


def _jaxopt_implicit(b: Bench, tol: float, maxiter: int) -> Runner | None:
    """jaxopt's ``custom_root`` + ``solve_cg`` under ``jax.jit`` on the same data, losses and w*.

    Ridge and logistic regression only (the losses are re-written in jax.numpy; the model is
    ``X @ w``). The first call (tracing and XLA compilation) is timed separately and reported;
    the timed calls reuse the compiled executable.
    """
    jax = jax_module()
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


def _bare_cg_floor(b: Bench, tol: float, maxiter: int) -> Runner:
    """The parts of ``Implicit(CG)`` in a bare loop: the floor for an implementation on autograd's
    reverse-over-reverse products.

    Per call: the outer gradients (``torch.autograd.grad``), the inner gradient with a graph and
    every Hessian-vector and mixed product from :class:`hypergrad.autodiff.RootSystem` (one
    backward pass each), and plain CG on flat vectors (x0 = 0, the same iteration and stopping
    test as ``hg.linear.CG``) with nothing else: no input checks, no trees, no report. What
    ``Implicit(CG)`` spends beyond this row is its own overhead; what this row spends is the
    products themselves, which any library built on autograd pays.
    """
    from hypergrad.autodiff import RootSystem

    problem, w_keys = b.problem, list(b.w)
    shapes = [b.w[k].shape for k in w_keys]
    numels = [b.w[k].numel() for k in w_keys]
    info: dict[str, Any] = {}

    def fn() -> Tensor:
        w_, lam_ = fresh_leaves(b.w), fresh_leaves(b.lam)
        leaves = [*w_.values(), *lam_.values()]
        grads = torch.autograd.grad(b.f(w_, lam_), leaves, allow_unused=True, materialize_grads=True)
        rhs = torch.cat([g.reshape(-1) for g in grads[: len(w_keys)]])
        root = RootSystem(problem, b.w, b.lam, None)
        x, r = torch.zeros_like(rhs), rhs.clone()
        p = r.clone()
        threshold2 = (tol * float(torch.linalg.vector_norm(rhs))) ** 2
        rs, iterations = float(torch.dot(r, r)), 0
        while rs > threshold2 and iterations < maxiter:
            ap = root.rmatvec_flat(p)
            if b.damping:
                ap = ap.add(p, alpha=b.damping)
            alpha = rs / float(torch.dot(p, ap))
            x.add_(p, alpha=alpha)
            r.add_(ap, alpha=-alpha)
            rs_new = float(torch.dot(r, r))
            iterations += 1
            p = torch.add(r, p, alpha=rs_new / rs)
            rs = rs_new
        u = {k: part.view(shape) for k, part, shape in zip(w_keys, x.split(numels), shapes, strict=True)}
        mixed = root.rmatvec_lam(u)
        info["iterations"] = iterations
        return torch.cat([(g - mixed[k]).reshape(-1) for k, g in zip(b.lam, grads[len(w_keys):], strict=True)])

    return Runner("Implicit CG's products in a bare CG loop (floor)", "hypergrad", "implicit-cg-floor", fn, info)


def _neumann_steps(b: Bench, tol: float, cap: int) -> int:
    probe = hg.Implicit(hg.linear.Neumann(alpha=b.alpha, steps=cap, tol=tol))
    return int(probe.hypergrad(b.problem, b.w, b.lam).info.iterations)


def add_runners(b: Bench, sizes: Sizes, K: int, want: Want, add: Add) -> None:
    """The wanted ``implicit-*`` runners (see ``harness.hypergrad_suite.make_runners``)."""
    torchopt, _ = peers()
    tol = sizes.tol
    cg_tol, cg_maxiter = cg_settings(b, sizes)
    if want("implicit-cg"):
        add("implicit-cg",
            ours(b, hg.Implicit(hg.linear.CG(tol=cg_tol, maxiter=cg_maxiter, damping=b.damping)),
                 "Implicit CG", "implicit-cg"),
            _torchopt_implicit(
                b, torchopt.linear_solve.solve_cg(rtol=cg_tol, maxiter=cg_maxiter, ridge=b.damping or None),
                "custom_root + solve_cg", "implicit-cg"))
        add("implicit-cg", _bare_cg_floor(b, cg_tol, cg_maxiter))
        jx = _jaxopt_implicit(b, cg_tol, cg_maxiter)
        if jx is not None:
            add("implicit-cg", jx)
    if want("implicit-cg-compiled") and b.n_params <= sizes.compiled_max_d:
        add("implicit-cg-compiled", _compiled_ours(b, cg_tol, cg_maxiter))
    if want("implicit-dense") and b.kind in ("ridge", "logistic") and b.n_params <= sizes.dense_max_d:
        # the Hessian from one batched backward, then Cholesky (benchmarks/implicit_dense.py)
        add("implicit-dense", ours(b, hg.Implicit(hg.linear.Dense()), "Implicit Dense", "implicit-dense"))
    if want("implicit-neumann"):
        steps = b.extra.get("neumann_steps") or _neumann_steps(b, tol, sizes.neumann_cap)
        b.extra["neumann_steps"] = steps
        add("implicit-neumann",
            ours(b, hg.Implicit(hg.linear.Neumann(alpha=b.alpha, steps=steps, tol=0.0)),
                 f"Implicit Neumann ({steps} terms)", "implicit-neumann"),
            _torchopt_implicit(b, torchopt.linear_solve.solve_inv(ns=True, maxiter=steps, alpha=b.alpha),
                               f"custom_root + solve_inv(ns=True, {steps} terms)", "implicit-neumann"))


# ---------------------------------------------------------------------- preconditioning


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


# ----------------------------------------------------------------------- hyper-cleaning


def _accuracy(b: Bench, w: Tree) -> float:
    with torch.no_grad():
        pred = functional_call(b.model, w, (b.data["Xt"],)).argmax(1)
    return float((pred == b.data["yt"]).double().mean())


def _retrain(b: Bench, lam: Tree, w0: Tree | None = None) -> Tree:
    return minimize(lambda w: b.g(w, lam), b.w if w0 is None else w0, max_iter=200, tol=1e-6)


def hyper_cleaning(b: Bench, sizes: Sizes, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """A short outer loop per method (Adam on the per-example logits), then test accuracy."""
    torchopt, higher = peers()
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
        model = loaded_copy(b.model, w, True)
        opt = torch.optim.SGD(model.parameters(), lr=b.lr)
        lam_ = fresh_leaves(lam)
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
    if b.n_params > sizes.compiled_max_d:  # the same size cap as the single-hypergradient compiled rows
        methods = [m for m in methods if m[2] is not implicit_compiled]
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


def after_problem(b: Bench, sizes: Sizes, log: Callable[[str], None]) -> dict[str, list[dict[str, Any]]]:
    """Preconditioning on the per-feature ridge, logistic and hyper-cleaning problems, then (on
    hyper-cleaning) the outer loop."""
    out: dict[str, list[dict[str, Any]]] = {}
    if b.kind in ("ridge", "logistic", "clean") and not b.extra.get("scalar"):
        out["precond"] = preconditioning(b, sizes)
    if b.kind == "clean":
        out["cleaning"] = hyper_cleaning(b, sizes, log)
    return out


def main(argv: list[str] | None = None) -> int:
    return hypergrad_cli.concern_main(argv, sys.modules[__name__], "hg_implicit.py")


if __name__ == "__main__":
    sys.exit(main())
