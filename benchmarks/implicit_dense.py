#!/usr/bin/env python
"""Implicit with a dense solve (Hessian materialised in one batched call) against Implicit CG.

Question: at small inner dimension d, is it faster to build the Hessian in ONE batched call and
solve it by Cholesky (``hypergrad.linear.Dense``) than to run CG with one eager Hessian-vector
product per iteration? If so, the default linear solver of ``Implicit`` could pick it below a
measured crossover.

Usage (from the repository root, after ``make setup``; ``make setup-bench`` adds the jaxopt rows)::

    .venv/bin/python benchmarks/implicit_dense.py            # writes benchmarks/results/implicit_dense.md
    .venv/bin/python benchmarks/implicit_dense.py --quick    # prints only

Same problems, data and inner solutions as ``benchmarks/hypergrad_bench.py`` (its problems 1-2:
ridge with per-feature lambda, n = 1000; logistic with per-feature L2, n = 500), float64, one torch
thread, runners interleaved in one process (``hypergrad_bench.time_interleaved``), CPU-time medians.
A second table times the ways of materialising the d x d Hessian on its own, and a third isolates
the ``torch.func.vmap`` batching of a matrix product that decides the outcome.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import hypergrad_bench as hb
import torch
from harness.report import machine_line

import hypergrad as hg
from hypergrad.autodiff import RootSystem

RESULTS = Path(__file__).resolve().parent / "results"


def _clock(fn: Any, budget: float = 0.4, rounds: int = 5) -> float:
    """Median CPU ms of ``fn`` over ``rounds`` rounds of about ``budget / rounds`` seconds each."""
    fn()
    samples = []
    for _ in range(rounds):
        t0, n = time.thread_time(), 0
        while n == 0 or time.thread_time() - t0 < budget / rounds:
            fn()
            n += 1
        samples.append((time.thread_time() - t0) / n)
    return statistics.median(samples) * 1e3


def _dense_runner(b: hb.Bench) -> hb.Runner:
    method, problem = hg.Implicit(hg.linear.Dense()), b.problem

    def fn() -> torch.Tensor:
        return hb.flat(method.hypergrad(problem, b.w, b.lam).grad)

    return hb.Runner("Implicit Dense", "hypergrad", "implicit-dense", fn)


def solver_rows(specs: list[dict[str, Any]], sizes: hb.Sizes, log: Any) -> list[dict[str, Any]]:
    """CG vs Dense (and the peers where the main benchmark has them), interleaved per problem."""
    rows = []
    for spec in specs:
        b = hb.build_bench(spec)
        runners = hb.make_runners(b, sizes, ["unit", "implicit-cg"])
        runners.append(_dense_runner(b))
        log(f"  {b.title}")
        timing = hb.time_interleaved(runners, sizes, log)
        med, outs = timing["median"], timing["outputs"]
        row: dict[str, Any] = {"problem": spec["key"], "d": b.n_params, "rounds": timing["rounds"]}
        for r in runners:
            key = {"Implicit CG": "cg", "Implicit Dense": "dense", "custom_root + solve_cg": "torchopt",
                   "custom_root + solve_cg (jax.jit)": "jaxopt"}.get(r.name)
            if key is None:
                continue
            row[f"{key}_ms"] = med[r.name] * 1e3
            row[f"{key}_err"] = hb.rel_err(outs[r.name], b.reference)
            if key == "cg":
                row["cg_iterations"] = r.info.get("iterations")
        rows.append(row)
        log("    " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return rows


def materialise_rows(specs: list[dict[str, Any]], log: Any, budget: float = 0.4) -> list[dict[str, Any]]:
    """Time each way of building the d x d Hessian of the inner loss, and one Hessian-vector product."""
    rows = []
    for spec in specs:
        b = hb.build_bench(spec)
        shape = b.w["weight"].shape
        lam = {k: v.detach() for k, v in b.lam.items()}
        w0 = b.w["weight"].reshape(-1).detach()

        def g(v: torch.Tensor, b: hb.Bench = b, shape: torch.Size = shape, lam: dict = lam) -> torch.Tensor:
            return b.g({"weight": v.reshape(shape)}, lam)

        root = RootSystem(b.problem, b.w, b.lam, None)
        grad_g = torch.func.grad(g)
        eye = torch.eye(w0.numel(), dtype=w0.dtype)

        def vmap_vjp(grad_g: Any = grad_g, w0: torch.Tensor = w0, eye: torch.Tensor = eye) -> torch.Tensor:
            _, vjp_fn = torch.func.vjp(grad_g, w0)
            return torch.func.vmap(vjp_fn)(eye)[0]

        H = root.dense_rmatrix()
        rhs = torch.ones(H.shape[0], 1, dtype=H.dtype)
        X = b.data["X"]
        row = {
            "problem": spec["key"], "d": w0.numel(),
            "hvp": _clock(lambda root=root, w0=w0: root.rmatvec_flat(w0), budget),
            "batched_vjp": _clock(root.dense_rmatrix, budget),
            "vmap_vjp": _clock(vmap_vjp, budget),
            "jacrev_grad": _clock(lambda g=g, w0=w0: torch.func.jacrev(torch.func.grad(g))(w0), budget),
            "hessian": _clock(lambda g=g, w0=w0: torch.func.hessian(g)(w0), budget),
            "cholesky": _clock(lambda H=H, rhs=rhs: torch.cholesky_solve(rhs, torch.linalg.cholesky(H)), budget),
            "gram": _clock(lambda X=X: X.T @ X, budget),
        }
        rows.append(row)
        log("    " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return rows


def vmap_matmul_rows(shapes: list[tuple[int, int]], budget: float = 0.4) -> list[dict[str, Any]]:
    """``vmap(v -> X @ v[:, None])`` over the d basis vectors against the single product ``X @ I``."""
    rows = []
    for n, d in shapes:
        X = torch.randn(n, d, dtype=torch.float64)
        eye = torch.eye(d, dtype=torch.float64)
        mm = torch.func.vmap(lambda v, X=X: X @ v[:, None])
        mv = torch.func.vmap(lambda v, X=X: X @ v)
        rows.append({"n": n, "d": d, "vmap_mm": _clock(lambda mm=mm, eye=eye: mm(eye), budget),
                     "vmap_mv": _clock(lambda mv=mv, eye=eye: mv(eye), budget),
                     "gemm": _clock(lambda X=X, eye=eye: X @ eye, budget)})
    return rows


def render(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        "# Implicit: dense solve (one batched Hessian) vs CG",
        "",
        f"- Command: `{result['command']}` (wall time {result['elapsed_s'] / 60:.1f} min)",
        f"- Date: {meta['date']}",
        machine_line(meta, "shared with other jobs; load average at the end"),
        f"- Versions: torch {meta['torch']}, hypergrad {meta['hypergrad']}, jax {meta['jax']}, jaxopt "
        f"{meta['jaxopt']}, torchopt {meta['torchopt']}, Python {meta['python']}",
        "- Problems: those of `benchmarks/hypergrad_bench.py` (same data and inner solutions), float64, at more "
        "inner dimensions d; errors are relative to the closed form (ridge) or to the IFT formula with an "
        "explicit solve (logistic).",
        "- Timing: runners of one problem interleaved in one process (`hypergrad_bench.time_interleaved`, "
        "rotating start), CPU-time medians. `Implicit Dense` is `hg.Implicit(hg.linear.Dense())`: the "
        "Hessian from one batched backward through the retained gradient graph "
        "(`torch.autograd.grad(..., is_grads_batched=True)`, i.e. `vmap` over the Hessian-vector product), "
        "then Cholesky. `Implicit CG` is the default `CG(tol=1e-6)`.",
        "",
        "## Result",
        "",
    ]
    lines += result["summary"]
    lines += [
        "",
        "## Implicit CG vs Implicit Dense (and the peers)",
        "",
        "| problem | d | CG iterations | CG ms | Dense ms | Dense / CG | jaxopt-jit ms | CG / jaxopt | Dense / jaxopt "
        "| torchopt ms | CG / torchopt | Dense / torchopt | CG error | Dense error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x: Any, spec: str = ".3g") -> str:
        return "-" if x is None else format(x, spec)

    for r in result["solvers"]:
        jx, to = r.get("jaxopt_ms"), r.get("torchopt_ms")
        lines.append(
            f"| {r['problem']} | {r['d']} | {r['cg_iterations']} | {f(r['cg_ms'])} | {f(r['dense_ms'])} | "
            f"**{r['dense_ms'] / r['cg_ms']:.2f}** | {f(jx)} | {f(jx and r['cg_ms'] / jx, '.2f')} | "
            f"{f(jx and r['dense_ms'] / jx, '.2f')} | {f(to)} | {f(to and r['cg_ms'] / to, '.2f')} | "
            f"{f(to and r['dense_ms'] / to, '.2f')} | "
            f"{r['cg_err']:.1e} | {r['dense_err']:.1e} |")
    lines += [
        "",
        "## Building the d x d Hessian on its own (ms)",
        "",
        "`batched_vjp`: what `Dense` uses (one `is_grads_batched` backward through the retained graph); "
        "`vmap_vjp`: `torch.func.vmap` over `torch.func.vjp` of `torch.func.grad`; `jacrev_grad`: "
        "`torch.func.jacrev(torch.func.grad(g))`; `hessian`: `torch.func.hessian(g)` (forward over reverse); "
        "`hvp`: ONE Hessian-vector product through the retained graph (what a CG iteration costs); "
        "`cholesky`: factor and solve; `gram`: the single matrix product `X.T @ X` that a hand-written "
        "Hessian of these losses needs (the arithmetic floor).",
        "",
        "| problem | d | hvp | batched_vjp | batched_vjp / hvp | vmap_vjp | jacrev_grad | hessian | cholesky | gram |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["materialise"]:
        lines.append(
            f"| {r['problem']} | {r['d']} | {r['hvp']:.3f} | {r['batched_vjp']:.3f} | "
            f"{r['batched_vjp'] / r['hvp']:.0f} | {r['vmap_vjp']:.3f} | {r['jacrev_grad']:.3f} | "
            f"{r['hessian']:.3f} | {r['cholesky']:.3f} | {r['gram']:.3f} |")
    lines += [
        "",
        "## Why: `vmap` of a product with an unbatched matrix (ms)",
        "",
        "The model is `nn.Linear(d, 1)`: its weight is `(1, d)`, so every Hessian-vector product contains "
        "`X @ v[:, None]` (a matrix-matrix product with one unbatched operand). Under `torch.func.vmap` "
        "(which `is_grads_batched`, `jacrev` and `hessian` all use) this product is executed as `bmm` "
        "with `X` expanded along the batch, i.e. d separate matrix-vector products, instead of the one "
        "matrix product `X @ I` (visible in `torch.profiler` as `aten::bmm` with input shapes "
        "`[[d, n, d], [d, d, 1]]`). The vector form `X @ v` is batched well.",
        "",
        "| n | d | vmap(X @ v[:, None]) | vmap(X @ v) | X @ I | vmap mm / X @ I |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["vmap"]:
        lines.append(f"| {r['n']} | {r['d']} | {r['vmap_mm']:.3f} | {r['vmap_mv']:.3f} | {r['gemm']:.3f} | "
                     f"{r['vmap_mm'] / r['gemm']:.1f} |")
    return "\n".join(lines) + "\n"


def summary(rows: list[dict[str, Any]]) -> list[str]:
    wins = [r for r in rows if r["dense_ms"] < 0.9 * r["cg_ms"]]
    best = min(rows, key=lambda r: r["dense_ms"] / r["cg_ms"])
    out = [
        f"- Dense is faster than CG by more than 10 % on {len(wins)} of {len(rows)} problems"
        + (f" ({', '.join(r['problem'] for r in wins)})" if wins else "")
        + f"; its best ratio is {best['dense_ms'] / best['cg_ms']:.2f} ({best['problem']}).",
        "- Dense is as accurate or more (errors ~1e-15 against CG's ~1e-7 at `tol=1e-6`).",
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few problems, prints only")
    parser.add_argument("--out", type=Path, default=None, help="write implicit_dense.md here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    log = lambda m: print(m, flush=True)  # noqa: E731
    if args.quick:
        logistic_ds, ridge_ds, mat_ds = (20, 100), (50,), (100,)
    else:
        logistic_ds, ridge_ds, mat_ds = (10, 20, 50, 100, 200, 1000), (20, 50, 100, 200, 1000), (100, 200)
    specs = [{"key": f"logistic_d{d}", "kind": "logistic", "n": 500, "d": d, "scalar": False, "K": 100}
             for d in logistic_ds]
    specs += [{"key": f"ridge_feature_d{d}", "kind": "ridge", "n": 1000, "d": d, "scalar": False, "K": 100}
              for d in ridge_ds]
    sizes = replace(hb.FULL, repeats=25, min_repeats=3, budget_s=4.0 if args.quick else 15.0)
    solvers = solver_rows(specs, sizes, log)
    mat_specs = [s for s in specs if s["d"] in mat_ds]
    materialise = materialise_rows(mat_specs, log)
    vm = vmap_matmul_rows([(500, 100), (1000, 200)] if not args.quick else [(500, 100)])
    meta = hb.metadata(1)
    command = "python benchmarks/implicit_dense.py" + (" --quick" if args.quick else "")
    result = {"solvers": solvers, "materialise": materialise, "vmap": vm, "meta": meta, "command": command,
              "summary": summary(solvers), "elapsed_s": time.perf_counter() - t0,
              "platform": platform.platform(), "pid": os.getpid(),
              "date": _dt.datetime.now(_dt.timezone.utc).isoformat()}
    text = render(result)
    out = args.out if args.out is not None else (None if args.quick else RESULTS)
    if out is None:
        print(text)
    else:
        out.mkdir(parents=True, exist_ok=True)
        (out / "implicit_dense.md").write_text(text)
        print(f"wrote {out / 'implicit_dense.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
