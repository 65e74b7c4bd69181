"""``llm-calib demo``: CALM on three built-in domains against the uncalibrated model and
temperature scaling, tested in-domain and on two out-of-domain ones, in a few minutes on 2 CPU cores.

The demo computes the frozen bottom of the model once per question: one base-model pass scores
every question uncalibrated and keeps the hidden states entering the first LoRA layer (the trunk,
:class:`~llm_calib.calm.fast_eval.SharedTrunkEval`); CALM's training steps, its held-out
evaluations and the scoring of the trained model then run only the top ``top_layers`` layers.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from llm_calib.files.atomic import write_text_atomic
from llm_calib.objectives.calm import Bome, Calm

__all__ = ["DemoSettings", "calibration_config", "explain_table", "run_demo", "split_data"]

IN_DOMAIN = ("arithmetic", "unit_conversion", "capitals")
OUT_OF_DOMAIN = ("calendar", "chemical_symbols")


def _demo_objective() -> Calm:
    # One inner step instead of CALM's default five: a step costs ~3 passes instead of ~7, and on
    # the demo data the trained model's in-domain ECE is as low (benchmarks/results/demo.md).
    return Calm(solver=Bome(inner_steps=1))


@dataclass
class DemoSettings:
    """What the demo runs: the model, the in- and out-of-domain built-in domains, questions per
    domain (``n_train`` and ``n_heldout`` per in-domain domain, the rest of ``n_per_domain`` test;
    ``n_out_of_domain`` test questions per out-of-domain domain, None: as many as each in-domain
    domain tests), CALM's budget and
    :class:`~llm_calib.objectives.calm.Calm` settings (LoRA on the top ``top_layers`` layers, the
    learning rates ``lr`` of LoRA and ``output_scale_lr`` of the trained output scale, held-out
    evaluation every ``eval_every`` steps), the prompt (``chat_template``: wrap questions
    in the model's chat template; None: when it has one), the report directory and the seed.

    The defaults are sized for ``make demo`` in minutes on 2 CPU cores (see
    ``benchmarks/results/demo.md`` for the measurements behind each).

    Example:
        >>> s = DemoSettings()
        >>> s.n_per_domain - s.n_train - s.n_heldout, s.steps, s.top_layers
        (24, 30, 2)
    """

    model: str = "smollm2-135m-instruct"
    in_domain: tuple[str, ...] = IN_DOMAIN
    out_of_domain: tuple[str, ...] = OUT_OF_DOMAIN
    n_per_domain: int = 56
    n_train: int = 16
    n_heldout: int = 16
    n_out_of_domain: int | None = None
    steps: int = 30
    batch_size: int = 8
    top_layers: int = 2
    lr: float = 1e-3
    output_scale_lr: float = 0.1
    eval_every: int = 10
    chat_template: bool | None = False
    objective: Calm = field(default_factory=_demo_objective)
    out: str = "llm-calib-demo"
    seed: int = 0

    def __post_init__(self) -> None:
        from llm_calib.config.checks import check_int

        for name in ("n_per_domain", "n_train", "n_heldout", "steps", "batch_size", "top_layers", "eval_every"):
            check_int(name, getattr(self, name), minimum=1)
        if self.n_out_of_domain is not None:
            check_int("n_out_of_domain", self.n_out_of_domain, minimum=1)
        if self.n_train + self.n_heldout >= self.n_per_domain:
            raise ValueError(f"n_train + n_heldout ({self.n_train} + {self.n_heldout}) must be below n_per_domain "
                             f"({self.n_per_domain}): the rest of each in-domain domain is its test set")


def split_data(settings: DemoSettings) -> tuple[list, list, dict[str, list]]:
    """The demo's ``(train, heldout, test_by_domain)``; out-of-domain sets are test only.

    Example:
        >>> train, heldout, test = split_data(DemoSettings(n_per_domain=8, n_train=4, n_heldout=2))
        >>> len(train), sorted(test)[:2], len(test["arithmetic"]), len(test["calendar"])
        (12, ['arithmetic', 'calendar'], 2, 2)
    """
    from llm_calib.data import builtin_multiple_choice

    n_test = settings.n_per_domain - settings.n_train - settings.n_heldout
    n_out = n_test if settings.n_out_of_domain is None else settings.n_out_of_domain
    questions = builtin_multiple_choice(n_per_domain=settings.n_per_domain, seed=settings.seed,
                                        domains=list(settings.in_domain))
    questions += builtin_multiple_choice(n_per_domain=n_out, seed=settings.seed, domains=list(settings.out_of_domain))
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


def calibration_config(settings: DemoSettings) -> Any:
    """The :class:`~llm_calib.config.calibration.CalibrationConfig` the demo trains CALM with (and
    encodes its questions with).

    Example:
        >>> cfg = calibration_config(DemoSettings())
        >>> cfg.lora.top_layers, cfg.objective.solver.inner_steps, cfg.prompt.chat_template
        (2, 1, False)
    """
    from llm_calib.config.calibration import (
        CalibrationConfig,
        LoraSettings,
        PromptSettings,
        SelectionSettings,
        TrainingSettings,
    )

    return CalibrationConfig(
        objective=settings.objective,
        training=TrainingSettings(steps=settings.steps, batch_size=settings.batch_size,
                                  heldout_batch_size=settings.batch_size, lr=settings.lr),
        selection=SelectionSettings(eval_every=settings.eval_every), seed=settings.seed,
        lora=LoraSettings(rank=8, top_layers=settings.top_layers, output_scale_lr=settings.output_scale_lr),
        prompt=PromptSettings(chat_template=settings.chat_template),
    )


def run_demo(settings: DemoSettings | None = None) -> dict[str, Any]:
    """Run the demo, print the table and what it means, write ``report.md`` and ``results.json``;
    return the results.

    Returns:
        ``rows`` (domain -> column -> metrics), ``temperature``, ``calm_temperature`` (the one of
        the "CALM + temperature" column, fitted on CALM's held-out scores), ``timings`` (wall seconds per
        phase), ``calm_metrics`` (held-out metrics before and after training, the selected step)
        and ``reading`` (the lines printed under the table).

    Example:
        >>> settings = DemoSettings()   # doctest: +SKIP
        >>> results = run_demo(settings)   # doctest: +SKIP
    """
    from llm_calib.calm.encoding import encode_records
    from llm_calib.calm.fast_eval import SharedTrunkEval
    from llm_calib.calm.run import resolve_run
    from llm_calib.calm.trainer import calibrate_run
    from llm_calib.metrics.calibration import summarize
    from llm_calib.metrics.temperature import fit_temperature
    from llm_calib.models import load

    settings = settings or DemoSettings()
    timings: dict[str, float] = {}
    t = time.perf_counter()
    model, tokenizer = load(settings.model)
    timings["load model"] = time.perf_counter() - t
    train, heldout, test = split_data(settings)
    run = resolve_run(calibration_config(settings), train, heldout)
    n_layers = int(model.config.num_hidden_layers)
    if settings.top_layers >= n_layers:
        raise ValueError(f"top_layers must be below the model's {n_layers} layers (the frozen trunk below them is "
                         f"computed once), got {settings.top_layers}")
    trunk_layers = n_layers - settings.top_layers

    t = time.perf_counter()
    # Encoded once: the base pass below fills their trunk caches, which training then reuses.
    train_enc = encode_records(tokenizer, train, run.formats.lower)
    heldout_enc = encode_records(tokenizer, heldout, run.formats.upper)
    sets = {**test, "__heldout": heldout_enc, "__train": train_enc}
    shared = SharedTrunkEval(model, tokenizer, sets, trunk_layers, settings=run.settings)
    base = shared.base()
    timings["score uncalibrated"] = time.perf_counter() - t
    temperature = fit_temperature(base["__heldout"].logits, base["__heldout"].labels)

    t = time.perf_counter()
    with warnings.catch_warnings():
        # a demo sized for minutes on a laptop; the report says how few held-out questions it used
        warnings.filterwarnings("ignore", message=".*held-out questions: model selection", category=UserWarning)
        result = calibrate_run(model, tokenizer, train_enc, heldout_enc, run, progress=True)
    timings["train CALM"] = time.perf_counter() - t
    t = time.perf_counter()
    calm = shared.adapted(result.model)
    timings["score CALM"] = time.perf_counter() - t
    # the recommended path (calibrate's "<method> + temperature" column): CALM, then a temperature
    # fitted on the trained model's own in-domain held-out scores
    calm_temperature = fit_temperature(calm["__heldout"].logits, calm["__heldout"].labels)

    columns = ("uncalibrated", f"temperature (T={temperature:.2f})", "CALM",
               f"CALM + temperature (T={calm_temperature:.2f})")
    rows: dict[str, dict[str, dict[str, float]]] = {}
    for domain in test:
        scores = (base[domain], base[domain].scaled(temperature), calm[domain], calm[domain].scaled(calm_temperature))
        for name, scored in zip(columns, scores, strict=True):
            rows.setdefault(domain, {})[name] = summarize(scored.probs_numpy, scored.labels_numpy, ci=False)
    table = _format_table(rows, columns, settings)
    reading = explain_table(rows, columns, settings, int(result.metrics["after"]["selected_step"]))
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    report = _report_text(settings, len(train), len(heldout), table, reading, timings)
    write_text_atomic(out / "report.md", report)
    results = {"rows": rows, "temperature": temperature, "calm_temperature": calm_temperature, "timings": timings,
               "calm_metrics": result.metrics, "reading": reading}
    write_text_atomic(out / "results.json", json.dumps(results, indent=2, default=float))
    result.save(out / "calm")
    print(report)
    return results


def _report_text(settings: DemoSettings, n_train: int, n_heldout: int, table: str, reading: Sequence[str],
                 timings: Mapping[str, float]) -> str:
    """The demo's ``report.md``: what was trained, the table, how to read it and the phase times."""
    from llm_calib.calm.training import MIN_GUARD_QUESTIONS

    return (
        "# llm-calib demo\n\n"
        f"Model `{settings.model}`; CALM ({settings.objective.solver.name}, λ = {settings.objective.adjustment}) trained on "
        f"{', '.join(settings.in_domain)} ({n_train} questions, {n_heldout} held-out inputs), {settings.steps} steps "
        f"of {settings.batch_size}, LoRA on the top {settings.top_layers} layers. Temperature fitted on the in-domain "
        f"held-out split. Model selection used {n_heldout} held-out questions, sized for a demo: calibrate real "
        f"models with at least {MIN_GUARD_QUESTIONS}.\n\n"
        + table + "\n\n" + "\n".join(reading) + "\n\nWall time per phase (s): "
        + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()) + "\n"
    )


