#!/usr/bin/env python
"""Calibration benchmark: every method on the same data, in and out of domain (issue 7).

Usage (from the repository root, after ``make setup``)::

    .venv/bin/python benchmarks/calibration_bench.py                  # full run, SmolLM2-135M-Instruct,
                                                                      # data from ../shared/data; writes
                                                                      # benchmarks/results/calibration.md
    .venv/bin/python benchmarks/calibration_bench.py --quick          # random-init tiny model, built-in
                                                                      # data, seconds; report to a temp dir
    .venv/bin/python benchmarks/calibration_bench.py --search         # hyperparameter search on in-domain
                                                                      # data only -> calibration_hparams.json
    .venv/bin/python benchmarks/calibration_bench.py --open-test 200 --steps 40   # other sizes (a flag
                                                                      # for every field of Sizes)

The full run takes about 75 minutes on 2 cores (trained runs in ``--workers 2`` forked processes,
one torch thread each: on a busy 2-core machine two threads were slower than one).

Resuming: every (task, method, seed) result is one JSON file under the results directory
(``calibration_runs/<task>/<method>-seed<k>.json``), written atomically when finished; re-running
skips every result whose settings fingerprint matches and runs the missing ones (delete a file to
re-run it).

Protocol: multiple choice (option likelihood, cloze, summed scores) trained on ARC-Easy +
ARC-Challenge train, held-out inputs and temperature fit on ARC-Easy dev, tested in domain on ARC
test and out of domain on OpenBookQA, QASC, CommonsenseQA, the four MMLU groups and four
OpenTriviaQA categories; open-ended QA (greedy, mean token probability, exact match) trained on
NQ-open dev, tested on NQ-open, WebQuestions and SelfAware (TriviaQA part). Methods: uncalibrated,
temperature scaling carried over, LoRA CE, label smoothing, the flat confidence penalty, CALM with
BOME and with F2SA; same data, steps, batch and LoRA layers (top ``k``) for every trained method.

Speed: every trained method adapts only the top ``k`` layers, so one full-model pass gives the
uncalibrated predictions and the frozen trunk, and each trained model runs only its top layers
(``llm_calib.calm.fast_eval``). Wall time and peak RSS (``VmHWM`` after resetting the high-water
mark) are measured per run for training and evaluation separately.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llm_calib.calm.config import CalibrationConfig, LoraSettings
from llm_calib.calm.encoding import EncodingCache
from llm_calib.calm.fast_eval import SharedTrunkEval, fill_trunk_caches, fit_open_temperature
from llm_calib.calm.trainer import calibrate
from llm_calib.calm.training import best_candidate
from llm_calib.checkpoint import write_json_atomic, write_text_atomic
from llm_calib.data import (
    BUILTIN_DOMAINS,
    builtin_multiple_choice,
    builtin_open_questions,
    load,
    split_items,
)
from llm_calib.evaluate import summarize_scored
from llm_calib.flags import add_dataclass_flags, dataclass_overrides
from llm_calib.metrics import confidence_correct, ece, reliability_bins
from llm_calib.models import free_memory, tiny_random_model
from llm_calib.models import load as load_model
from llm_calib.profiling import Phase
from llm_calib.report import (
    format_number,
    machine_info,
    markdown_table,
    mean_sd,
    plot_reliability,
    provenance_lines,
    verdict,
)
from llm_calib.scoring.base import ScoredSet
from llm_calib.sweep import SeedResults, SweepLog, fingerprint, read_result, run_forked
from llm_calib.temperature import fit_temperature

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_DATA = ROOT.parent / "shared" / "data"
DEFAULT_HPARAMS = RESULTS / "calibration_hparams.json"
ALIAS = "smollm2-135m-instruct"

BASELINES = ("uncalibrated", "temperature_scaling")
TRAINED: dict[str, tuple[str, str]] = {
    "lora_ce": ("lora_ce", "bome"),
    "label_smoothing": ("label_smoothing", "bome"),
    "confidence_penalty": ("confidence_penalty", "bome"),
    "calm_bome": ("calm", "bome"),
    "calm_f2sa": ("calm", "f2sa"),
}
METHODS = (*BASELINES, *TRAINED)
LABELS = {
    "uncalibrated": "uncalibrated",
    "temperature_scaling": "temperature scaling",
    "lora_ce": "LoRA fine-tuning (CE)",
    "label_smoothing": "label smoothing",
    "confidence_penalty": "flat confidence penalty",
    "calm_bome": "CALM (BOME)",
    "calm_f2sa": "CALM (F2SA)",
}
TASK_TITLES = {"mc": "Multiple choice (option likelihood)", "open": "Open-ended QA (greedy, mean token probability)"}

# Hyperparameters used when no search result (``--hparams``) exists: the demo's settings.
BUILTIN_HPARAMS: dict[str, dict[str, Any]] = {
    "lora_ce": {"lr": 1e-3},
    "label_smoothing": {"lr": 1e-3, "label_smoothing": 0.1},
    "confidence_penalty": {"lr": 1e-3, "penalty_beta": 0.5},
    "calm_bome": {"lr": 1e-3, "lam_lr": 0.05, "inner_lr": 0.1},
    "calm_f2sa": {"lr": 1e-3, "lam_lr": 0.05, "f2sa_sigma": 0.1},
}

# The --search grid: a few settings per method, each trained with seed 0 and scored on the in-domain
# selection split (never on a test set).
SEARCH_GRID: dict[str, list[dict[str, Any]]] = {
    "lora_ce": [{"lr": lr, "output_scale": o} for o in (False, True) for lr in (1e-3, 3e-3)],
    "label_smoothing": [{"lr": 1e-3, "label_smoothing": e, "output_scale": o} for o in (False, True) for e in (0.1, 0.3)],
    "confidence_penalty": [{"lr": lr, "penalty_beta": 0.5, "output_scale": o} for o in (False, True) for lr in (1e-3, 3e-3)],
    "calm_bome": [{"lr": lr, "lam_lr": 0.05, "inner_lr": 0.1, "output_scale": o} for o in (False, True) for lr in (1e-3, 3e-3)],
    "calm_f2sa": [{"lr": 1e-3, "lam_lr": 0.05, "f2sa_sigma": 0.1, "output_scale": o} for o in (False, True)],
}
# The output scale (one log-scale on the final norm, see CalibrationConfig.output_scale) is searched
# for every trained method: it is a token-level temperature, and with summed option scores it moves
# the option-level confidence little while reordering options (measured in calibration.md).
SEARCH_RULE = (
    "each candidate is trained with seed 0 on the training split, with the run's step budget, and "
    "scored on the in-domain selection split (MC: ARC-Easy dev questions not used as held-out inputs "
    "plus ARC-Challenge dev; open: a separate part of NQ-open dev); among the candidates whose "
    "selection accuracy is at least 95% of the uncalibrated model's, the one with the lowest "
    "conf-ECE (10 bins) wins (if none is, the most accurate one). No test set is scored."
)

RELEVANT = {
    "lora_ce": ("lr", "output_scale"),
    "label_smoothing": ("lr", "label_smoothing", "output_scale"),
    "confidence_penalty": ("lr", "penalty_beta", "output_scale"),
    "calm_bome": ("lr", "lam_lr", "adjustment", "inner_steps", "inner_lr", "bome_eta", "bome_barrier", "output_scale"),
    "calm_f2sa": ("lr", "lam_lr", "adjustment", "inner_steps", "f2sa_sigma", "output_scale"),
}

MC_METRICS = ("accuracy", "ece", "adaptive_ece", "classwise_ece", "brier", "auroc")
OPEN_METRICS = ("accuracy", "ece", "adaptive_ece", "brier", "auroc")
METRIC_NAMES = {
    "accuracy": "accuracy", "ece": "conf-ECE", "adaptive_ece": "adaptive ECE",
    "classwise_ece": "class-wise ECE", "brier": "Brier", "auroc": "AUROC",
}
STEP_COST = {"confidence_penalty": 1.2, "calm_bome": 2.4, "calm_f2sa": 6.0}  # per step, CE = 1: longest runs first
TEMPERATURE_GRID = np.exp(np.linspace(np.log(0.25), np.log(64.0), 41))  # open-ended TS (T = 1 included)

# ----------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Sizes:
    """Sizes and budgets of one mode (the full run: about 75 minutes on 2 cores); every field has
    its flag (``--mc-test 200``).

    Attributes:
        name: the mode.
        model: a model name for ``llm_calib.models.load``, or ``tiny`` (``tiny_random_model``).
        seeds: seeds per trained method.
        top_layers: LoRA on the top k decoder layers.
        lora_rank: LoRA rank (alpha = 2 rank).
        mc_train, mc_heldout, mc_select, mc_test: MC questions: training (ARC-Easy + ARC-Challenge
            train, half each), held-out (ARC-Easy dev: upper-level inputs, early stopping,
            temperature fit), selection (``--search`` only: the rest of ARC-Easy dev +
            ARC-Challenge dev), per test set.
        open_train, open_heldout, open_select, open_test: the same for open questions.
        steps: training steps.
        open_steps: training steps of the open-ended task (null: ``steps``).
        batch_size: training (and held-out) batch.
        evals_per_run: held-out evaluations during training (plus before and after).
        eval_batch_size, gen_batch_size: questions per scoring / generation batch.
        max_new_tokens: greedy answer budget.
        bootstrap: bootstrap resamples.
        builtin_per_domain: built-in questions per domain (no data directory).
    """

    name: str
    model: str = ALIAS
    seeds: int = 3
    top_layers: int = 6
    lora_rank: int = 8
    mc_train: int = 400
    mc_heldout: int = 150
    mc_select: int = 300
    mc_test: int = 300
    open_train: int = 400
    open_heldout: int = 150
    open_select: int = 150
    open_test: int = 150
    steps: int = 30
    open_steps: int | None = None
    batch_size: int = 8
    evals_per_run: int = 2
    eval_batch_size: int = 16
    gen_batch_size: int = 16
    max_new_tokens: int = 10
    bootstrap: int = 1000
    builtin_per_domain: int = 30


FULL = Sizes("full")
QUICK = Sizes(
    "quick", model="tiny", seeds=2, top_layers=1, lora_rank=2, mc_train=16, mc_heldout=8, mc_select=8, mc_test=10,
    open_train=8, open_heldout=6, open_select=6, open_test=8, steps=3, batch_size=4, evals_per_run=1,
    eval_batch_size=8, gen_batch_size=8, max_new_tokens=4, bootstrap=50, builtin_per_domain=30,
)

OTQA_CATEGORIES = ("geography", "animals", "science-technology", "history")


# --------------------------------------------------------------------------------------- data


@dataclass
class Task:
    """One benchmark task: training, held-out, selection and test splits."""

    name: str  # "mc" or "open"
    train: list[Any]
    heldout: list[Any]
    select: list[Any]
    tests: dict[str, list[Any]]
    in_domain: tuple[str, ...]
    ood: tuple[str, ...]
    sources: dict[str, str] = field(default_factory=dict)
    description: str = ""

    def fingerprint(self) -> str:
        parts = {k: [f"{r.domain}/{r.id}" for r in v] for k, v in
                 (("train", self.train), ("heldout", self.heldout), *self.tests.items())}
        return fingerprint(parts)


def mc_task(data_dir: Path | None, sizes: Sizes) -> Task:
    """The multiple-choice task: real data from ``data_dir``, or the built-in generated set."""
    if data_dir is None:
        by = {d: builtin_multiple_choice(n_per_domain=sizes.builtin_per_domain, seed=0, domains=[d]) for d in BUILTIN_DOMAINS}
        half = sizes.mc_train // 2
        a_train, a_held, a_sel, a_test = split_items(by["arithmetic"], [half, sizes.mc_heldout, sizes.mc_select // 2, sizes.mc_test])
        u_train, u_sel, u_test = split_items(by["unit_conversion"], [sizes.mc_train - half, sizes.mc_select - sizes.mc_select // 2, sizes.mc_test])
        tests = {"arithmetic": a_test, "unit_conversion": u_test}
        ood = ("calendar", "capitals", "chemical_symbols")
        for d in ood:
            tests[d] = split_items(by[d], [sizes.mc_test])[0]
        src = {k: f"`builtin:{k}` ({len(v)})" for k, v in tests.items()}
        desc = (f"Built-in generated questions. Training: {len(a_train) + len(u_train)} arithmetic and unit-conversion "
                f"questions; held-out inputs and temperature fit: {len(a_held)} arithmetic questions.")
        return Task("mc", a_train + u_train, a_held, a_sel + u_sel, tests, ("arithmetic", "unit_conversion"), ood, src, desc)
    D = str(data_dir)
    half = sizes.mc_train // 2
    train = load(f"arc_easy:{D}:train", limit=half).records + load(f"arc_challenge:{D}:train", limit=sizes.mc_train - half).records
    dev = load(f"arc_easy:{D}:dev").records
    heldout, sel_easy = split_items(dev, [sizes.mc_heldout, min(sizes.mc_select // 2, len(dev) - sizes.mc_heldout)])
    select = sel_easy + load(f"arc_challenge:{D}:dev", limit=sizes.mc_select - len(sel_easy)).records
    specs = {
        "arc_easy": f"arc_easy:{D}:test",
        "arc_challenge": f"arc_challenge:{D}:test",
        "openbookqa": f"openbookqa:{D}",
        "qasc": f"qasc:{D}:dev",
        "commonsenseqa": f"commonsenseqa:{D}:dev",
        **{f"mmlu_{g}": f"mmlu_{g}:{D}:test" for g in ("stem", "humanities", "social_sciences", "other")},
        **{f"otqa_{c.replace('-', '_')}": f"opentriviaqa:{D}:{c}" for c in OTQA_CATEGORIES},
    }
    tests, src = {}, {}
    for name, spec in specs.items():
        res = load(spec)
        tests[name] = load(spec, limit=sizes.mc_test, seed=0).records
        src[name] = f"`{spec.replace(D, '<data>')}` ({len(tests[name])} of {len(res)})"
    ood = tuple(k for k in tests if k not in ("arc_easy", "arc_challenge"))
    desc = (f"Training: {len(train)} questions (ARC-Easy + ARC-Challenge train, half each); held-out inputs and "
            f"temperature fit: {len(heldout)} ARC-Easy dev questions.")
    return Task("mc", train, heldout, select, tests, ("arc_easy", "arc_challenge"), ood, src, desc)


def open_task(data_dir: Path | None, sizes: Sizes) -> Task:
    """The open-ended task: NQ-open dev split into train / held-out / selection / in-domain test."""
    parts = [sizes.open_test, sizes.open_heldout, sizes.open_select, sizes.open_train]
    if data_dir is None:
        n = max(sizes.open_test, 1) + sum(parts)
        pools = {d: builtin_open_questions(4 * n if d == "sums" else n, [d]) for d in ("sums", "capitals", "elements")}
        test, heldout, select, train = split_items(pools["sums"], parts)
        tests = {"sums": test, "capitals": split_items(pools["capitals"], [sizes.open_test])[0],
                 "elements": split_items(pools["elements"], [sizes.open_test])[0]}
        src = {k: f"built-in open questions `{k}` ({len(v)})" for k, v in tests.items()}
        desc = f"Built-in open questions. Training: {len(train)} sums; held-out: {len(heldout)} other sums."
        return Task("open", train, heldout, select, tests, ("sums",), ("capitals", "elements"), src, desc)
    D = str(data_dir)
    nq = [r for r in load(f"nq_open:{D}").records if r.answers]
    test, heldout, select, train = split_items(nq, parts)
    tests = {"nq_open": test}
    src = {"nq_open": f"`nq_open:<data>` ({len(test)} of {len(nq)}, disjoint from train/held-out)"}
    for name, spec in (("webquestions", f"webquestions:{D}"), ("selfaware_triviaqa", f"selfaware:{D}:triviaqa")):
        full = [r for r in load(spec).records if r.answerable and r.answers]
        tests[name] = split_items(full, [min(sizes.open_test, len(full))])[0]
        src[name] = f"`{spec.replace(D, '<data>')}` ({len(tests[name])} of {len(full)} answerable)"
    desc = (f"Training: {len(train)} NQ-open dev questions (first alias as the target); held-out: {len(heldout)} "
            "other NQ-open dev questions.")
    return Task("open", train, heldout, select, tests, ("nq_open",), ("webquestions", "selfaware_triviaqa"), src, desc)


# ----------------------------------------------------------------------------------- scoring


def set_metrics(scored: Any, bootstrap: int) -> dict[str, float]:
    return summarize_scored(scored, n_bins=10, ci=bootstrap > 0, n_resamples=max(bootstrap, 1), seed=0)


def questions_record(scored: Any) -> dict[str, Any]:
    """What the report needs per question: MC option probabilities and labels; open confidences,
    correctness and answers."""
    if isinstance(scored, ScoredSet):
        return {"probs": [[round(float(p), 6) for p in ps] for ps in scored.probs_numpy],
                "labels": [int(y) for y in scored.labels]}
    conf = np.clip(scored.confidence("mean"), 0, 1)
    return {"conf": [round(float(c), 6) for c in conf], "correct": [int(k) for k in scored.correct],
            "answers": list(scored.answers)}


def conf_correct(task: str, q: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Per-question confidence and correctness from a stored result."""
    if task == "mc":
        conf, correct = confidence_correct(q["probs"], q["labels"])
        return np.clip(conf, 0, 1), correct.astype(np.float64)
    return np.asarray(q["conf"], dtype=np.float64), np.asarray(q["correct"], dtype=np.float64)


