"""``llm-calib demo``: calibrate SmolLM2-135M-Instruct on built-in domains, test on others.

The built-in multi-domain set (no data files needed) is split by domain: the model is fine-tuned
on three *in-domain* domains and evaluated on held-out questions of those domains and on two
*out-of-domain* ones. Compared side by side: the uncalibrated model, temperature scaling fitted
on the in-domain held-out split (the post-hoc baseline carried to every domain), and CALM.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hypergrad as hg
from llm_calib.objectives.calm import Calm

__all__ = ["DemoSettings", "ridge_hypergradient_demo", "run_demo", "split_data"]

IN_DOMAIN = ("arithmetic", "unit_conversion", "capitals")
OUT_OF_DOMAIN = ("calendar", "chemical_symbols")


@dataclass
class DemoSettings:
    """What the demo runs (defaults: the README's main job, under 15 minutes on 2 CPU cores).

    Attributes:
        model: model name or path (default: the built-in SmolLM2-135M-Instruct alias).
        in_domain, out_of_domain: built-in domains used for training and for transfer tests.
        n_per_domain: questions generated per domain.
        n_train, n_heldout: per in-domain domain, questions for training and held-out inputs;
            the rest are the in-domain test questions.
        steps, batch_size, top_layers: CALM budget; LoRA sits on the top ``top_layers`` layers.
        lr: learning rate of θ (LoRA).
        objective: CALM's settings: its solver (with its inner steps), λ's variant, learning rate
            and bounds (:class:`~llm_calib.objectives.calm.Calm`; the defaults are those of
            :class:`~llm_calib.calm.config.CalibrationConfig`).
        out: output directory for the report.
        seed: data and training seed.
    """

    model: str = "smollm2-135m-instruct"
    in_domain: tuple[str, ...] = IN_DOMAIN
    out_of_domain: tuple[str, ...] = OUT_OF_DOMAIN
    n_per_domain: int = 80
    n_train: int = 24
    n_heldout: int = 24
    steps: int = 40
    batch_size: int = 8
    top_layers: int = 6
    lr: float = 1e-3
    objective: Calm = field(default_factory=Calm)
    out: str = "llm-calib-demo"
    seed: int = 0
    timings: dict[str, float] = field(default_factory=dict)


def split_data(settings: DemoSettings) -> tuple[list, list, dict[str, list]]:
    """The demo's data: ``(train, heldout, test_by_domain)`` from the built-in generated questions.

    Each in-domain set gives ``n_train`` training and ``n_heldout`` held-out questions and keeps
    the rest for testing; the out-of-domain sets are test questions only.

    Example:
        >>> train, heldout, test = split_data(DemoSettings(n_per_domain=8, n_train=4, n_heldout=2))
        >>> d = DemoSettings()
        >>> len(train) == 4 * len(d.in_domain), sorted(test) == sorted(d.in_domain + d.out_of_domain)
        (True, True)
    """
    from llm_calib.data import builtin_multiple_choice

    questions = builtin_multiple_choice(
        n_per_domain=settings.n_per_domain, seed=settings.seed,
        domains=list(settings.in_domain) + list(settings.out_of_domain),
    )
    by_domain: dict[str, list] = {}
    for q in questions:
        by_domain.setdefault(q.domain, []).append(q)
    train, heldout, test = [], [], {}
    for d in settings.in_domain:
        qs = by_domain[d]
        train += qs[: settings.n_train]
        heldout += qs[settings.n_train : settings.n_train + settings.n_heldout]
        test[d] = qs[settings.n_train + settings.n_heldout :]
    for d in settings.out_of_domain:
        test[d] = by_domain[d]
    return train, heldout, test


def _summaries(scored: Any) -> dict[str, float]:
    from llm_calib.metrics import summarize

    return summarize(scored.probs_numpy, scored.labels_numpy, ci=False)


def run_demo(settings: DemoSettings | None = None) -> dict[str, Any]:
    """Run the demo, print the table, write ``report.md`` and ``results.json``; return the results.

    Example:
        >>> settings = DemoSettings()   # doctest: +SKIP
        >>> results = run_demo(settings)   # doctest: +SKIP
    """
    from llm_calib.calm.config import (
        CalibrationConfig,
        LoraSettings,
        SelectionSettings,
        TrainingSettings,
    )
    from llm_calib.calm.trainer import calibrate
    from llm_calib.calm.training import MIN_GUARD_QUESTIONS
    from llm_calib.models import load
    from llm_calib.scoring.option_likelihood import score_option_likelihood
    from llm_calib.temperature import fit_temperature

    settings = settings or DemoSettings()
    timings: dict[str, float] = {}
    t = time.perf_counter()
    model, tokenizer = load(settings.model)
    timings["load model"] = time.perf_counter() - t
    train, heldout, test = split_data(settings)
    all_test = [q for d in test for q in test[d]]

    t = time.perf_counter()
    uncal = score_option_likelihood(model, tokenizer, all_test + heldout, batch_size=16, progress=True)
    timings["score uncalibrated"] = time.perf_counter() - t
    uncal_test = uncal.select(range(len(all_test)))
    uncal_heldout = uncal.select(range(len(all_test), len(uncal)))
    temperature = fit_temperature(uncal_heldout.logits, uncal_heldout.labels)
    scaled_test = uncal_test.scaled(temperature)

    n_layers = model.config.num_hidden_layers
    config = CalibrationConfig(
        objective=settings.objective,
        training=TrainingSettings(steps=settings.steps, batch_size=settings.batch_size,
                                  heldout_batch_size=settings.batch_size, lr=settings.lr),
        selection=SelectionSettings(eval_every=5), seed=settings.seed,
        lora=LoraSettings(rank=8, layers=tuple(range(n_layers - settings.top_layers, n_layers))),
    )
    t = time.perf_counter()
    with warnings.catch_warnings():
        # a demo sized for minutes on a laptop; the report says how few held-out questions it used
        warnings.filterwarnings("ignore", message=".*held-out questions: model selection", category=UserWarning)
        result = calibrate(model, tokenizer, train, heldout, config)
    timings["train CALM"] = time.perf_counter() - t
    t = time.perf_counter()
    calm_test = score_option_likelihood(result.model, tokenizer, all_test, batch_size=16, progress=True)
    timings["score CALM"] = time.perf_counter() - t

    columns = {"uncalibrated": uncal_test, f"temperature (T={temperature:.2f})": scaled_test, "CALM": calm_test}
    rows: dict[str, dict[str, dict[str, float]]] = {}
    for name, scored in columns.items():
        for domain, part in scored.by_domain().items():
            rows.setdefault(domain, {})[name] = _summaries(part)
    table = _format_table(rows, list(columns), settings)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    report = (
        "# llm-calib demo\n\n"
        f"Model `{settings.model}`; CALM ({settings.objective.solver.name}, λ = {settings.objective.adjustment}) trained on {', '.join(settings.in_domain)} "
        f"({len(train)} questions, {len(heldout)} held-out inputs), {settings.steps} steps, LoRA on the top "
        f"{settings.top_layers} layers. Temperature fitted on the in-domain held-out split. Model selection "
        f"used {len(heldout)} held-out questions, sized for a demo: calibrate real models with at least "
        f"{MIN_GUARD_QUESTIONS}.\n\n"
        + table + "\n\nWall time per phase (s): "
        + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()) + "\n"
    )
    (out / "report.md").write_text(report)
    results = {"rows": rows, "temperature": temperature, "timings": timings, "calm_metrics": result.metrics}
    (out / "results.json").write_text(json.dumps(results, indent=2, default=float))
    result.save(out / "calm")
    print(report)
    return results


def _format_table(rows: dict[str, dict[str, dict[str, float]]], columns: Sequence[str], settings: DemoSettings) -> str:
    header = "| domain | split | " + " | ".join(f"{c} acc / ECE" for c in columns) + " |"
    lines = [header, "|" + "---|" * (len(columns) + 2)]
    groups = {"in-domain": settings.in_domain, "out-of-domain": settings.out_of_domain}
    for split, domains in groups.items():
        for d in domains:
            cells = [f"{rows[d][c]['accuracy']:.3f} / {rows[d][c]['ece']:.3f}" for c in columns]
            lines.append(f"| {d} | {split} | " + " | ".join(cells) + " |")
        mean = [
            f"{np.mean([rows[d][c]['accuracy'] for d in domains]):.3f} / {np.mean([rows[d][c]['ece'] for d in domains]):.3f}"
            for c in columns
        ]
        lines.append(f"| **mean** | {split} | " + " | ".join(mean) + " |")
    return "\n".join(lines)


def ridge_hypergradient_demo(seed: int = 0, n: int = 50, d: int = 8) -> dict[str, float]:
    """Hypergradient of ridge regression's validation loss w.r.t. per-feature log-penalties.

    Computes it with several ``hypergrad`` methods and the closed form; returns each method's
    relative error. (A fast check that needs no model.)

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
    step = 1.0 / float(torch.linalg.eigvalsh(H).max())
    methods: dict[str, Any] = {
        "Implicit(Dense)": hg.Implicit(hg.linear.Dense()),
        "Implicit(CG)": hg.Implicit(hg.linear.CG(tol=1e-10)),
        "Implicit(Neumann)": hg.Implicit(hg.linear.Neumann(steps=5000, tol=1e-10)),
        "Unrolled(reverse, K=500)": hg.Unrolled(hg.inner.SGD(step), steps=500, mode="reverse"),
        "FiniteDifference": hg.FiniteDifference(eps=1e-4, solver=hg.linear.CG(tol=1e-10)),
    }
    errors = {}
    for name, method in methods.items():
        start = {"w": torch.zeros(d, dtype=dt)} if name.startswith("Unrolled") else {"w": w_star}
        r = method.hypergrad(problem, start, lam)
        errors[name] = float((r.grad["log_l2"] - closed_form).norm() / closed_form.norm())
    return errors
