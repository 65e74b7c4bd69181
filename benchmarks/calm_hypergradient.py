"""CALM's first-order solvers against exact implicit hypergradients, on the real model.

For each λ parameterisation, a short run of the first-order solver on fixed batches (a lower-level
batch of labelled training questions, an upper-level batch of unlabelled inputs) is stopped at
several steps. At each stopping point the lower level (plus a proximal term anchored at the run's
θ, which makes θ*(λ) locally unique) is solved well, the exact hypergradient dF/dλ is taken with
``hypergrad.Implicit`` (conjugate gradient through the top LoRA layers, trunk cached), and each
first-order method's λ direction is compared with it (``llm_calib.calm.verify``):

* F2SA targets dF/dλ: cosine similarity and relative norm (after ``--f2sa-calls`` calls at the
  fixed λ, so that its second iterate w_σ has tracked argmin g + σ f, as it does in a run);
* BOME's joint step is not a hypergradient estimate: the exact directional derivative of F along
  its λ step (negative: the step descends F) and the cosine, at the run's own θ.

Run::

    python benchmarks/calm_hypergradient.py --data-dir ../shared/data
    python benchmarks/calm_hypergradient.py --tiny      # the tiny random model, float64, seconds
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from harness.report import machine_info, machine_line

import hypergrad as hg
from llm_calib.calm.run import task_format
from llm_calib.prompts.resolution import resolve_prompt_settings

ROOT = Path(__file__).resolve().parents[1]


def build(args: argparse.Namespace):
    """(model, tokenizer, train records, unlabelled records, dtype)."""
    from llm_calib.data import builtin_multiple_choice, load
    from llm_calib.models import load as load_model
    from llm_calib.models import tiny_random_model

    if args.tiny:
        model, tok = tiny_random_model(init_std=0.3)
        qs = builtin_multiple_choice(n_per_domain=args.n_train, domains=["capitals", "arithmetic"])
        return model.double(), tok, qs[: args.n_train], qs[args.n_train : args.n_train + args.n_unlabeled], torch.float64
    model, tok = load_model("smollm2-135m-instruct")
    train = load(f"arc_easy:{args.data_dir}:train").records[: args.n_train]
    unlabeled = load(f"arc_easy:{args.data_dir}:dev").records[: args.n_unlabeled]
    return model, tok, train, unlabeled, torch.float32


def run_kind(kind: str, args: argparse.Namespace) -> list[dict]:
    from llm_calib.adjustment import LogitAdjustment
    from llm_calib.calm.encoding import encode_records
    from llm_calib.calm.lora import FunctionalLM, attach_lora
    from llm_calib.calm.losses import CalmLosses
    from llm_calib.calm.verify import check_hypergradients, proximal_problem
    from llm_calib.config.calibration import CalibrationConfig, LoraSettings
    from llm_calib.objectives.calm import Calm

    model, tok, train, unlabeled, dtype = build(args)
    n_layers = model.config.num_hidden_layers
    layers = tuple(range(n_layers - args.layers, n_layers))
    config = CalibrationConfig(lora=LoraSettings(rank=args.rank, layers=layers, output_scale=False),
                               objective=Calm(adjustment=kind))
    lm = FunctionalLM(attach_lora(model, config.lora))
    adjustment = LogitAdjustment(kind, lm.head.out_features)
    losses = CalmLosses(lm, adjustment, "sum")
    pad = tok.pad_token_id or 0
    inner_batch = encode_records(tok, train, task_format(train, resolve_prompt_settings(config.prompt))).batch(range(len(train)), pad, lm)
    outer_batch = encode_records(tok, unlabeled, task_format(unlabeled, resolve_prompt_settings(config.prompt))).batch(range(len(unlabeled)), pad, lm)
    problem = hg.BilevelProblem(inner=losses.inner, outer=losses.outer)

    def f2sa() -> hg.Penalty:
        return hg.Penalty(sigma=args.sigma, inner_optimizer=hg.inner.Adam(lr=args.inner_lr), inner_steps=args.f2sa_steps)

    def bome() -> hg.BOME:
        return hg.BOME(hg.inner.SGD(lr=args.bome_inner_lr), w_lr=args.lr, inner_steps=args.bome_steps,
                       eta=args.eta, barrier=args.barrier, w_optimizer=hg.inner.Adam(lr=args.lr))

    theta = lm.theta()
    lam = adjustment.init(dtype=dtype)
    lam_params = {k: v.clone().requires_grad_(True) for k, v in lam.items()}
    lam_opt = torch.optim.Adam(list(lam_params.values()), lr=args.lam_lr)
    runner = f2sa() if args.run_solver == "f2sa" else bome()
    state = None
    rows = []
    points = sorted(int(p) for p in args.points.split(","))
    for step in range(max(points) + 1):
        if step in points:
            lam_now = {k: v.detach().clone() for k, v in lam_params.items()}
            prox = proximal_problem(problem, theta, args.mu)
            t0 = time.perf_counter()
            check = check_hypergradients(
                prox, theta, lam_now, inner_batch, outer_batch, {"f2sa": f2sa(), "bome": bome()},
                lower_steps=args.lower_steps, lower_optimizer=hg.inner.Adam(lr=args.lower_lr),
                solver=hg.linear.CG(tol=args.cg_tol, maxiter=args.cg_maxiter), calls=args.f2sa_calls,
                method_start={"f2sa": "solved", "bome": "given"},
            )
            by = check.by_method()
            row = {
                "kind": kind, "step": step, "seconds": time.perf_counter() - t0,
                "exact_norm": float(hg.tree.tree_norm(check.exact)),
                "lower_grad_norm": check.lower_gradient_norm, "cg_iterations": check.solver_iterations,
                "cg_converged": check.solver_converged,
                **{f"{m}_{k}": getattr(by[m], k) for m in by for k in ("cosine", "relative_norm", "descent")},
                "bome_phi": by["bome"].extra.get("phi", float("nan")),
                "lam": {k: [round(x, 4) for x in v.flatten()[:4].tolist()] for k, v in lam_now.items()},
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        if step == max(points):
            break
        r = runner.hypergrad(problem, theta, {k: v.detach() for k, v in lam_params.items()}, inner_batch, outer_batch, state)
        lam_opt.zero_grad(set_to_none=False)
        for k, p in lam_params.items():
            p.grad = r.grad[k].detach().clone()
        lam_opt.step()
        adjustment.clamp_(lam_params)
        theta, state = r.w, r.state
    return rows


def write_report(rows: list[dict], args: argparse.Namespace, seconds: float) -> Path:
    """Write the markdown table and the JSON rows (also usable on rows of an interrupted run)."""
    out = args.out or ROOT / "benchmarks" / "results" / ("calm_hypergradient_tiny.md" if args.tiny else "calm_hypergradient.md")
    cmd = "python benchmarks/calm_hypergradient.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "data_dir", "tiny") and v is not None
    ) + (" --tiny" if args.tiny else "")
    lines = [
        "# CALM: first-order λ directions against exact implicit hypergradients",
        "",
        f"- Command: `{cmd}`",
        machine_line(machine_info(), f"torch {torch.__version__}; date {time.strftime('%Y-%m-%d %H:%M')}; {seconds:.0f} s wall"),
        f"- Model: {'tiny random Llama (float64)' if args.tiny else 'SmolLM2-135M-Instruct (float32)'}, LoRA rank "
        f"{args.rank} on the top {args.layers} layers; lower batch {args.n_train} "
        f"{'built-in' if args.tiny else 'ARC-Easy train'} questions, upper batch {args.n_unlabeled} unlabelled "
        f"{'built-in' if args.tiny else 'ARC-Easy dev'} inputs; proximal μ = {args.mu}.",
        "- exact: Implicit + CG at θ*(λ); `descent` is the exact directional derivative of F along the method's "
        "λ step (negative = descends F); F2SA after its warm-up calls at the fixed λ, BOME at the run's θ.",
        "",
        "| λ | step | ‖∇F‖ | ‖∇g‖ at θ* | CG it. (conv.) | F2SA cos | F2SA rel. norm | F2SA descent | BOME cos | BOME descent | BOME φ |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['step']} | {r['exact_norm']:.3g} | {r['lower_grad_norm']:.2g} | {r['cg_iterations']} "
            f"({'yes' if r['cg_converged'] else 'no'}) | {r['f2sa_cosine']:.3f} | {r['f2sa_relative_norm']:.3g} | "
            f"{r['f2sa_descent']:.3g} | {r['bome_cosine']:.3f} | {r['bome_descent']:.3g} | {r['bome_phi']:.3g} |"
        )
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--tiny", action="store_true", help="the tiny random model in float64 (no data needed)")
    p.add_argument("--kinds", default="option_length,option_temperature,vector")
    p.add_argument("--n-train", type=int, default=16)
    p.add_argument("--n-unlabeled", type=int, default=16)
    p.add_argument("--layers", type=int, default=2, help="LoRA on the top N layers (the rest is the cached trunk)")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--points", default="0,10,20", help="run steps at which to compare")
    p.add_argument("--run-solver", choices=("f2sa", "bome"), default="f2sa", help="the solver of the run")
    p.add_argument("--mu", type=float, default=1e-2, help="proximal weight that makes theta*(lambda) unique")
    p.add_argument("--lower-steps", type=int, default=150)
    p.add_argument("--lower-lr", type=float, default=3e-3)
    p.add_argument("--cg-tol", type=float, default=1e-4)
    p.add_argument("--cg-maxiter", type=int, default=100)
    p.add_argument("--sigma", type=float, default=1e-2)
    p.add_argument("--inner-lr", type=float, default=3e-3)
    p.add_argument("--f2sa-steps", type=int, default=5)
    p.add_argument("--f2sa-calls", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lam-lr", type=float, default=5e-2)
    p.add_argument("--bome-steps", type=int, default=5)
    p.add_argument("--bome-inner-lr", type=float, default=5e-2)
    p.add_argument("--eta", type=float, default=0.5)
    p.add_argument("--barrier", default="gradient")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    start = time.time()
    rows = [row for kind in args.kinds.split(",") for row in run_kind(kind, args)]
    write_report(rows, args, time.time() - start)


if __name__ == "__main__":
    main()