def result_path(runs: Path, task: str, method: str, seed: int) -> Path:
    return runs / task / f"{method}-seed{seed}.json"


# ----------------------------------------------------------------------------------- context


@dataclass
class Ctx:
    """Everything a run needs."""

    sizes: Sizes
    data_dir: Path | None
    out: Path
    runs: Path
    methods: tuple[str, ...]
    tasks: tuple[str, ...]
    hparams: dict[str, dict[str, dict[str, Any]]]
    hparams_source: str
    progress: bool = True
    plots: bool = True
    workers: int = 1
    timings: dict[str, float] = field(default_factory=dict)
    model: Any = None
    tokenizer: Any = None

    def __post_init__(self) -> None:
        self.log = SweepLog(self.runs / "bench.log")  # a forked worker sets log.worker

    def bar(self, total: int, desc: str) -> Any:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="q", dynamic_ncols=True, disable=not self.progress, leave=False)

    def seeds(self, method: str) -> list[int]:
        return [0] if method in BASELINES else list(range(self.sizes.seeds))

    def steps(self, task: str) -> int:
        return self.sizes.steps if task == "mc" or self.sizes.open_steps is None else self.sizes.open_steps

    @property
    def n_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def trunk_layers(self) -> int:
        return self.n_layers - self.sizes.top_layers

    def load_model(self) -> None:
        if self.model is not None:
            return
        t0 = time.perf_counter()
        if self.sizes.model == "tiny":
            self.model, self.tokenizer = tiny_random_model(seed=0, num_layers=3)
        else:
            self.model, self.tokenizer = load_model(self.sizes.model)
        for p in self.model.parameters():
            p.requires_grad_(False)
        if not 0 < self.sizes.top_layers < self.n_layers:
            raise ValueError(f"top_layers must be in [1, {self.n_layers - 1}], got {self.sizes.top_layers}")
        self.timings["load model"] = time.perf_counter() - t0

    def lora(self) -> LoraSettings:
        return LoraSettings(rank=self.sizes.lora_rank, alpha=2.0 * self.sizes.lora_rank,
                            layers=tuple(range(self.trunk_layers, self.n_layers)))

    def config(self, task: str, method: str, seed: int, overrides: dict[str, Any] | None = None) -> CalibrationConfig:
        objective, solver = TRAINED[method]
        steps = self.steps(task)
        params = {**BUILTIN_HPARAMS[method], **self.hparams.get(task, {}).get(method, {}), **(overrides or {})}
        return CalibrationConfig(
            method=objective, solver=solver, steps=steps, batch_size=self.sizes.batch_size,
            heldout_batch_size=self.sizes.batch_size, eval_every=max(1, steps // self.sizes.evals_per_run),
            seed=seed, lora=self.lora(), **params,
        )

    def evaluator(self, task: str, sets: dict[str, Any], temperatures: Any = None) -> SharedTrunkEval:
        """Scores ``sets`` with the base model once and with each trained model from the trunk."""
        s = self.sizes
        return SharedTrunkEval(self.model, self.tokenizer, sets, self.trunk_layers,
                               config=CalibrationConfig(lora=self.lora()), max_new_tokens=s.max_new_tokens,
                               batch_size=s.eval_batch_size if task == "mc" else s.gen_batch_size,
                               temperatures=temperatures)

    def fingerprint(self, task: Task, method: str, cfg: Any = None) -> str:
        s = self.sizes
        eval_part = {"model": s.model, "top_layers": s.top_layers, "bootstrap": s.bootstrap,
                     "eval": "option_likelihood/sum/cloze" if task.name == "mc" else f"greedy/{s.max_new_tokens}"}
        return fingerprint({"task": task.fingerprint(), "method": method, "eval": eval_part,
                            "config": cfg.to_dict() if cfg is not None else None})


def _timed_calibrate(ctx: Ctx, task: Task, cfg: Any, memo: EncodingCache) -> tuple[Any, Phase]:
    model = copy.deepcopy(ctx.model)
    with Phase() as phase:
        train, heldout = (memo(ctx.tokenizer, r, cfg) for r in (task.train, task.heldout))
        result = calibrate(model, ctx.tokenizer, train, heldout, cfg, progress=ctx.progress)
    return result, phase


# --------------------------------------------------------------------------------- one task


class Runner:
    """One task: the base pass (uncalibrated predictions, temperature fit, the trunk every trained
    model starts from), then the trained (method, seed) runs, scored from the trunk."""

    def __init__(self, ctx: Ctx, task: Task) -> None:
        self.ctx, self.task, self.memo = ctx, task, EncodingCache()
        grid = TEMPERATURE_GRID if task.name == "open" else None
        held = task.heldout if grid is not None else self.memo(  # its trunk serves training
            ctx.tokenizer, task.heldout, CalibrationConfig(lora=ctx.lora()))
        self.held = ctx.evaluator(task.name, {"heldout": held}, grid)
        self.tests = ctx.evaluator(task.name, task.tests, grid)
        self.base: dict[str, Any] = {}

    def base_pass(self) -> Phase:
        n = len(self.held) + len(self.tests)
        self.ctx.log(f"[{self.task.name}] base pass: {n} questions (held-out + tests) through the full model "
                     f"(uncalibrated predictions + trunk at layer {self.ctx.trunk_layers})")
        bar = self.ctx.bar(n, f"{self.task.name} base pass")
        with Phase() as phase:
            self.held_base = self.held.base(keep_trunk=self.task.name == "mc", bar=bar)["heldout"]
            self.base = self.tests.base(bar=bar)
        bar.close()
        self.ctx.timings[f"{self.task.name} base pass"] = phase.seconds
        return phase

    def baselines(self, pending: set[str], phase: Phase) -> None:
        t0 = time.perf_counter()
        if self.task.name == "mc":
            T = fit_temperature(self.held_base.logits, self.held_base.labels)
            scaled = {k: v.scaled(T) for k, v in self.base.items()}
            note = "one full-model pass gives both baselines"
        else:
            T, g = fit_open_temperature(self.task.heldout, self.held.base_outputs["heldout"], TEMPERATURE_GRID)
            scaled = self.tests.scaled(g)
            note = "one greedy pass gives both baselines (answers do not depend on T)"
        fit_s = time.perf_counter() - t0
        self.ctx.log(f"[{self.task.name}] temperature fitted on the held-out split ({len(self.held)}): T = {T:.3f}")
        for method in (m for m in BASELINES if m in pending):
            ts = method == "temperature_scaling"
            extra = f"; T fitted on held-out in {fit_s:.2f}s" if ts and self.task.name == "mc" else ""
            self.write(method, 0, scaled if ts else self.base, {"eval": phase.to_dict()},
                       {"train_s": fit_s if ts else 0.0, "eval_s": phase.seconds},
                       temperature=T if ts else None, note=note + extra)

    def prepare_training(self) -> None:
        """Fill the trunk caches of the training and held-out encodings once for every run of the task."""
        ctx, cfg = self.ctx, CalibrationConfig(lora=self.ctx.lora())
        encs = [self.memo(ctx.tokenizer, r, cfg) for r in (self.task.train, self.task.heldout)]
        n = sum(len(e) - len(e.trunk_cache) for e in encs)
        ctx.log(f"[{self.task.name}] trunk of the training and held-out questions ({n} to compute)")
        bar = ctx.bar(n, f"{self.task.name} training trunk")
        fill_trunk_caches(ctx.model, encs, cfg.lora, ctx.tokenizer.pad_token_id or 0, bar)
        bar.close()
        free_memory()

    def trained(self, method: str, seed: int) -> None:
        ctx, name = self.ctx, self.task.name
        cfg = ctx.config(name, method, seed)
        ctx.log(f"[{name}] {method} seed {seed}: training {cfg.steps} steps")
        result, train = _timed_calibrate(ctx, self.task, cfg, self.memo)
        bar = ctx.bar(len(self.tests), f"{name} eval {method} s{seed}")
        with Phase() as ev:
            sets = self.tests.adapted(result.model, normalize=cfg.normalize, bar=bar)
        bar.close()
        self.write(method, seed, sets, {"train": train.to_dict(), "eval": ev.to_dict()},
                   {"train_s": train.seconds, "eval_s": ev.seconds}, config=cfg.to_dict(),
                   training={"heldout_before": result.metrics.get("before", {}),
                             "heldout_after": result.metrics.get("after", {}),
                             "timings": result.timings, "history": result.history},
                   process={"workers": ctx.workers, "threads": torch.get_num_threads()})
        for key, seconds in ((f"{name} train", train.seconds), (f"{name} eval trained", ev.seconds)):
            ctx.timings[key] = ctx.timings.get(key, 0.0) + seconds
        del result
        free_memory()

    def write(self, method: str, seed: int, scored: dict[str, Any], memory: dict[str, Any], timing: dict[str, float],
              **extra: Any) -> None:
        """Write one (method, seed) result file atomically and log it."""
        ctx, task = self.ctx, self.task
        sets = {n: set_metrics(s, ctx.sizes.bootstrap) for n, s in scored.items()}
        record = {"task": task.name, "method": method, "seed": seed,
                  "fingerprint": ctx.fingerprint(task, method, ctx.config(task.name, method, seed) if method in TRAINED
                                                 else None),
                  "sets": sets, "questions": {n: questions_record(s) for n, s in scored.items()}, "timing": timing,
                  "memory": memory, **extra, "finished": _dt.datetime.now().isoformat(timespec="seconds")}
        write_json_atomic(result_path(ctx.runs, task.name, method, seed), record)
        cost = f"train {timing['train_s']:.0f}s, eval {timing['eval_s']:.0f}s, " if method in TRAINED else ""
        ctx.log(f"[{task.name}] {method}{f' seed {seed}' if method in TRAINED else ''}: written ({cost}"
                f"OOD mean ECE {np.mean([sets[n]['ece'] for n in task.ood]):.3f})")


def run_task(ctx: Ctx, task: Task) -> None:
    """Run every pending (method, seed) of a task, skipping finished results."""
    pending: list[tuple[str, int]] = []
    for method, seed in [(m, s) for s in range(ctx.sizes.seeds) for m in ctx.methods if s in ctx.seeds(m)]:
        path = result_path(ctx.runs, task.name, method, seed)
        cfg = ctx.config(task.name, method, seed) if method in TRAINED else None
        if read_result(path, ctx.fingerprint(task, method, cfg)) is not None:
            ctx.log(f"[{task.name}] {method} seed {seed}: skipped (finished result {path.relative_to(ctx.runs)})")
            continue
        if path.exists():
            ctx.log(f"[{task.name}] {method} seed {seed}: stale result (other settings), re-running")
        pending.append((method, seed))
    if not pending:
        return
    runner = Runner(ctx, task)
    phase = runner.base_pass()
    if baselines := {m for m, _ in pending if m in BASELINES}:
        runner.baselines(baselines, phase)
    jobs = sorted([j for j in pending if j[0] in TRAINED], key=lambda j: -STEP_COST.get(j[0], 1.0))  # longest first
    if not jobs:
        return
    with Phase() as prep:
        runner.prepare_training()
    ctx.timings[f"{task.name} training-set trunk"] = prep.seconds
    workers = min(ctx.workers, len(jobs)) if hasattr(os, "fork") else 1
    (ctx.runs / task.name).mkdir(parents=True, exist_ok=True)
    if workers > 1:
        ctx.log(f"[{task.name}] {len(jobs)} runs on {workers} forked workers")
    bar, t0 = ctx.bar(len(jobs), f"{task.name} runs"), time.perf_counter()

    def run(job: tuple[str, int], worker: int | None) -> None:
        if worker is not None:  # in a forked child: it shares the base model, trunk and encodings copy-on-write
            ctx.progress, ctx.log.worker = False, worker
        runner.trained(*job)

    failed, missing = run_forked(jobs, run, workers, finished=lambda j: result_path(ctx.runs, task.name, *j).is_file(),
                                 lock=lambda j: result_path(ctx.runs, task.name, *j).with_suffix(".lock"),
                                 progress=lambda n: bar.update(n - bar.n))
    bar.close()
    if workers > 1:
        ctx.timings[f"{task.name} trained runs ({workers} workers, wall)"] = time.perf_counter() - t0
    if failed or missing:
        ctx.log(f"[{task.name}] {failed} worker(s) failed; missing results: "
                + (", ".join(f"{m} seed {s}" for m, s in missing) or "none"))


# --------------------------------------------------------------------------------- search


def run_search(ctx: Ctx, tasks: dict[str, Task], hparams_out: Path) -> dict[str, Any]:
    """Choose each trained method's hyperparameters on in-domain selection data only."""
    chosen: dict[str, Any] = {"procedure": SEARCH_RULE, "grid": SEARCH_GRID, "mc": {}, "open": {}, "candidates": []}
    grid = {m: SEARCH_GRID[m][: 2 if ctx.sizes.name == "quick" else None] for m in ctx.methods if m in TRAINED}
    for name, task in tasks.items():
        memo = EncodingCache()
        sel = ctx.evaluator(name, {"select": task.select})
        base_m = set_metrics(sel.base()["select"], 0)
        ctx.log(f"[search/{name}] uncalibrated on the selection split ({len(task.select)}): "
                f"accuracy {base_m['accuracy']:.3f}, ECE {base_m['ece']:.3f}")
        for method, candidates in grid.items():
            rows = []
            for ci, cand in enumerate(candidates):
                cfg = ctx.config(name, method, 0, cand)
                path = ctx.runs / "search" / name / f"{method}-c{ci}.json"
                fp = fingerprint({"task": task.fingerprint(), "select": [r.id for r in task.select], "config": cfg.to_dict()})
                rec = read_result(path, fp)
                if rec is None:
                    ctx.log(f"[search/{name}] {method} candidate {ci} {cand}")
                    result, phase = _timed_calibrate(ctx, task, cfg, memo)
                    m = set_metrics(sel.adapted(result.model, normalize=cfg.normalize)["select"], 0)
                    rec = {"fingerprint": fp, "method": method, "candidate": cand, "metrics": m, "train_s": phase.seconds}
                    write_json_atomic(path, rec)
                    del result
                    free_memory()
                else:
                    ctx.log(f"[search/{name}] {method} candidate {ci}: skipped (finished)")
                rows.append(rec)
            # the library's selection rule (guard_accuracy of the method's config) picks the candidate
            best = rows[best_candidate([r["metrics"] for r in rows], base_m["accuracy"], ctx.config(name, method, 0))]
            chosen[name][method] = best["candidate"]
            for r in rows:
                chosen["candidates"].append({"task": name, "method": method, "candidate": r["candidate"],
                                             "accuracy": r["metrics"]["accuracy"], "ece": r["metrics"]["ece"],
                                             "chosen": r is best, "train_s": r["train_s"]})
            ctx.log(f"[search/{name}] {method}: chose {best['candidate']} (selection ECE {best['metrics']['ece']:.3f}, "
                    f"accuracy {best['metrics']['accuracy']:.3f})")
        chosen[f"{name}_uncalibrated"] = {"accuracy": base_m["accuracy"], "ece": base_m["ece"]}
    write_json_atomic(hparams_out, chosen)
    rows = [(c["task"], c["method"], f"`{json.dumps(c['candidate'])}`", f"{c['accuracy']:.3f}", f"{c['ece']:.3f}",
             "**yes**" if c["chosen"] else "") for c in chosen["candidates"]]
    lines = ["# Calibration benchmark: hyperparameter search", "", f"Rule: {SEARCH_RULE}", "",
             *markdown_table(("task", "method", "candidate", "selection accuracy", "selection ECE", "chosen"), rows)]
    write_text_atomic(hparams_out.with_suffix(".md"), "\n".join(lines) + "\n")
    ctx.log(f"wrote {hparams_out} and {hparams_out.with_suffix('.md')}")
    return chosen


# --------------------------------------------------------------------------------- report


class Aggregate(SeedResults):
    """Results of one task, all methods and seeds, with seed-averaged metrics and bootstrap CIs."""

    def __init__(self, ctx: Ctx, task: Task) -> None:
        self.task, self.ctx = task, ctx
        self.metrics = MC_METRICS if task.name == "mc" else OPEN_METRICS
        runs = {m: [r for s in ctx.seeds(m) if (r := read_result(result_path(ctx.runs, task.name, m, s)))]
                for m in ctx.methods}
        super().__init__(runs, lambda q: conf_correct(task.name, q), {n: len(r) for n, r in task.tests.items()},
                         max(ctx.sizes.bootstrap, 1))


def targets(mc: Aggregate | None, op: Aggregate | None) -> list[dict[str, Any]]:
    """The issue's targets for CALM (BOME and F2SA columns), with the measured numbers."""
    rows: list[dict[str, Any]] = []

    def add(name: str, limit: str, agg: Aggregate | None, needs: str,
            fn: Callable[[str], tuple[float | None, bool | None, str]]) -> None:
        row: dict[str, Any] = {"target": name, "limit": limit}
        for m in ("calm_bome", "calm_f2sa"):
            try:
                if agg is None or m not in agg.runs or needs not in agg.runs:
                    raise KeyError(m)
                value, ok, detail = fn(m)
            except (KeyError, ValueError, ZeroDivisionError, StopIteration):
                value, ok, detail = None, None, "missing results"
            row[m] = {"value": value, "pass": ok, "detail": detail}
        rows.append(row)

    if mc is not None:
        ood, ind = mc.task.ood, mc.task.in_domain

        def ratio(base: str, factor: float) -> Callable[[str], tuple[float | None, bool | None, str]]:
            def fn(m: str) -> tuple[float | None, bool | None, str]:
                c, b = mc.group_mean(m, ood, "ece"), mc.group_mean(base, ood, "ece")
                return c / b, c <= factor * b, f"CALM {c:.3f} vs {LABELS[base]} {b:.3f}"
            return fn

        def lower_than_ts(m: str) -> tuple[float | None, bool | None, str]:
            wins = sum(mc.mean(m, n, "ece") < mc.mean("temperature_scaling", n, "ece") for n in ood)
            return wins / len(ood), wins >= math.ceil(0.75 * len(ood)), f"{wins} of {len(ood)} sets"

        def acc_ratio(m: str) -> tuple[float | None, bool | None, str]:
            c, b = mc.group_mean(m, ood, "accuracy"), mc.group_mean("uncalibrated", ood, "accuracy")
            return c / b, c >= 0.95 * b, f"CALM {c:.3f} vs uncalibrated {b:.3f}"

        def worst_set(m: str) -> tuple[float | None, bool | None, str]:
            margins = {}
            for n in ood:
                low = mc.runs["uncalibrated"][0]["sets"][n].get("accuracy_ci_low")
                margins[n] = mc.mean(m, n, "accuracy") - (mc.mean("uncalibrated", n, "accuracy") if low is None else low)
            n = min(margins, key=margins.get)
            bad = [k for k, v in margins.items() if v < 0]
            return margins[n], not bad, (f"worst {n}: CALM {mc.mean(m, n, 'accuracy'):.3f} vs uncalibrated CI low "
                                         f"{mc.mean(m, n, 'accuracy') - margins[n]:.3f}" + (f"; below on {', '.join(bad)}" if bad else ""))

        def in_domain(m: str) -> tuple[float | None, bool | None, str]:
            c, b = mc.group_mean(m, ind, "ece"), mc.group_mean("temperature_scaling", ind, "ece")
            return c - b, c <= b + 0.01, f"CALM {c:.3f} vs temperature scaling {b:.3f}"

        add("MC OOD: mean conf-ECE / uncalibrated", "≤ 0.5", mc, "uncalibrated", ratio("uncalibrated", 0.5))
        add("MC OOD: mean conf-ECE / temperature scaling (carried over)", "≤ 0.8", mc, "temperature_scaling",
            ratio("temperature_scaling", 0.8))
        add("MC OOD: sets with conf-ECE below temperature scaling", "≥ 3/4", mc, "temperature_scaling", lower_than_ts)
        add("MC OOD: mean accuracy / uncalibrated", "≥ 0.95", mc, "uncalibrated", acc_ratio)
        add("MC OOD: no set's accuracy below the uncalibrated 95% bootstrap interval (min margin)", "≥ 0", mc,
            "uncalibrated", worst_set)
        add("MC in-domain: conf-ECE − temperature scaling", "≤ 0.01", mc, "temperature_scaling", in_domain)
    if op is not None:
        def open_ood(m: str) -> tuple[float | None, bool | None, str]:
            c, b = op.group_mean(m, op.task.ood, "ece"), op.group_mean("uncalibrated", op.task.ood, "ece")
            return 1 - c / b, c <= 0.8 * b, f"CALM {c:.3f} vs uncalibrated {b:.3f}"

        add("Open-ended OOD: conf-ECE reduction vs uncalibrated", "≥ 0.20", op, "uncalibrated", open_ood)
    for agg, tag in ((mc, "MC"), (op, "Open-ended")):
        if agg is None:
            continue

        def ablation(m: str, agg: Aggregate = agg) -> tuple[float | None, bool | None, str]:
            c, p = agg.group_mean(m, agg.task.ood, "ece"), agg.group_mean("confidence_penalty", agg.task.ood, "ece")
            return c - p, None, f"CALM {c:.3f} vs flat penalty {p:.3f} ({'CALM lower' if c < p else 'penalty lower or equal'})"

        add(f"{tag} OOD ablation: conf-ECE CALM − flat confidence penalty (info)", "-", agg, "confidence_penalty", ablation)
    return rows


def _target_table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| target | limit | CALM (BOME) | status | CALM (F2SA) | status |", "|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for m in ("calm_bome", "calm_f2sa"):
            c = r[m]
            cells += [f"{format_number(c['value'])} ({c['detail']})", verdict(c["pass"], c["value"] is not None)]
        out.append(f"| {r['target']} | {r['limit']} | " + " | ".join(cells) + " |")
    return out


def _task_tables(agg: Aggregate) -> list[str]:
    t, out = agg.task, []
    methods = [m for m in agg.ctx.methods if m in agg.runs]
    for title, names in (("out-of-domain average", t.ood), ("in-domain average", t.in_domain)):
        rows = [(LABELS[m], len(agg.runs[m]), *(agg.cell(m, names, k, 3 if k == "ece" else None) for k in agg.metrics))
                for m in methods]
        out += [f"**{title}** ({len(names)} sets: {', '.join(names)}); mean ± sd over seeds, conf-ECE with the "
                "bootstrap 95% interval of the seed-mean", "",
                *markdown_table(("method", "seeds", *(METRIC_NAMES[k] for k in agg.metrics)), rows), ""]
    for metric, title in (("ece", "conf-ECE per set (mean ± sd [bootstrap 95% interval of the seed-mean])"),
                          ("accuracy", "accuracy per set (mean ± sd)")):
        rows = [(f"{n} ({'ID' if n in t.in_domain else 'OOD'})", *(agg.cell(m, [n], metric, 2 if metric == "ece" else None)
                                                                  for m in methods)) for n in (*t.in_domain, *t.ood)]
        out += [f"**{title}**", "", *markdown_table(("set", *(LABELS[m] for m in methods)), rows), ""]
    return out


def _cost_table(aggs: dict[str, Aggregate]) -> list[str]:
    out = ["| task | method | runs | train s | eval s | peak RSS train MB (over start) | peak RSS eval MB (over start) |",
           "|---|---|---|---|---|---|---|"]
    for name, agg in aggs.items():
        for m in [m for m in agg.ctx.methods if m in agg.runs]:
            runs = agg.runs[m]
            tr = [r["timing"]["train_s"] for r in runs]
            ev = [r["timing"]["eval_s"] for r in runs]

            def mem(phase: str, runs: list[dict[str, Any]] = runs) -> str:
                recs = [r["memory"][phase] for r in runs if phase in r.get("memory", {})]
                if not recs:
                    return "-"
                return f"{max(x['peak_rss_mb'] for x in recs):.0f} ({max(x['peak_over_start_mb'] for x in recs):.0f})"

            shared = " (shared pass)" if m in BASELINES else ""
            out.append(f"| {name} | {LABELS[m]} | {len(runs)} | {mean_sd(tr, 1)} | {mean_sd(ev, 1)}{shared} | "
                       f"{mem('train')} | {mem('eval')} |")
    return out


def _training_table(aggs: dict[str, Aggregate]) -> list[str]:
    out = ["| task | method | selected step per seed | held-out ECE before → after | held-out accuracy before → after | stopped early |",
           "|---|---|---|---|---|---|"]
    for name, agg in aggs.items():
        for m in [m for m in agg.ctx.methods if m in TRAINED and m in agg.runs]:
            runs = [r["training"] for r in agg.runs[m]]
            after = [t["heldout_after"] for t in runs]
            before = runs[0]["heldout_before"]
            steps = ", ".join(str(int(a.get("selected_step", -1))) for a in after)
            out.append(f"| {name} | {LABELS[m]} | {steps} | {format_number(before.get('ece'))} → {mean_sd([a.get('ece') for a in after])} | "
                       f"{format_number(before.get('accuracy'))} → {mean_sd([a.get('accuracy') for a in after])} | "
                       f"{sum(bool(a.get('stopped_early')) for a in after)} of {len(after)} |")
    return out


def _plots(ctx: Ctx, aggs: dict[str, Aggregate], plot_dir: Path) -> list[str]:
    files = []
    for name, agg in aggs.items():
        for m in [m for m in ctx.methods if m in agg.runs]:
            panels = []
            for title, sets in (("out-of-domain pool", agg.task.ood), ("in-domain pool", agg.task.in_domain)):
                c, k = agg.pooled(m, sets)
                panels.append((f"{title}\nn = {len(c)}, accuracy {k.mean():.3f}, ECE {ece(c, k, 10):.3f}",
                               reliability_bins(c, k, n_bins=10).to_dict()))
            path = plot_dir / f"reliability_{name}_{m}.png"
            seeds = len(agg.runs[m])
            plot_reliability(panels, path, title=f"{TASK_TITLES[name]}: {LABELS[m]}"
                             + (f" (pooled over {seeds} seeds)" if seeds > 1 else ""))
            files.append(path)
    return files


def write_report(ctx: Ctx, tasks: dict[str, Task], command: str, elapsed: float) -> str:
    aggs = {name: Aggregate(ctx, task) for name, task in tasks.items()}
    plot_dir = ctx.out / "calibration"
    files = _plots(ctx, aggs, plot_dir) if ctx.plots else []
    meta = machine_info(torch.get_num_threads())
    s = ctx.sizes
    compute = sum(r["timing"]["train_s"] + (0 if r["method"] == "temperature_scaling" else r["timing"]["eval_s"])
                  for agg in aggs.values() for runs in agg.runs.values() for r in runs)
    guard = f"{ctx.config('mc', 'lora_ce', 0).guard_accuracy:.0%}"
    lines = [
        "# Calibration benchmark: CALM against post-hoc and training-time baselines", "",
        *provenance_lines(command, meta, mode=s.name, elapsed_s=elapsed),
        f"- Compute recorded in the result files: {compute / 60:.1f} min",
        f"- Model: `{s.model}`; LoRA rank {s.lora_rank} (alpha {2 * s.lora_rank}) on q_proj/v_proj of the top {s.top_layers} "
        f"of {ctx.n_layers} layers; {s.seeds} seeds per trained method; the same data, {s.steps} steps (open-ended: "
        f"{ctx.steps('open')}) of batch {s.batch_size} (held-out batch {s.batch_size}) and the library's selection rule (lowest "
        f"held-out ECE among evaluations whose held-out accuracy is at least {guard} of the initial one) for every method.",
        f"- Hyperparameters: {ctx.hparams_source}.",
        f"- Per-(method, seed) results: `{_rel(ctx.runs)}/<task>/<method>-seed<k>.json` (resumable).", "",
        "## Targets", "", "CALM is `calm_bome`; the F2SA column is the other solver. Means over seeds; out-of-domain "
        "(OOD) means weigh the sets equally.", "", *_target_table(targets(aggs.get("mc"), aggs.get("open"))), "",
    ]
    for name, agg in aggs.items():
        how = ("Cloze prompt, options scored by summed token log-probability, softmax over options" if name == "mc" else
               f"Greedy answers up to {s.max_new_tokens} tokens, SQuAD exact match, confidence = mean token probability; "
               "temperature on the answer-token logits fitted on the held-out greedy answers")
        lines += [f"## {TASK_TITLES[name]}", "", f"{agg.task.description} {how}. Test sets: "
                  + "; ".join(f"{k}: {v}" for k, v in agg.task.sources.items()) + ".", ""]
        temps = [r.get("temperature") for r in agg.runs.get("temperature_scaling", [])]
        lines += [f"Fitted temperature: T = {temps[0]:.3f}.", ""] if temps and temps[0] else []
        lines += _task_tables(agg)
    lines += ["## Training: what the selection rule kept", "", "Selected step 0 means the run deployed the base model "
              "unchanged; open-ended held-out metrics are the library's teacher-forced proxy.", "", *_training_table(aggs), "",
              "## Wall time and peak memory per method", "", "Seconds per run (mean ± sd over seeds), training and "
              "evaluation; peak RSS of the phase (`VmHWM` after a reset), max over seeds, in parentheses above the RSS at "
              f"the phase start. Trained runs in {ctx.workers} forked worker(s), {torch.get_num_threads()} thread(s) each.",
              "", *_cost_table(aggs), ""]
    if ctx.timings:
        lines += ["Phases of this invocation (s): " + ", ".join(f"{k} {v:.0f}" for k, v in ctx.timings.items()), ""]
    lines += ["## Reliability diagrams", "", "Per method and task: the out-of-domain and in-domain pools (all seeds).", "",
              *[f"![{f.stem}]({_rel(f, ctx.out)})" for f in files], "", "## Hyperparameters", "",
              f"Chosen on in-domain data only (`--search` writes `{_rel(DEFAULT_HPARAMS)}`). Rule: {SEARCH_RULE}", ""]
    for name in tasks:
        for m in [m for m in ctx.methods if m in TRAINED]:
            cfg = ctx.config(name, m, 0).to_dict()
            lines.append(f"- {name} / {LABELS[m]}: `{json.dumps({k: cfg[k] for k in RELEVANT[m]})}`")
    lines.append("")
    text = "\n".join(lines)
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / "calibration.md").write_text(text)
    return text