def _group_means(rows: Mapping[str, Mapping[str, Mapping[str, float]]], domains: Sequence[str],
                 column: str) -> tuple[float, float]:
    """Mean accuracy and mean ECE of ``column`` over ``domains``."""
    return (float(np.mean([rows[d][column]["accuracy"] for d in domains])),
            float(np.mean([rows[d][column]["ece"] for d in domains])))


def _format_table(rows: Mapping[str, Mapping[str, Mapping[str, float]]], columns: Sequence[str],
                  settings: DemoSettings) -> str:
    header = "| domain | split | " + " | ".join(f"{c} acc / ECE" for c in columns) + " |"
    lines = [header, "|" + "---|" * (len(columns) + 2)]
    groups = {"in-domain": settings.in_domain, "out-of-domain": settings.out_of_domain}
    for split, domains in groups.items():
        for d in domains:
            cells = [f"{rows[d][c]['accuracy']:.3f} / {rows[d][c]['ece']:.3f}" for c in columns]
            lines.append(f"| {d} | {split} | " + " | ".join(cells) + " |")
        mean = ["{:.3f} / {:.3f}".format(*_group_means(rows, domains, c)) for c in columns]
        lines.append(f"| **mean** | {split} | " + " | ".join(mean) + " |")
    return "\n".join(lines)


