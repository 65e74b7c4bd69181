"""``llm-calib demo``: CALM on three built-in domains against the uncalibrated model and
temperature scaling, tested in-domain and on two out-of-domain ones.
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

from llm_calib.objectives.calm import Calm

__all__ = ["DemoSettings", "run_demo", "split_data"]

IN_DOMAIN = ("arithmetic", "unit_conversion", "capitals")
OUT_OF_DOMAIN = ("calendar", "chemical_symbols")


@dataclass
class DemoSettings:
    """What the demo runs (defaults: the README's main job, under 15 minutes on 2 CPU cores): the
    model, the in- and out-of-domain built-in domains, questions per domain (``n_train`` and
    ``n_heldout`` per in-domain domain, the rest test), CALM's budget and
    :class:`~llm_calib.objectives.calm.Calm` settings (LoRA on the top ``top_layers`` layers), the
    report directory and the seed.
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
    """The demo's ``(train, heldout, test_by_domain)``; out-of-domain sets are test only.

    Example:
        >>> train, heldout, test = split_data(DemoSettings(n_per_domain=8, n_train=4, n_heldout=2))
        >>> len(train), sorted(test)[:2]
        (12, ['arithmetic', 'calendar'])
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