def _rel(path: Path, base: Path = ROOT) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path)


# ----------------------------------------------------------------------------------- main


def load_hparams(path: Path | None) -> tuple[dict[str, Any], str]:
    if path is not None and path.is_file():
        data = json.loads(path.read_text())
        searched = [k for k in ("mc", "open") if data.get(k)]
        unsearched = [k for k in ("mc", "open") if not data.get(k)]
        source = f"from the in-domain search `{_rel(path)}` ({', '.join(searched) or 'no task'})"
        if unsearched:
            source += f"; {', '.join(unsearched)}: the built-in defaults (not searched)"
        return {k: data.get(k, {}) for k in ("mc", "open")}, source
    return {}, "the built-in defaults (the demo's settings; no search result found)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny random model and data, seconds (CI)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="directory of the real data (default ../shared/data; --quick: built-in data unless given)")
    p.add_argument("--out", type=Path, default=None,
                   help="report directory: calibration.md, calibration/*.png, calibration_runs/ (default "
                        "benchmarks/results; --quick: a temporary directory)")
    p.add_argument("--results-dir", type=Path, default=None, help="per-run JSON files (default OUT/calibration_runs)")
    p.add_argument("--tasks", default="mc,open", help="comma-separated: mc, open")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: faster than 2 on a busy 2-core machine; try 2 on a quiet one)")
    p.add_argument("--hparams", type=Path, default=None,
                   help=f"search result to read (main run) or write (--search); default {_rel(DEFAULT_HPARAMS)}")
    p.add_argument("--search", action="store_true", help="choose hyperparameters on in-domain data only, then exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-plots", action="store_true", help="skip the reliability diagrams")
    p.add_argument("--workers", type=int, default=None,
                   help="forked processes for the trained runs, one torch thread each (default 2; --quick: 1)")
    add_dataclass_flags(p.add_argument_group("sizes (default: the full run's; --quick: its own)"), Sizes,
                        exclude=("name",))
    return p.parse_args(argv)