def _change(what: str, before: float, after: float) -> str:
    """``"lowered <what> from 0.300 to 0.200"``, ``"raised ..."`` or ``"left <what> at 0.300"`` (at 3 decimals)."""
    if round(after, 3) == round(before, 3):
        return f"left {what} at {before:.3f}"
    return f"{'lowered' if after < before else 'raised'} {what} from {before:.3f} to {after:.3f}"


def explain_table(rows: Mapping[str, Mapping[str, Mapping[str, float]]], columns: Sequence[str],
                  settings: DemoSettings, selected_step: int) -> list[str]:
    """The lines printed under the demo's table: what the columns and splits are, what a lower ECE
    means, and what the numbers of this run say (worded from the numbers, so never contradicting them).

    Args:
        rows: domain -> column -> metrics (``accuracy``, ``ece``), as in the table.
        columns: the uncalibrated, temperature-scaled and CALM column names, in that order, and
            optionally the "CALM + temperature" one (explained in one more line).
        settings: gives the in- and out-of-domain domains.
        selected_step: the training step CALM's model selection kept (0: the initial model).

    Example:
        >>> m = lambda a, e: {"accuracy": a, "ece": e}
        >>> rows = {"x": {"u": m(0.5, 0.3), "t": m(0.5, 0.2), "c": m(0.5, 0.1)},
        ...         "y": {"u": m(0.6, 0.2), "t": m(0.6, 0.1), "c": m(0.6, 0.2)}}
        >>> lines = explain_table(rows, ["u", "t", "c"], DemoSettings(in_domain=("x",), out_of_domain=("y",)), 20)
        >>> print(lines[-2])
        - This run: in domain, CALM (step 20 of 30) lowered the mean ECE from 0.300 to 0.100 (temperature scaling: 0.200), at accuracy 0.500 (uncalibrated 0.500); out of domain it left it at 0.200 (temperature scaling: 0.100), at accuracy 0.600.
    """
    uncal, temp, calm, *calm_then_temperature = columns
    lines = [
        "How to read the table:",
        "- Each cell is accuracy / ECE on that domain's test questions. Accuracy: the share of questions whose most "
        "probable option is right. ECE (expected calibration error): the average gap between the model's confidence "
        "(the probability of its chosen option) and how often it is right; lower is better, 0 means a confidence of "
        "70% is right 70% of the time.",
        f"- In domain: {', '.join(settings.in_domain)}, the domains CALM and the temperature were fitted on (other "
        f"questions of them). Out of domain: {', '.join(settings.out_of_domain)}, never seen in training: does the "
        "calibration carry over?",
        f"- Columns: {uncal}: the model as it is; {temp}: its option probabilities after dividing the scores by one "
        "temperature fitted on the in-domain held-out questions (never changes accuracy); CALM: the model after "
        "CALM's LoRA training (a real model change, so accuracy can move too).",
    ]
    if calm_then_temperature:
        lines.append(
            f"- {calm_then_temperature[0]}: the CALM model's probabilities divided by a temperature fitted on its own "
            "in-domain held-out questions, the path we recommend (README, \"What to expect\"): compare its ECE with "
            "the temperature column to see what CALM adds over temperature scaling alone.")
    ui, ei = _group_means(rows, settings.in_domain, uncal)
    _, ti = _group_means(rows, settings.in_domain, temp)
    ci, ki = _group_means(rows, settings.in_domain, calm)
    uo, eo = _group_means(rows, settings.out_of_domain, uncal)
    _, to = _group_means(rows, settings.out_of_domain, temp)
    co, ko = _group_means(rows, settings.out_of_domain, calm)
    step = f"step {selected_step} of {settings.steps}" if selected_step else "model selection kept the initial model"
    lines.append(
        f"- This run: in domain, CALM ({step}) {_change('the mean ECE', ei, ki)} (temperature "
        f"scaling: {ti:.3f}), at accuracy {ci:.3f} (uncalibrated {ui:.3f}); out of domain it {_change('it', eo, ko)} "
        f"(temperature scaling: {to:.3f}), at accuracy {co:.3f}" + (f" (uncalibrated {uo:.3f})" if round(co, 3) != round(uo, 3) else "")
        + ".")
    lines.append(
        "- What to conclude: on this 135M-parameter model and a few dozen test questions per domain, differences of "
        "a few hundredths in ECE are within sampling noise; the demo shows the workflow and the kind of change, not "
        "a benchmark. Calibrate your own model with `llm-calib calibrate` on hundreds of questions "
        "(docs/methods/calm.md).")
    return lines