def build_ctx(args: argparse.Namespace) -> Ctx:
    sizes = replace(QUICK if args.quick else FULL, **dataclass_overrides(args, Sizes))
    if args.quick:
        out = args.out or Path(tempfile.mkdtemp(prefix="calibration_bench_quick_"))
        data_dir = args.data_dir
    else:
        out = args.out or RESULTS
        data_dir = args.data_dir or DEFAULT_DATA
    if data_dir is not None and not data_dir.is_dir():
        raise SystemExit(f"data directory {data_dir} not found (pass --data-dir)")
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    bad = [m for m in methods if m not in METHODS] + [t for t in tasks if t not in ("mc", "open")]
    if bad:
        raise SystemExit(f"unknown method(s)/task(s): {bad}")
    hp_path = args.hparams if args.hparams is not None else (None if args.quick else DEFAULT_HPARAMS)
    hparams, source = load_hparams(None if args.search else hp_path)
    return Ctx(sizes, data_dir, out, args.results_dir or out / "calibration_runs", methods, tasks, hparams, source,
               progress=not args.no_progress, plots=not args.no_plots,
               workers=args.workers if args.workers is not None else (1 if args.quick else 2))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _main(args, argv)
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace, argv: list[str]) -> int:
    ctx = build_ctx(args)
    command = "python benchmarks/calibration_bench.py" + ("" if not argv else " " + " ".join(argv))
    t_start = time.perf_counter()
    ctx.log(f"calibration benchmark ({ctx.sizes.name}): model {ctx.sizes.model}, data "
            f"{ctx.data_dir or 'built-in'}, results in {ctx.runs}")
    ctx.load_model()
    tasks = {}
    for name in ctx.tasks:
        tasks[name] = (mc_task if name == "mc" else open_task)(ctx.data_dir, ctx.sizes)
        t = tasks[name]
        ctx.log(f"[{name}] train {len(t.train)}, held-out {len(t.heldout)}, tests "
                + ", ".join(f"{k} {len(v)}" for k, v in t.tests.items()))
    if args.search:
        run_search(ctx, tasks, args.hparams or (ctx.out / "calibration_hparams.json" if args.quick else DEFAULT_HPARAMS))
        return 0
    for task in tasks.values():
        run_task(ctx, task)
    elapsed = time.perf_counter() - t_start
    write_report(ctx, tasks, command, elapsed)
    ctx.log(f"wrote {ctx.out / 'calibration.md'} ({elapsed / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
