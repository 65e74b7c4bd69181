#!/usr/bin/env python
"""Calibration benchmark v2: every method on the same data, both regimes of unlabelled inputs, in
and out of domain, multiple choice and open-ended QA.

Usage (from the repository root, after ``make setup``)::

    .venv/bin/python benchmarks/calibration_bench.py                  # full run, SmolLM2-135M-Instruct,
                                                                      # data from ../shared/data; writes
                                                                      # benchmarks/results/calibration.md
    .venv/bin/python benchmarks/calibration_bench.py --quick          # random-init tiny model, built-in
                                                                      # data, seconds; report to a temp dir
    .venv/bin/python benchmarks/calibration_bench.py --search --hparams hp.json   # hyperparameter search
                                                                      # on in-domain data only
    .venv/bin/python benchmarks/calibration_bench.py --mc-test 100 --steps 40     # other sizes (a flag
                                                                      # for every field of Sizes)

Trained runs go to ``--workers 2`` forked processes, one torch thread each (on a busy 2-core
machine two threads were slower than one); the base passes use ``--base-threads`` (default 2).

Resuming: every (task, method, seed) result is one JSON file under the results directory
(``calibration_runs/<task>/<method>-seed<k>.json``), written atomically when finished; re-running
skips every result whose settings fingerprint matches and runs the missing ones (delete a file to
re-run it).

Protocol. Multiple choice (option likelihood, cloze prompt, summed scores as lm-eval's ``acc``;
every table is repeated under per-character scores, lm-eval's ``acc_norm``, with its own
temperature fits): trained on ARC-Easy + ARC-Challenge train; the labelled in-domain held-out split
(ARC-Easy + ARC-Challenge dev) drives model selection, the accuracy guard and every in-domain
temperature fit; tested in domain on ARC test and out of domain on OpenBookQA, QASC,
CommonsenseQA, the four MMLU groups and OpenTriviaQA categories. Upper-level (unlabelled) inputs:
regime A, other ARC dev questions (the training domain); regime B, prompts of the out-of-domain
sets, disjoint from their test questions (the deployment traffic). Open-ended QA (greedy, few-shot
short-answer prompt ``Q: ... A:`` with newline stop, mean token probability, exact match) trained on
NQ-open dev (one target per alias), tested on NQ-open, WebQuestions and SelfAware (TriviaQA part),
regime A only. Methods: uncalibrated; temperature scaling fitted in domain and carried everywhere;
an oracle temperature chosen on each test set itself for the lowest conf-ECE (the best any single
temperature could do there, not a competitor); LoRA CE; LoRA CE followed by in-domain temperature scaling; label smoothing;
the flat confidence penalty (entropy on the same unlabelled inputs as CALM); CALM with BOME and
with F2SA. Same data, steps, batch, LoRA layers (top ``k``) and selection rule for every trained
method.

Speed: every trained method adapts only the top ``k`` layers, so one full-model pass gives the
uncalibrated predictions and the frozen trunk, and each trained model runs only its top layers
(``llm_calib.calm.fast_eval``); each question is scored once per model, summed and per-character
scores come from the same pass. Wall time and peak RSS (``VmHWM`` after resetting the high-water
mark) are measured per run for training and evaluation separately.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import gc
import json
import math
import os
import random
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from harness.evaluation import split_items, summarize_scored
from harness.flags import add_dataclass_flags, dataclass_overrides
from harness.flat_config import config_from_flat, flat_config
from harness.profiling import Phase
from harness.report import (
    format_number,
    machine_info,
    markdown_table,
    mean_sd,
    provenance_lines,
    verdict,
)
from harness.selection import best_candidate
from harness.sweep import (
    SeedResults,
    SweepLog,
    fingerprint,
    read_result,
    run_forked,
    write_json_atomic,
)

from llm_calib.calm.encoding import EncodingCache
from llm_calib.calm.fast_eval import (
    SharedTrunkEval,
    fill_trunk_caches,
    open_ended_set,
)
from llm_calib.calm.run import ResolvedRun, resolve_run
from llm_calib.calm.trainer import calibrate_run
from llm_calib.confidence.temperature import correctness_log_loss
from llm_calib.config.calibration import CalibrationConfig, LoraSettings
from llm_calib.data import (
    BUILTIN_DOMAINS,
    OpenQA,
    builtin_multiple_choice,
    builtin_open_questions,
    load,
)
from llm_calib.engine.decode import GenOut
from llm_calib.evaluation.report import plot_reliability
from llm_calib.files.atomic import write_text_atomic
from llm_calib.metrics.calibration import confidence_correct, ece, reliability_bins
from llm_calib.metrics.temperature import fit_temperature
from llm_calib.models import free_memory, tiny_random_model
from llm_calib.models import load as load_model
from llm_calib.prompts.templates import continuation_text
from llm_calib.scoring.base import ScoredSet

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_DATA = ROOT.parent / "shared" / "data"
ALIAS = "smollm2-135m-instruct"

BASELINES = ("uncalibrated", "temperature_scaling", "oracle_temperature")
# trained method -> (objective, solver, regime of its unlabelled inputs; None: it uses none)
TRAINED: dict[str, tuple[str, str, str | None]] = {
    "lora_ce": ("lora_ce", "bome", None),
    "label_smoothing": ("label_smoothing", "bome", None),
    "confidence_penalty": ("confidence_penalty", "bome", "A"),
    "calm_bome": ("calm", "bome", "A"),
    "calm_f2sa": ("calm", "f2sa", "A"),
    "confidence_penalty_B": ("confidence_penalty", "bome", "B"),
    "calm_bome_B": ("calm", "bome", "B"),
    "calm_f2sa_B": ("calm", "f2sa", "B"),
    "lora_ce_char": ("lora_ce", "bome", None),
    "calm_bome_char": ("calm", "bome", "A"),
}
# trained method -> the option-score convention it is trained and selected under (others: summed scores); its
# results are scored like every run (summed, and per-character from the same passes)
TRAINED_NORMALIZE = {"lora_ce_char": "char", "calm_bome_char": "char"}
# derived method -> its source run, which writes it: a temperature fitted in domain on the trained model's held-out
# scores (per convention) and carried to every test set (train-time + post-hoc)
DERIVED = {"lora_ce_ts": "lora_ce", "calm_bome_ts": "calm_bome", "calm_bome_B_ts": "calm_bome_B",
           "lora_ce_char_ts": "lora_ce_char", "calm_bome_char_ts": "calm_bome_char"}
CHAR_TRAINED = ("lora_ce_char", "lora_ce_char_ts", "calm_bome_char", "calm_bome_char_ts")
METHODS = ("uncalibrated", "temperature_scaling", "oracle_temperature", "lora_ce", "lora_ce_ts", "label_smoothing",
           "confidence_penalty", "calm_bome", "calm_bome_ts", "calm_f2sa", "confidence_penalty_B", "calm_bome_B",
           "calm_bome_B_ts", "calm_f2sa_B", *CHAR_TRAINED)
# CALM with F2SA in regime B is available (--methods) but not run by default: it is the most expensive
# method (about 6 CE steps per step) and kept step 0 in the in-domain search.
DEFAULT_METHODS = tuple(m for m in METHODS if m != "calm_f2sa_B")
MULTI_SEED = frozenset({"lora_ce", "lora_ce_ts", "confidence_penalty", "calm_bome", "calm_bome_ts", "confidence_penalty_B",
                        "calm_bome_B", "calm_bome_B_ts", *CHAR_TRAINED})
SHARED = ("uncalibrated", "temperature_scaling", "oracle_temperature", "lora_ce", "lora_ce_ts", "label_smoothing")
REGIME_METHODS = {"A": (*SHARED, "confidence_penalty", "calm_bome", "calm_bome_ts", "calm_f2sa"),
                  "B": (*SHARED, "confidence_penalty_B", "calm_bome_B", "calm_bome_B_ts", "calm_f2sa_B")}
CALM_OF = {"A": ("calm_bome", "calm_f2sa"), "B": ("calm_bome_B", "calm_f2sa_B")}
# the v3 target columns: CALM + T and the LoRA CE + T it is compared with (A_char: both trained per-character)
CALM_TS_OF = {"A": "calm_bome_ts", "B": "calm_bome_B_ts", "A_char": "calm_bome_char_ts"}
LORA_TS_OF = {"A": "lora_ce_ts", "B": "lora_ce_ts", "A_char": "lora_ce_char_ts"}
PENALTY_OF = {"A": "confidence_penalty", "B": "confidence_penalty_B"}
OPEN_SKIPS = frozenset({"confidence_penalty_B", "calm_bome_B", "calm_f2sa_B", "lora_ce_ts", "calm_bome_ts",
                        "calm_bome_B_ts", *CHAR_TRAINED})
LABELS = {
    "uncalibrated": "uncalibrated",
    "temperature_scaling": "temperature scaling",
    "oracle_temperature": "oracle temperature (per test set)",
    "lora_ce": "LoRA fine-tuning (CE)",
    "lora_ce_ts": "LoRA CE + temperature scaling",
    "label_smoothing": "label smoothing",
    "confidence_penalty": "flat confidence penalty",
    "calm_bome": "CALM (BOME)",
    "calm_bome_ts": "CALM (BOME) + temperature scaling",
    "calm_f2sa": "CALM (F2SA)",
    "confidence_penalty_B": "flat confidence penalty (B)",
    "calm_bome_B": "CALM (BOME, B)",
    "calm_bome_B_ts": "CALM (BOME, B) + temperature scaling",
    "calm_f2sa_B": "CALM (F2SA, B)",
    "lora_ce_char": "LoRA CE, trained per-character",
    "lora_ce_char_ts": "LoRA CE, trained per-character + temperature scaling",
    "calm_bome_char": "CALM (BOME), trained per-character",
    "calm_bome_char_ts": "CALM (BOME), trained per-character + temperature scaling",
}
TASK_TITLES = {"mc": "Multiple choice (option likelihood)", "open": "Open-ended QA (few-shot, greedy, mean token probability)"}
CONVENTIONS = {"sum": "summed option log-likelihood (lm-eval `acc`)", "char": "per-character option log-likelihood (lm-eval `acc_norm`)"}
CONFIDENCE = {"mc": "mean top option probability", "open": "mean token probability of the greedy answer"}
OPEN_NONTRIVIAL = 0.05  # mean out-of-domain exact match the open-ended targets require

# CALM's settings on top of CalibrationConfig's defaults: BOME whose lower level binds (5 inner SGD
# steps of 0.05, gradient barrier) and an option-temperature λ, as searched in calm_search.md.
_CALM = {"adjustment": "option_temperature", "inner_steps": 5, "inner_lr": 0.05, "bome_barrier": "gradient"}
# Hyperparameters when no --hparams file is given: multiple choice from the in-domain search of
# benchmarks/results/calm_search.md (60 steps of 8, the lowest held-out ECE among the settings
# tried per method and regime); open-ended and label smoothing were not searched at this budget.
BUILTIN_HPARAMS: dict[str, dict[str, dict[str, Any]]] = {
    "mc": {
        "lora_ce": {"lr": 5e-3, "output_scale_lr": 0.1},
        "label_smoothing": {"lr": 5e-3, "output_scale_lr": 0.1, "label_smoothing": 0.1},
        "confidence_penalty": {"lr": 5e-3, "output_scale_lr": 0.1, "penalty_beta": 0.5},
        "confidence_penalty_B": {"lr": 5e-3, "output_scale_lr": 0.1, "penalty_beta": 2.0},
        "calm_bome": {**_CALM, "lr": 5e-3, "output_scale_lr": 0.1, "bome_eta": 0.5},
        "calm_bome_B": {**_CALM, "lr": 5e-3, "output_scale_lr": 0.1, "bome_eta": 0.5},
        "calm_f2sa": {"adjustment": "option_temperature", "inner_steps": 1, "lr": 1e-3, "f2sa_sigma": 0.1},
        "calm_f2sa_B": {"adjustment": "option_temperature", "inner_steps": 1, "lr": 1e-3, "f2sa_sigma": 0.1},
    },
    "open": {
        "lora_ce": {"lr": 1e-3},
        "label_smoothing": {"lr": 1e-3, "label_smoothing": 0.1},
        "confidence_penalty": {"lr": 1e-3, "penalty_beta": 0.5},
        "calm_bome": {"lr": 1e-3, "inner_lr": 0.1},
        "calm_f2sa": {"lr": 1e-3, "f2sa_sigma": 0.1},
    },
}
HPARAMS_SOURCE = ("multiple choice: the in-domain search `benchmarks/results/calm_search.md` (held-out ECE at 60 steps; "
                  "label smoothing and F2SA as there, not searched further); open-ended: the built-in defaults "
                  "(not searched)")

# The --search grid: a few settings per method, each trained with seed 0 and scored on the in-domain
# held-out split (never on a test set).
SEARCH_GRID: dict[str, list[dict[str, Any]]] = {
    "lora_ce": [{"lr": lr} for lr in (1e-3, 5e-3)],
    "label_smoothing": [{"lr": 5e-3, "label_smoothing": e} for e in (0.1, 0.3)],
    "confidence_penalty": [{"lr": 5e-3, "penalty_beta": b} for b in (0.5, 2.0)],
    "calm_bome": [{"lr": lr, "bome_eta": eta} for lr in (1e-3, 5e-3) for eta in (0.5, 2.0)],
    "calm_f2sa": [{"lr": 1e-3, "f2sa_sigma": s} for s in (0.1, 0.01)],
}
SEARCH_RULE = (
    "each candidate is trained with seed 0 on the training split, with the run's step budget, and "
    "scored on the in-domain held-out split; among the candidates whose held-out accuracy is at least "
    "95% of the uncalibrated model's, the one with the lowest conf-ECE (10 bins) wins (if none is, "
    "the most accurate one). No test set is scored."
)

RELEVANT = {
    "lora_ce": ("lr", "output_scale", "output_scale_lr"),
    "label_smoothing": ("lr", "label_smoothing", "output_scale", "output_scale_lr"),
    "confidence_penalty": ("lr", "penalty_beta", "output_scale", "output_scale_lr"),
    "calm_bome": ("lr", "lam_lr", "adjustment", "inner_steps", "inner_lr", "bome_eta", "bome_barrier", "output_scale",
                  "output_scale_lr"),
    "calm_f2sa": ("lr", "lam_lr", "adjustment", "inner_steps", "f2sa_sigma", "output_scale", "output_scale_lr"),
}

MC_METRICS = ("accuracy", "mean_confidence", "ece", "adaptive_ece", "classwise_ece", "brier", "nll", "auroc")
OPEN_METRICS = ("accuracy", "mean_confidence", "ece", "adaptive_ece", "brier", "nll", "auroc")
METRIC_NAMES = {
    "accuracy": "accuracy", "mean_confidence": "confidence", "ece": "conf-ECE", "adaptive_ece": "adaptive ECE",
    "classwise_ece": "class-wise ECE", "brier": "Brier", "nll": "NLL", "auroc": "AUROC",
}
CHANCE_AUROC = 0.02  # a method's AUROC within this of 0.5 "falls to chance" (flag)
NEAR_UNIFORM = 0.02  # mean confidence within this of the mean 1/K: near-uniform predictions (flag)
STEP_COST = {"confidence_penalty": 1.2, "calm_bome": 2.4, "calm_f2sa": 6.0}  # per step, CE = 1: longest runs first
TEMPERATURE_GRID = np.exp(np.linspace(np.log(0.25), np.log(64.0), 41))  # open-ended TS (T = 1 included)


def fit_open_temperature(records: Sequence[OpenQA], outs: Sequence[GenOut], grid: Sequence[float]) -> tuple[float, int]:
    """``(T, index)``: the grid temperature minimising the log-loss of correctness of open answers' mean token
    probability (:func:`llm_calib.confidence.temperature.correctness_log_loss`; this benchmark's trunk-cached
    answers carry probabilities on the grid only, where the library's fit reads any T).

    Raises:
        ValueError: an answer's grid probabilities do not match ``grid``.

    Example:
        >>> recs = [OpenQA("q?", ("a",), "d", "0"), OpenQA("q?", ("a",), "d", "1")]
        >>> p = np.array([[0.99, 0.6]])
        >>> fit_open_temperature(recs, [GenOut("a", (1,), (0.9,), p), GenOut("b", (1,), (0.9,), p)], [1.0, 2.0])
        (2.0, 1)
    """
    grid = np.asarray(grid, dtype=np.float64)
    if any(o.temp_probs is None or o.temp_probs.shape[1] != len(grid) for o in outs):
        raise ValueError(f"every answer needs grid probabilities for the {len(grid)} grid temperatures")
    loss = correctness_log_loss(open_ended_set(records, outs).correct, [o.temp_probs for o in outs])
    g = int(np.argmin(loss))
    return float(grid[g]), g


def base_method(method: str) -> str:
    """The method a regime-B or per-character variant shares its hyperparameter search key and step cost with."""
    return method.removesuffix("_B").removesuffix("_char")

# ----------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Sizes:
    """Sizes and budgets of one mode; every field has its flag (``--mc-test 200``).

    Attributes:
        name: the mode.
        model: a model name for ``llm_calib.models.load``, or ``tiny`` (``tiny_random_model``).
        seeds: seeds of CALM (BOME), the flat penalty and LoRA CE (and its temperature row).
        other_seeds: seeds of the other trained methods (label smoothing, CALM with F2SA).
        top_layers: LoRA on the top k decoder layers.
        lora_rank: LoRA rank (alpha = 2 rank).
        mc_train, mc_heldout, mc_unlabeled, mc_test: MC questions: training (ARC-Easy + ARC-Challenge
            train, half each), labelled in-domain held-out (ARC-Easy + ARC-Challenge dev, 3:2:
            selection, accuracy guard, temperature fits), unlabelled upper-level inputs per regime,
            per test set.
        open_train, open_heldout, open_unlabeled, open_test: the same for open questions (NQ-open dev).
        open_fewshot: solved examples (from the training split) in the open-ended prompt (0: the
            chat prompt).
        steps: training steps.
        open_steps: training steps of the open-ended task (null: ``steps``).
        batch_size: training (and upper-level) batch.
        eval_every: held-out evaluation every this many steps (and at step 0 and the end).
        eval_batch_size, gen_batch_size: questions per scoring / generation batch.
        max_new_tokens: greedy answer budget.
        bootstrap: bootstrap resamples.
        builtin_per_domain: built-in questions per domain (no data directory).
    """

    name: str
    model: str = ALIAS
    seeds: int = 3
    other_seeds: int = 1
    top_layers: int = 6
    lora_rank: int = 8
    mc_train: int = 400
    mc_heldout: int = 500
    mc_unlabeled: int = 300
    mc_test: int = 200
    open_train: int = 400
    open_heldout: int = 200
    open_unlabeled: int = 200
    open_test: int = 150
    open_fewshot: int = 5
    steps: int = 60
    open_steps: int | None = None
    batch_size: int = 8
    eval_every: int = 20
    eval_batch_size: int = 16
    gen_batch_size: int = 16
    max_new_tokens: int = 10
    bootstrap: int = 1000
    builtin_per_domain: int = 30


FULL = Sizes("full")
QUICK = Sizes(
    "quick", model="tiny", seeds=2, other_seeds=1, top_layers=1, lora_rank=2, mc_train=12, mc_heldout=8,
    mc_unlabeled=6, mc_test=8, open_train=8, open_heldout=6, open_unlabeled=4, open_test=8, open_fewshot=2, steps=3,
    batch_size=4, eval_every=3, eval_batch_size=8, gen_batch_size=8, max_new_tokens=4, bootstrap=50,
    builtin_per_domain=30,
)

# the 13 out-of-domain multiple-choice sets of the v2 protocol (the v3 targets' "13 sets")
V2_OOD = ("openbookqa", "qasc", "commonsenseqa", "mmlu_stem", "mmlu_humanities", "mmlu_social_sciences", "mmlu_other",
          "otqa_geography", "otqa_animals", "otqa_science_technology", "otqa_history", "otqa_literature",
          "otqa_religion_faith")
OTQA_CATEGORIES = ("geography", "animals", "science-technology", "history", "literature", "religion-faith")
# v3: the OpenTriviaQA categories outside v2 where the uncalibrated model's accuracy interval lies above
# chance under summed scores, measured on questions the benchmark never tests (benchmarks/results/ood_pilot.md)
OTQA_ABOVE_CHANCE = ("humanities", "newest", "rated")


# --------------------------------------------------------------------------------------- data


@dataclass
class Task:
    """One benchmark task: training, labelled held-out, unlabelled (per regime) and test splits."""

    name: str  # "mc" or "open"
    train: list[Any]
    heldout: list[Any]
    unlabeled: dict[str, list[Any]]
    tests: dict[str, list[Any]]
    in_domain: tuple[str, ...]
    ood: tuple[str, ...]
    sources: dict[str, str] = field(default_factory=dict)
    description: str = ""
    config_fields: dict[str, Any] = field(default_factory=dict)  # prompt settings every config of the task gets

    def fingerprint(self) -> str:
        parts = {k: [f"{r.domain}/{r.id}" for r in v] for k, v in
                 (("train", self.train), ("heldout", self.heldout), *self.tests.items(),
                  *((f"unlabeled_{g}", u) for g, u in self.unlabeled.items()))}
        return fingerprint({"records": parts, "fields": self.config_fields})


def _regime_b_pool(pools: dict[str, list[Any]], n: int) -> list[Any]:
    """``n`` target-domain prompts drawn evenly from the out-of-domain sets' spare questions."""
    per = math.ceil(n / max(len(pools), 1))
    picked = [r for name, rest in pools.items() for r in random.Random(f"B:{name}").sample(rest, min(per, len(rest)))]
    return split_items(picked, [min(n, len(picked))], seed=2)[0]


def mc_task(data_dir: Path | None, sizes: Sizes) -> Task:
    """The multiple-choice task: real data from ``data_dir``, or the built-in generated set."""
    half = sizes.mc_train // 2
    if data_dir is None:
        by = {d: builtin_multiple_choice(n_per_domain=sizes.builtin_per_domain, seed=0, domains=[d]) for d in BUILTIN_DOMAINS}
        a_train, a_held, a_test = split_items(by["arithmetic"], [half, sizes.mc_heldout, sizes.mc_test])
        u_train, u_unl, u_test = split_items(by["unit_conversion"], [sizes.mc_train - half, sizes.mc_unlabeled, sizes.mc_test])
        tests = {"arithmetic": a_test, "unit_conversion": u_test}
        ood = ("calendar", "capitals", "chemical_symbols")
        spare = {}
        for d in ood:
            tests[d], spare[d] = split_items(by[d], [sizes.mc_test, len(by[d]) - sizes.mc_test])
        src = {k: f"`builtin:{k}` ({len(v)})" for k, v in tests.items()}
        desc = (f"Built-in generated questions. Training: {len(a_train) + len(u_train)} arithmetic and unit-conversion "
                f"questions; held-out: {len(a_held)} arithmetic questions.")
        unl = {"A": u_unl, "B": _regime_b_pool(spare, sizes.mc_unlabeled)}
        return Task("mc", a_train + u_train, a_held, unl, tests, ("arithmetic", "unit_conversion"), ood, src, desc)
    D = str(data_dir)
    train = load(f"arc_easy:{D}:train", limit=half).records + load(f"arc_challenge:{D}:train", limit=sizes.mc_train - half).records
    easy, chal = load(f"arc_easy:{D}:dev").records, load(f"arc_challenge:{D}:dev").records
    n_easy = round(0.6 * sizes.mc_heldout)
    held_e, rest_e = split_items(easy, [n_easy, len(easy) - n_easy])
    held_c, rest_c = split_items(chal, [sizes.mc_heldout - n_easy, len(chal) - sizes.mc_heldout + n_easy])
    unl_a = split_items(rest_e + rest_c, [sizes.mc_unlabeled], seed=1)[0]
    specs = {
        "arc_easy": f"arc_easy:{D}:test",
        "arc_challenge": f"arc_challenge:{D}:test",
        "openbookqa": f"openbookqa:{D}",
        "qasc": f"qasc:{D}:dev",
        "commonsenseqa": f"commonsenseqa:{D}:dev",
        **{f"mmlu_{g}": f"mmlu_{g}:{D}:test" for g in ("stem", "humanities", "social_sciences", "other")},
        **{f"otqa_{c.replace('-', '_')}": f"opentriviaqa:{D}:{c}" for c in (*OTQA_CATEGORIES, *OTQA_ABOVE_CHANCE)},
    }
    tests, src, spare = {}, {}, {}
    for name, spec in specs.items():
        full = load(spec).records
        tests[name], spare[name] = split_items(full, [sizes.mc_test, len(full) - sizes.mc_test])  # tests: load(limit)'s sample
        src[name] = f"`{spec.replace(D, '<data>')}` ({len(tests[name])} of {len(full)})"
    in_domain = ("arc_easy", "arc_challenge")
    ood = tuple(k for k in tests if k not in in_domain)
    unl_b = _regime_b_pool({k: spare[k] for k in ood if k in V2_OOD}, sizes.mc_unlabeled)  # v2's pool, unchanged
    desc = (f"Training: {len(train)} questions (ARC-Easy + ARC-Challenge train, half each). Labelled in-domain held-out "
            f"split (model selection, accuracy guard, every in-domain temperature fit): {len(held_e)} ARC-Easy + "
            f"{len(held_c)} ARC-Challenge dev questions. Unlabelled upper-level inputs: regime A, {len(unl_a)} other ARC "
            f"dev questions; regime B, {len(unl_b)} prompts of the {len(V2_OOD)} out-of-domain sets of v2 (about "
            f"{math.ceil(len(unl_b) / len(V2_OOD))} each), disjoint from their test questions. Out-of-domain sets added "
            f"in v3 (the model is above chance on them in `ood_pilot.md`): "
            f"{', '.join('otqa_' + c for c in OTQA_ABOVE_CHANCE)}.")
    return Task("mc", train, held_e + held_c, {"A": unl_a, "B": unl_b}, tests, in_domain, ood, src, desc)


def open_task(data_dir: Path | None, sizes: Sizes) -> Task:
    """The open-ended task: NQ-open dev split into test / held-out / unlabelled / train, few-shot
    examples from the training split, one training target per alias."""
    from llm_calib.data import one_record_per_alias
    from llm_calib.prompts.templates import draw_short_answer_examples

    parts = [sizes.open_test, sizes.open_heldout, sizes.open_unlabeled, sizes.open_train]
    if data_dir is None:
        n = max(sizes.open_test, 1) + sum(parts)
        pools = {d: builtin_open_questions(4 * n if d == "sums" else n, [d]) for d in ("sums", "capitals", "elements")}
        test, heldout, unl, train = split_items(pools["sums"], parts)
        tests = {"sums": test, "capitals": split_items(pools["capitals"], [sizes.open_test])[0],
                 "elements": split_items(pools["elements"], [sizes.open_test])[0]}
        src = {k: f"built-in open questions `{k}` ({len(v)})" for k, v in tests.items()}
        in_domain, ood = ("sums",), ("capitals", "elements")
        head = f"Built-in open questions. Training: {len(train)} sums; held-out: {len(heldout)} other sums"
    else:
        D = str(data_dir)
        nq = [r for r in load(f"nq_open:{D}").records if r.answers]
        test, heldout, unl, train = split_items(nq, parts)
        tests = {"nq_open": test}
        src = {"nq_open": f"`nq_open:<data>` ({len(test)} of {len(nq)}, disjoint from the other splits)"}
        for name, spec in (("webquestions", f"webquestions:{D}"), ("selfaware_triviaqa", f"selfaware:{D}:triviaqa")):
            full = [r for r in load(spec).records if r.answerable and r.answers]
            tests[name] = split_items(full, [min(sizes.open_test, len(full))])[0]
            src[name] = f"`{spec.replace(D, '<data>')}` ({len(tests[name])} of {len(full)} answerable)"
        in_domain, ood = ("nq_open",), ("webquestions", "selfaware_triviaqa")
        head = (f"Training: {len(train)} NQ-open dev questions; held-out: {len(heldout)} other NQ-open dev questions "
                f"(labelled: selection and the temperature fit); unlabelled inputs (regime A): {len(unl)} more")
    fields: dict[str, Any] = {}
    if sizes.open_fewshot:
        fields["open_examples"] = draw_short_answer_examples(train, sizes.open_fewshot, seed=0)
        head += f"; prompt: {sizes.open_fewshot} solved examples from the training split (`Q: ... A: ...`), newline stop"
    targets = one_record_per_alias(train)
    desc = head + f"; training targets: every alias ({len(targets)} (question, alias) pairs, each ending with the stop)."
    return Task("open", targets, heldout, {"A": unl}, tests, in_domain, ood, src, desc, fields)


# ----------------------------------------------------------------------------------- scoring


def set_metrics(scored: Any, bootstrap: int) -> dict[str, float]:
    return summarize_scored(scored, n_bins=10, ci=bootstrap > 0, n_resamples=max(bootstrap, 1), seed=0)


def per_char(scored: ScoredSet, records: Sequence[Any]) -> ScoredSet:
    """The same options scored per character (lm-eval's ``acc_norm``): each summed
    log-likelihood divided by the length of its continuation ``" " + option``."""
    logits = [s / torch.tensor([float(len(continuation_text(o))) for o in r.options], dtype=s.dtype)
              for s, r in zip(scored.logits, records, strict=True)]
    return ScoredSet(logits, scored.labels, scored.domains, scored.ids, f"{scored.scorer}/char")


def questions_record(scored: Any, char: ScoredSet | None = None) -> dict[str, Any]:
    """What the report needs per question: MC option probabilities (both conventions), the summed
    scores they come from and labels; open confidences, correctness and answers."""
    if isinstance(scored, ScoredSet):
        out = {"probs": [[round(float(p), 6) for p in ps] for ps in scored.probs_numpy],
               "scores": [[float(v) for v in s.tolist()] for s in scored.logits],  # exact: the report's checks
               "labels": [int(y) for y in scored.labels]}
        if char is not None:
            out["probs_char"] = [[round(float(p), 6) for p in ps] for ps in char.probs_numpy]
        return out
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
    base_threads: int = 1
    open_methods: tuple[str, ...] | None = None  # None: the same as ``methods``
    timings: dict[str, float] = field(default_factory=dict)
    model: Any = None
    tokenizer: Any = None

    def __post_init__(self) -> None:
        self.log = SweepLog(self.runs / "bench.log")  # a forked worker sets log.worker

    def bar(self, total: int, desc: str) -> Any:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="q", dynamic_ncols=True, disable=not self.progress, leave=False)

    def seeds(self, method: str) -> list[int]:
        if method in BASELINES:
            return [0]
        return list(range(self.sizes.seeds if method in MULTI_SEED else self.sizes.other_seeds))

    def methods_for(self, task: str) -> tuple[str, ...]:
        """The methods run on a task (open-ended QA: regime A only, no LoRA CE + temperature row)."""
        if task == "mc":
            return self.methods
        return tuple(m for m in (self.open_methods or self.methods) if m not in OPEN_SKIPS)

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

    def params(self, task: str, method: str) -> dict[str, Any]:
        """The method's hyperparameters: built-in, then the --hparams file (a regime-B variant
        falls back to its regime-A method's entry)."""
        method = DERIVED.get(method, method)
        built, searched = BUILTIN_HPARAMS.get(task, {}), self.hparams.get(task, {})
        return {**built.get(method, built.get(base_method(method), {})),
                **searched.get(base_method(method), {}), **searched.get(method, {})}

    def config(self, task: Task, method: str, seed: int, overrides: dict[str, Any] | None = None) -> CalibrationConfig:
        source = DERIVED.get(method, method)
        objective, solver, _ = TRAINED[source]
        convention = {"normalize": TRAINED_NORMALIZE[source]} if source in TRAINED_NORMALIZE else {}
        # the benchmark's hyperparameters are flat keys of the configuration before it was nested
        # (stored results are fingerprinted by that layout, see harness.flat_config)
        return config_from_flat(
            method=objective, solver=solver, steps=self.steps(task.name), batch_size=self.sizes.batch_size,
            heldout_batch_size=self.sizes.batch_size, eval_every=self.sizes.eval_every, seed=seed, lora=self.lora(),
            **{**self.params(task.name, method), **(overrides or {}), **task.config_fields, **convention},
        )

    def eval_config(self, task: Task) -> CalibrationConfig:
        return config_from_flat(lora=self.lora(), **task.config_fields)

    def eval_run(self, task: Task) -> ResolvedRun:
        """The evaluation configuration resolved for the task's sets (what encodings and scoring read)."""
        return resolve_run(self.eval_config(task), task.train, task.heldout)

    def evaluator(self, task: Task, sets: dict[str, Any], temperatures: Any = None) -> SharedTrunkEval:
        """Scores ``sets`` with the base model once and with each trained model from the trunk."""
        s = self.sizes
        return SharedTrunkEval(self.model, self.tokenizer, sets, self.trunk_layers, settings=self.eval_run(task).settings,
                               max_new_tokens=s.max_new_tokens,
                               batch_size=s.eval_batch_size if task.name == "mc" else s.gen_batch_size,
                               temperatures=temperatures)

    def fingerprint(self, task: Task, method: str) -> str:
        s = self.sizes
        cfg = self.config(task, method, 0) if DERIVED.get(method, method) in TRAINED else None
        eval_part = {"model": s.model, "top_layers": s.top_layers, "bootstrap": s.bootstrap,
                     "eval": "option_likelihood/sum+char/cloze" if task.name == "mc" else f"greedy/{s.max_new_tokens}"}
        return fingerprint({"task": task.fingerprint(), "method": method, "eval": eval_part,
                            "config": _config_key(cfg) if cfg is not None else None})


def _config_key(cfg: CalibrationConfig) -> dict[str, Any]:
    """The settings a result depends on: the config without fields left at an empty default (so a
    config field added later, like ``open_examples`` for multiple choice, keeps old results valid)."""
    return {k: v for k, v in flat_config(cfg).items() if not (k == "open_examples" and not v)}


def _timed_calibrate(ctx: Ctx, task: Task, cfg: Any, memo: EncodingCache, unlabeled: list[Any] | None) -> tuple[Any, Phase]:
    model = copy.deepcopy(ctx.model)
    with Phase() as phase:
        run = resolve_run(cfg, task.train, task.heldout, unlabeled or None)
        train, heldout = (memo(ctx.tokenizer, r, run) for r in (task.train, task.heldout))
        unl = memo(ctx.tokenizer, unlabeled, run) if unlabeled else None
        result = calibrate_run(model, ctx.tokenizer, train, heldout, run, unlabeled=unl, progress=ctx.progress)
    return result, phase


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch threads, restoring the previous count afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _temperature_of(scored: ScoredSet) -> float:
    return fit_temperature(scored.logits, scored.labels)


ORACLE_GRID = np.exp(np.linspace(np.log(0.05), np.log(1000.0), 241))


def _oracle_temperature(scored: ScoredSet) -> float:
    """The temperature with the lowest conf-ECE (10 bins) on the set itself, on a log grid: the
    best any single temperature could do there (fitted on the test labels: an oracle)."""
    eces = [ece(*confidence_correct(scored.scaled(float(t)).probs_numpy, scored.labels_numpy), 10) for t in ORACLE_GRID]
    return float(ORACLE_GRID[int(np.argmin(eces))])


def _open_oracle_index(records: Sequence[Any], outs: Sequence[Any]) -> int:
    """Open questions: the grid temperature with the lowest conf-ECE on the set itself."""
    eces = [summarize_scored(open_ended_set(records, outs, g), ci=False)["ece"] for g in range(len(TEMPERATURE_GRID))]
    return int(np.argmin(eces))


# --------------------------------------------------------------------------------- one task


class Runner:
    """One task: the base pass (uncalibrated predictions, temperature fits, the trunk every trained
    model starts from), then the trained (method, seed) runs, scored from the trunk."""

    def __init__(self, ctx: Ctx, task: Task) -> None:
        self.ctx, self.task, self.memo = ctx, task, EncodingCache()
        self.mc = task.name == "mc"
        grid = None if self.mc else TEMPERATURE_GRID
        held = self.memo(ctx.tokenizer, task.heldout, ctx.eval_run(task)) if self.mc else task.heldout  # trunk reused
        self.held = ctx.evaluator(task, {"heldout": held}, grid)
        self.tests = ctx.evaluator(task, task.tests, grid)
        self.base: dict[str, Any] = {}

    def base_pass(self) -> Phase:
        n = len(self.held) + len(self.tests)
        self.ctx.log(f"[{self.task.name}] base pass: {n} questions (held-out + tests) through the full model "
                     f"(uncalibrated predictions + trunk at layer {self.ctx.trunk_layers})")
        bar = self.ctx.bar(n, f"{self.task.name} base pass")
        with torch_threads(self.ctx.base_threads), Phase() as phase:
            self.held_base = self.held.base(keep_trunk=self.mc, bar=bar)["heldout"]
            self.base = self.tests.base(bar=bar)
        bar.close()
        self.ctx.timings[f"{self.task.name} base pass"] = phase.seconds
        return phase

    def char(self, scored: dict[str, ScoredSet]) -> dict[str, ScoredSet]:
        records = {"heldout": self.task.heldout, **self.task.tests}
        return {n: per_char(s, records[n]) for n, s in scored.items()}

    def baselines(self, pending: set[str], phase: Phase) -> None:
        t0 = time.perf_counter()
        extra: dict[str, dict[str, Any]] = {}
        if self.mc:
            base_char = self.char(self.base)
            T, T_char = _temperature_of(self.held_base), _temperature_of(per_char(self.held_base, self.task.heldout))
            oracle = {n: _oracle_temperature(s) for n, s in self.base.items()}
            oracle_char = {n: _oracle_temperature(s) for n, s in base_char.items()}
            scored = {
                "uncalibrated": (self.base, base_char),
                "temperature_scaling": ({k: v.scaled(T) for k, v in self.base.items()},
                                        {k: v.scaled(T_char) for k, v in base_char.items()}),
                "oracle_temperature": ({k: v.scaled(oracle[k]) for k, v in self.base.items()},
                                       {k: v.scaled(oracle_char[k]) for k, v in base_char.items()}),
            }
            extra = {"temperature_scaling": {"temperature": T, "temperature_char": T_char},
                     "oracle_temperature": {"temperature": oracle, "temperature_char": oracle_char}}
            note = "one full-model pass gives every baseline"
        else:
            T, g = fit_open_temperature(self.task.heldout, self.held.base_outputs["heldout"], TEMPERATURE_GRID)
            fits = {n: _open_oracle_index(self.task.tests[n], o) for n, o in self.tests.base_outputs.items()}
            oracle_sets = {n: self.tests.scaled(gi)[n] for n, gi in fits.items()}
            scored = {"uncalibrated": (self.base, None), "temperature_scaling": (self.tests.scaled(g), None),
                      "oracle_temperature": (oracle_sets, None)}
            extra = {"temperature_scaling": {"temperature": T},
                     "oracle_temperature": {"temperature": {n: float(TEMPERATURE_GRID[g]) for n, g in fits.items()}}}
            note = "one greedy pass gives every baseline (answers do not depend on T)"
        fit_s = time.perf_counter() - t0
        self.ctx.log(f"[{self.task.name}] temperature fitted on the held-out split ({len(self.held)}): T = {T:.3f}")
        for method in (m for m in BASELINES if m in pending):
            sets, char = scored[method]
            fitted = method != "uncalibrated"
            self.write(method, 0, sets, char, {"eval": phase.to_dict()},
                       {"train_s": fit_s if fitted else 0.0, "eval_s": phase.seconds}, note=note,
                       **extra.get(method, {}))

    def prepare_training(self) -> None:
        """Fill the trunk caches of the training, held-out and unlabelled encodings once for every
        run of the task."""
        ctx = self.ctx
        run = ctx.eval_run(self.task)
        sets = [self.task.train, self.task.heldout, *(u for u in self.task.unlabeled.values() if u)]
        encs = [self.memo(ctx.tokenizer, r, run) for r in sets]
        n = sum(len(e) - len(e.trunk_cache) for e in encs)
        ctx.log(f"[{self.task.name}] trunk of the training, held-out and unlabelled questions ({n} to compute)")
        bar = ctx.bar(n, f"{self.task.name} training trunk")
        with torch_threads(ctx.base_threads):
            fill_trunk_caches(ctx.model, encs, run.config.lora, ctx.tokenizer.pad_token_id or 0, bar)
        bar.close()
        free_memory()

    def trained(self, method: str, seed: int) -> None:
        ctx, task = self.ctx, self.task
        cfg = ctx.config(task, method, seed)
        regime = TRAINED[method][2]
        ctx.log(f"[{task.name}] {method} seed {seed}: training {cfg.training.steps} steps"
                + (f" (unlabelled inputs: regime {regime})" if regime else ""))
        result, train = _timed_calibrate(ctx, task, cfg, self.memo, task.unlabeled.get(regime) if regime else None)
        bar = ctx.bar(len(self.tests), f"{task.name} eval {method} s{seed}")
        # a model trained per-character is scored like the others: summed, and per-character from the same passes
        scoring = "sum" if method in TRAINED_NORMALIZE else cfg.prompt.normalize
        with Phase() as ev:
            sets = self.tests.adapted(result.model, normalize=scoring, bar=bar)
        bar.close()
        char = self.char(sets) if self.mc else None
        training = {"heldout_before": result.metrics.get("before", {}), "heldout_after": result.metrics.get("after", {}),
                    "timings": result.timings, "history": result.history}
        common = {"config": flat_config(cfg), "training": training,
                  "process": {"workers": ctx.workers, "threads": torch.get_num_threads()}}
        self.write(method, seed, sets, char, {"train": train.to_dict(), "eval": ev.to_dict()},
                   {"train_s": train.seconds, "eval_s": ev.seconds}, **common)
        derived = [d for d, src in DERIVED.items() if src == method and d in ctx.methods_for(task.name)]
        if derived:  # LoRA CE + temperature scaling: T fitted on the trained model's held-out scores
            with Phase() as fit:
                held = self.held.adapted(result.model, normalize=scoring)["heldout"]
                T, T_char = _temperature_of(held), _temperature_of(per_char(held, task.heldout))
            for d in derived:
                self.write(d, seed, {k: v.scaled(T) for k, v in sets.items()}, {k: v.scaled(T_char) for k, v in char.items()},
                           {"train": train.to_dict(), "eval": ev.to_dict(), "fit": fit.to_dict()},
                           {"train_s": train.seconds + fit.seconds, "eval_s": ev.seconds}, temperature=T,
                           temperature_char=T_char, **common)
        for key, seconds in ((f"{task.name} train", train.seconds), (f"{task.name} eval trained", ev.seconds)):
            ctx.timings[key] = ctx.timings.get(key, 0.0) + seconds
        del result
        free_memory()

    def write(self, method: str, seed: int, scored: dict[str, Any], char: dict[str, ScoredSet] | None,
              memory: dict[str, Any], timing: dict[str, float], **extra: Any) -> None:
        """Write one (method, seed) result file atomically and log it."""
        ctx, task = self.ctx, self.task
        boot = ctx.sizes.bootstrap
        record = {"task": task.name, "method": method, "seed": seed, "fingerprint": ctx.fingerprint(task, method),
                  "sets": {n: set_metrics(s, boot) for n, s in scored.items()},
                  **({"sets_char": {n: set_metrics(s, boot) for n, s in char.items()}} if char else {}),
                  "questions": {n: questions_record(s, (char or {}).get(n)) for n, s in scored.items()},
                  "timing": timing, "memory": memory, **extra,
                  "finished": _dt.datetime.now().isoformat(timespec="seconds")}
        write_json_atomic(result_path(ctx.runs, task.name, method, seed), record)
        cost = f"train {timing['train_s']:.0f}s, eval {timing['eval_s']:.0f}s, " if method not in BASELINES else ""
        ctx.log(f"[{task.name}] {method}{f' seed {seed}' if method not in BASELINES else ''}: written ({cost}"
                f"OOD mean ECE {np.mean([record['sets'][n]['ece'] for n in task.ood]):.3f})")


def run_task(ctx: Ctx, task: Task) -> None:
    """Run every pending (method, seed) of a task, skipping finished results."""
    pending: list[tuple[str, int]] = []
    methods = ctx.methods_for(task.name)
    for method, seed in [(m, s) for s in range(max(ctx.sizes.seeds, ctx.sizes.other_seeds)) for m in methods
                         if s in ctx.seeds(m)]:
        path = result_path(ctx.runs, task.name, method, seed)
        if read_result(path, ctx.fingerprint(task, method)) is not None:
            ctx.log(f"[{task.name}] {method} seed {seed}: skipped (finished result {path.relative_to(ctx.runs)})")
            continue
        if path.exists():
            ctx.log(f"[{task.name}] {method} seed {seed}: stale result (other settings), re-running")
        job = (DERIVED.get(method, method), seed)  # a derived result comes from its source run
        if job not in pending:
            pending.append(job)
    if not pending:
        return
    runner = Runner(ctx, task)
    phase = runner.base_pass()
    if baselines := {m for m, _ in pending if m in BASELINES}:
        runner.baselines(baselines, phase)
    jobs = sorted([j for j in pending if j[0] in TRAINED], key=lambda j: -STEP_COST.get(base_method(j[0]), 1.0))
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
    """Choose each trained method's hyperparameters on the in-domain held-out split only."""
    chosen: dict[str, Any] = {"procedure": SEARCH_RULE, "grid": SEARCH_GRID, "mc": {}, "open": {}, "candidates": []}
    grid = {m: SEARCH_GRID[m][: 2 if ctx.sizes.name == "quick" else None] for m in ctx.methods if m in SEARCH_GRID}
    for name, task in tasks.items():
        memo = EncodingCache()
        sel = ctx.evaluator(task, {"heldout": task.heldout})
        base_m = set_metrics(sel.base()["heldout"], 0)
        ctx.log(f"[search/{name}] uncalibrated on the held-out split ({len(task.heldout)}): "
                f"accuracy {base_m['accuracy']:.3f}, ECE {base_m['ece']:.3f}")
        for method, candidates in grid.items():
            rows = []
            regime = TRAINED[method][2]
            for ci, cand in enumerate(candidates):
                cfg = ctx.config(task, method, 0, cand)
                path = ctx.runs / "search" / name / f"{method}-c{ci}.json"
                fp = fingerprint({"task": task.fingerprint(), "config": flat_config(cfg)})
                rec = read_result(path, fp)
                if rec is None:
                    ctx.log(f"[search/{name}] {method} candidate {ci} {cand}")
                    result, phase = _timed_calibrate(ctx, task, cfg, memo, task.unlabeled.get(regime) if regime else None)
                    m = set_metrics(sel.adapted(result.model, normalize=cfg.prompt.normalize)["heldout"], 0)
                    rec = {"fingerprint": fp, "method": method, "candidate": cand, "metrics": m, "train_s": phase.seconds}
                    write_json_atomic(path, rec)
                    del result
                    free_memory()
                else:
                    ctx.log(f"[search/{name}] {method} candidate {ci}: skipped (finished)")
                rows.append(rec)
            # the library's selection rule (guard_accuracy of the method's config) picks the candidate
            best = rows[best_candidate([r["metrics"] for r in rows], base_m["accuracy"], ctx.config(task, method, 0))]
            chosen[name][method] = best["candidate"]
            for r in rows:
                chosen["candidates"].append({"task": name, "method": method, "candidate": r["candidate"],
                                             "accuracy": r["metrics"]["accuracy"], "ece": r["metrics"]["ece"],
                                             "chosen": r is best, "train_s": r["train_s"]})
            ctx.log(f"[search/{name}] {method}: chose {best['candidate']} (held-out ECE {best['metrics']['ece']:.3f}, "
                    f"accuracy {best['metrics']['accuracy']:.3f})")
        chosen[f"{name}_uncalibrated"] = {"accuracy": base_m["accuracy"], "ece": base_m["ece"]}
    write_json_atomic(hparams_out, chosen)
    rows = [(c["task"], c["method"], f"`{json.dumps(c['candidate'])}`", f"{c['accuracy']:.3f}", f"{c['ece']:.3f}",
             "**yes**" if c["chosen"] else "") for c in chosen["candidates"]]
    lines = ["# Calibration benchmark: hyperparameter search", "", f"Rule: {SEARCH_RULE}", "",
             *markdown_table(("task", "method", "candidate", "held-out accuracy", "held-out ECE", "chosen"), rows)]
    write_text_atomic(hparams_out.with_suffix(".md"), "\n".join(lines) + "\n")
    ctx.log(f"wrote {hparams_out} and {hparams_out.with_suffix('.md')}")
    return chosen


# --------------------------------------------------------------------------------- report


class Aggregate(SeedResults):
    """Results of one task under one scoring convention, all methods and seeds, with seed-averaged
    metrics and bootstrap CIs."""

    def __init__(self, ctx: Ctx, task: Task, convention: str = "sum") -> None:
        self.task, self.ctx, self.convention = task, ctx, convention
        self.metrics = MC_METRICS if task.name == "mc" else OPEN_METRICS
        runs: dict[str, list[dict[str, Any]]] = {}
        for m in ctx.methods_for(task.name):
            recs = [r for s in ctx.seeds(m) if (r := read_result(result_path(ctx.runs, task.name, m, s)))]
            if convention == "char":
                recs = [{**r, "sets": r["sets_char"],
                         "questions": {n: {"probs": q["probs_char"], "labels": q["labels"]} for n, q in r["questions"].items()}}
                        for r in recs if "sets_char" in r]
            runs[m] = recs
        super().__init__(runs, lambda q: conf_correct(task.name, q), {n: len(r) for n, r in task.tests.items()},
                         max(ctx.sizes.bootstrap, 1))

    def present(self, methods: Sequence[str]) -> list[str]:
        return [m for m in methods if m in self.runs]

    def wins_over_ts(self, method: str, names: Sequence[str] | None = None) -> int:
        """Out-of-domain sets (or ``names``) where ``method``'s seed-mean conf-ECE is below carried-over
        temperature scaling's."""
        names = self.task.ood if names is None else names
        return sum(self.mean(method, n, "ece") < self.mean("temperature_scaling", n, "ece") for n in names)

    def oracle_gap(self, method: str, names: Sequence[str] | None = None) -> float:
        """Mean over out-of-domain sets (or ``names``) of ``method``'s conf-ECE minus the oracle temperature's."""
        names = self.task.ood if names is None else names
        return self.group_mean(method, names, "ece") - self.group_mean("oracle_temperature", names, "ece")

    def chance(self, name: str) -> float:
        """The accuracy of guessing on set ``name``: the mean over its questions of 1/K (multiple
        choice; K is each question's number of options, read from the stored probabilities)."""
        q = self.runs["uncalibrated"][0]["questions"][name]
        return float(np.mean([1.0 / len(p) for p in q["probs"]]))

    def above_chance(self, names: Sequence[str] | None = None) -> tuple[str, ...]:
        """The out-of-domain sets (or ``names``) where the uncalibrated model is above chance by more
        than its bootstrap interval: the lower end of the 95% interval of its accuracy exceeds
        :meth:`chance`. Without intervals (``--bootstrap 0``) the point accuracy is used."""
        if "uncalibrated" not in self.runs or self.task.name != "mc":
            return ()
        sets = self.runs["uncalibrated"][0]["sets"]
        names = self.task.ood if names is None else names
        return tuple(n for n in names if _value(sets[n].get("accuracy_ci_low", sets[n]["accuracy"])) > self.chance(n))

    def skill(self, method: str, names: Sequence[str], metric: str) -> list[float]:
        """Per seed, the mean over the sets ``names`` of the skill score ``1 − metric / metric of the
        uncalibrated model`` (Brier or NLL: positive is better than the uncalibrated model)."""
        ref = {n: self.mean("uncalibrated", n, metric) for n in names}
        return [float(np.mean([1.0 - _value(r["sets"][n].get(metric)) / ref[n] for n in names]))
                for r in self.runs.get(method, [])]

    def flags(self, method: str, names: Sequence[str]) -> list[str]:
        """Why an out-of-domain ECE gain of ``method`` over the uncalibrated model on the sets
        ``names`` may be flattening rather than calibration: its mean AUROC within
        :data:`CHANCE_AUROC` of 0.5 (the uncalibrated model's is not), or its mean confidence within
        :data:`NEAR_UNIFORM` of the mean 1/K (multiple choice)."""
        if method == "uncalibrated" or "uncalibrated" not in self.runs or not names:
            return []
        if self.group_mean(method, names, "ece") >= self.group_mean("uncalibrated", names, "ece"):
            return []
        out = []
        auroc, ref = self.group_mean(method, names, "auroc"), self.group_mean("uncalibrated", names, "auroc")
        if abs(auroc - 0.5) <= CHANCE_AUROC < abs(ref - 0.5):
            out.append(f"AUROC {auroc:.3f} at chance (uncalibrated {ref:.3f})")
        if self.task.name == "mc":
            conf, uniform = self.group_mean(method, names, "mean_confidence"), float(np.mean([self.chance(n) for n in names]))
            if conf - uniform <= NEAR_UNIFORM:
                out.append(f"confidence {conf:.3f} within {NEAR_UNIFORM} of 1/K ({uniform:.3f})")
        return out


Check = Callable[[str], tuple[float | None, bool | None, str]]


def _value(x: Any) -> float:
    return math.nan if x is None else float(x)


def _spread(agg: Aggregate, *methods: str) -> float:
    """The largest seed standard deviation of the out-of-domain mean conf-ECE among ``methods``."""
    sds = [float(np.std(v, ddof=1)) for m in methods if len(v := agg.group_values(m, agg.task.ood, "ece")) > 1]
    return max(sds) if sds else math.nan


def targets(mc: Aggregate | None, op: Aggregate | None) -> list[dict[str, Any]]:
    """The issue's targets for CALM (BOME and F2SA columns), with the measured numbers."""
    rows: list[dict[str, Any]] = []

    def add(name: str, limit: str, agg: Aggregate | None, regime: str, needs: str, fn: Callable[[str, str], tuple[float | None, bool | None, str]]) -> None:
        row: dict[str, Any] = {"target": name, "limit": limit, "regime": regime}
        for col, m in zip(("bome", "f2sa"), CALM_OF[regime], strict=True):
            try:
                if agg is None or m not in agg.runs or needs.format(penalty=PENALTY_OF[regime]) not in agg.runs:
                    raise KeyError(m)
                value, ok, detail = fn(m, regime)
            except (KeyError, ValueError, ZeroDivisionError, StopIteration):
                value, ok, detail = None, None, "missing results"
            row[col] = {"method": m, "value": value, "pass": ok, "detail": detail}
        rows.append(row)

    if mc is not None:
        ood, ind = tuple(n for n in mc.task.ood if n in V2_OOD) or mc.task.ood, mc.task.in_domain  # v2's sets

        def ts_ratio(factor: float) -> Callable[[str, str], tuple[float | None, bool | None, str]]:
            def fn(m: str, regime: str) -> tuple[float | None, bool | None, str]:
                c, b = mc.group_mean(m, ood, "ece"), mc.group_mean("temperature_scaling", ood, "ece")
                return c / b, c <= factor * b, f"CALM {c:.3f} vs temperature scaling {b:.3f}"
            return fn

        def lower_than_ts(m: str, regime: str) -> tuple[float | None, bool | None, str]:
            wins = mc.wins_over_ts(m)
            return wins / len(ood), wins >= math.ceil(0.75 * len(ood)), f"{wins} of {len(ood)} sets"

        def below_penalty(m: str, regime: str) -> tuple[float | None, bool | None, str]:
            pen = PENALTY_OF[regime]
            c, p = mc.group_mean(m, ood, "ece"), mc.group_mean(pen, ood, "ece")
            spread = _spread(mc, m, pen)
            if math.isnan(spread):
                raise ValueError("one seed: no spread")
            return p - c, p - c > spread, f"penalty {p:.3f} − CALM {c:.3f} vs seed spread {spread:.3f}"

        def acc_ratio(m: str, regime: str) -> tuple[float | None, bool | None, str]:
            c, b = mc.group_mean(m, ood, "accuracy"), mc.group_mean("uncalibrated", ood, "accuracy")
            return c / b, c >= 0.95 * b, f"CALM {c:.3f} vs uncalibrated {b:.3f}"

        def worst_set(m: str, regime: str) -> tuple[float | None, bool | None, str]:
            margins = {}
            for n in ood:
                low = mc.runs["uncalibrated"][0]["sets"][n].get("accuracy_ci_low")
                margins[n] = mc.mean(m, n, "accuracy") - (mc.mean("uncalibrated", n, "accuracy") if low is None else low)
            n = min(margins, key=margins.get)
            bad = [k for k, v in margins.items() if v < 0]
            return margins[n], not bad, (f"worst {n}: CALM {mc.mean(m, n, 'accuracy'):.3f} vs uncalibrated CI low "
                                         f"{mc.mean(m, n, 'accuracy') - margins[n]:.3f}" + (f"; below on {', '.join(bad)}" if bad else ""))

        def in_domain(m: str, regime: str) -> tuple[float | None, bool | None, str]:
            c, b = mc.group_mean(m, ind, "ece"), mc.group_mean("temperature_scaling", ind, "ece")
            return c - b, c <= b + 0.01, f"CALM {c:.3f} vs temperature scaling {b:.3f}"

        for regime, factor in (("A", 0.8), ("B", 0.5)):
            tag = f"MC {regime}"
            add(f"{tag} OOD: mean conf-ECE / temperature scaling (carried over)", f"≤ {factor}", mc, regime,
                "temperature_scaling", ts_ratio(factor))
            add(f"{tag} OOD: sets with conf-ECE below temperature scaling", "≥ 3/4", mc, regime, "temperature_scaling",
                lower_than_ts)
            add(f"{tag} OOD: flat penalty − CALM conf-ECE above the seed spread", "> spread", mc, regime, "{penalty}",
                below_penalty)
            add(f"{tag} OOD: mean accuracy / uncalibrated", "≥ 0.95", mc, regime, "uncalibrated", acc_ratio)
            add(f"{tag} OOD: no set's accuracy below the uncalibrated 95% bootstrap interval (min margin)", "≥ 0", mc,
                regime, "uncalibrated", worst_set)
            add(f"{tag} in-domain: conf-ECE − temperature scaling", "≤ 0.01", mc, regime, "temperature_scaling", in_domain)
    if op is not None:
        oo = op.task.ood

        def open_acc(m: str, regime: str) -> tuple[float | None, bool | None, str]:
            c = op.group_mean(m, oo, "accuracy")
            return c, c >= OPEN_NONTRIVIAL, f"CALM exact match {c:.3f} (uncalibrated {op.group_mean('uncalibrated', oo, 'accuracy'):.3f})"

        def open_reduction(m: str, regime: str) -> tuple[float | None, bool | None, str]:
            c, b = op.group_mean(m, oo, "ece"), op.group_mean("uncalibrated", oo, "ece")
            ok = c <= 0.8 * b and op.group_mean(m, oo, "accuracy") >= OPEN_NONTRIVIAL
            return 1 - c / b, ok, f"CALM {c:.3f} vs uncalibrated {b:.3f}"

        def open_ts(m: str, regime: str) -> tuple[float | None, bool | None, str]:
            c, b = op.group_mean(m, oo, "ece"), op.group_mean("temperature_scaling", oo, "ece")
            return c / b, c < b, f"CALM {c:.3f} vs temperature scaling {b:.3f}"

        add(f"Open-ended OOD: exact match (non-trivial: ≥ {OPEN_NONTRIVIAL})", f"≥ {OPEN_NONTRIVIAL}", op, "A",
            "uncalibrated", open_acc)
        add("Open-ended OOD: conf-ECE reduction vs uncalibrated (at non-trivial accuracy)", "≥ 0.20", op, "A",
            "uncalibrated", open_reduction)
        add("Open-ended OOD: conf-ECE / temperature scaling (carried over)", "< 1", op, "A", "temperature_scaling", open_ts)
    return rows


def targets_v3(mc: Aggregate | None, char: Aggregate | None) -> list[dict[str, Any]]:
    """The v3 targets: CALM followed by a temperature against a temperature alone and against LoRA CE
    followed by a temperature (the bilevel part must matter), on the v2 out-of-domain sets, on those
    where the uncalibrated model is above chance, under summed and per-character scores; then skill
    and discrimination on the above-chance sets, and the in-domain bounds under both conventions. One
    column per regime of unlabelled inputs (models trained under summed scores), and one for regime A's
    models trained under per-character scores (per-character rows only)."""
    rows: list[dict[str, Any]] = []

    def add(name: str, limit: str, agg: Aggregate | None, fn: Callable[[Aggregate, str, str], tuple[float, bool, str]],
            reported: bool = False) -> None:
        row: dict[str, Any] = {"target": name + (" (reported)" if reported else ""), "limit": limit}
        for regime in CALM_TS_OF:
            m = CALM_TS_OF[regime]
            if regime == "A_char" and agg is not char:
                row[regime] = {"method": m, "value": None, "pass": None, "detail": "trained per-character: per-character rows"}
                continue
            try:
                if agg is None or m not in agg.runs:
                    raise KeyError(m)
                value, ok, detail = fn(agg, m, regime)
            except (KeyError, ZeroDivisionError):
                value, ok, detail = None, None, "missing results"
            except ValueError as err:  # no set in the subset, or one seed
                value, ok, detail = None, None, str(err)
            row[regime] = {"method": m, "value": value, "pass": ok, "detail": detail}
        rows.append(row)

    def sets_of(agg: Aggregate, subset: str) -> tuple[str, ...]:
        names = tuple(n for n in agg.task.ood if n in V2_OOD) or agg.task.ood
        if subset == "above chance":
            names = agg.above_chance(names)
        if not names:
            raise ValueError(f"no {subset} set")
        return names

    for conv, agg in (("summed", mc), ("per-character", char)):
        for subset in ("v2 sets", "above chance"):
            tag = f"MC {conv}, OOD {subset}"
            reported = (conv, subset) != ("summed", "v2 sets")

            def ratio(a: Aggregate, m: str, regime: str, subset: str = subset) -> tuple[float, bool, str]:
                names = sets_of(a, subset)
                c, b = a.group_mean(m, names, "ece"), a.group_mean("temperature_scaling", names, "ece")
                return c / b, c <= 0.85 * b, f"{c:.3f} vs temperature {b:.3f} ({len(names)} sets)"

            def wins(a: Aggregate, m: str, regime: str, subset: str = subset) -> tuple[float, bool, str]:
                names = sets_of(a, subset)
                k, need = a.wins_over_ts(m, names), math.ceil(10 / 13 * len(names))
                return k / len(names), k >= need, f"{k} of {len(names)} (need {need})"

            def vs_lora(a: Aggregate, m: str, regime: str, subset: str = subset) -> tuple[float, bool, str]:
                names = sets_of(a, subset)
                lora = LORA_TS_OF[regime]
                c, lt = a.group_mean(m, names, "ece"), a.group_mean(lora, names, "ece")
                spread = max((float(np.std(v, ddof=1)) for x in (m, lora)
                              if len(v := a.group_values(x, names, "ece")) > 1), default=math.nan)
                if math.isnan(spread):
                    raise ValueError("one seed: no spread")
                return lt - c, lt - c > spread, f"LoRA CE + T {lt:.3f} − CALM + T {c:.3f} vs seed spread {spread:.3f}"

            add(f"{tag}: CALM + T mean conf-ECE / temperature alone", "≤ 0.85", agg, ratio, reported)
            add(f"{tag}: sets where CALM + T is below temperature alone", "≥ 10/13", agg, wins, reported)
            add(f"{tag}: LoRA CE + T − CALM + T above the seed spread", "> spread", agg, vs_lora, reported)

    def skill(a: Aggregate, m: str, regime: str) -> tuple[float, bool, str]:
        names = sets_of(a, "above chance")
        best = None
        for cand in (m.removesuffix("_ts"), m):  # CALM, then CALM + temperature if needed
            bs = float(np.mean(a.skill(cand, names, "brier")))
            d_auc = a.group_mean(cand, names, "auroc") - a.group_mean("uncalibrated", names, "auroc")
            ok = bs > 0 and abs(d_auc) <= 0.01
            text = f"{LABELS[cand]}: Brier skill {bs:+.3f}, ΔAUROC {d_auc:+.3f}"
            if best is None or ok:
                best = (bs, ok, text)
            if ok:
                break
        return best

    add("MC summed, OOD above chance: Brier skill > 0 with AUROC within 0.01 of uncalibrated (CALM, else CALM + T)",
        "> 0, ±0.01", mc, skill)

    def in_domain(a: Aggregate, m: str, regime: str) -> tuple[float, bool, str]:
        ind = a.task.in_domain
        c, b = a.group_mean(m, ind, "ece"), a.group_mean("temperature_scaling", ind, "ece")
        acc, acc0 = a.group_mean(m, ind, "accuracy"), a.group_mean("uncalibrated", ind, "accuracy")
        return c - b, c <= b + 0.01 and acc >= 0.95 * acc0, (f"conf-ECE {c:.3f} vs temperature {b:.3f}; accuracy "
                                                             f"{acc:.3f} vs uncalibrated {acc0:.3f}")

    for conv, agg in (("summed", mc), ("per-character", char)):
        add(f"MC {conv}, in domain: CALM + T conf-ECE − temperature (and accuracy ≥ 95% of uncalibrated)", "≤ 0.01",
            agg, in_domain)
    return rows


def _target_table(rows: list[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> list[str]:
    """A target table: per row, each ``(key, title)`` column's value with its detail, and its verdict."""
    out = ["| target | limit | " + " | ".join(f"{title} | status" for _, title in columns) + " |",
           "|---|---|" + "---|---|" * len(columns)]
    for r in rows:
        cells = []
        for key, _ in columns:
            c = r[key]
            cells += [f"{format_number(c['value'])} ({c['detail']})", verdict(c["pass"], c["value"] is not None)]
        out.append(f"| {r['target']} | {r['limit']} | " + " | ".join(cells) + " |")
    return out


def _average_tables(agg: Aggregate, methods: Sequence[str]) -> list[str]:
    """Per method, the metrics averaged over the out-of-domain sets, over those of them where the
    uncalibrated model is above chance (multiple choice), and over the in-domain sets."""
    t, out = agg.task, []
    methods = agg.present(methods)
    above = agg.above_chance()
    groups = [("out-of-domain average", t.ood, True)]
    if t.name == "mc":
        if above:
            groups.append(("out-of-domain average, sets above chance", above, True))
        else:
            out += ["**out-of-domain sets above chance**: none (no set's uncalibrated accuracy interval lies above "
                    "chance)", ""]
    groups.append(("in-domain average", t.in_domain, False))
    for title, names, vs_ts in groups:
        rows = []
        for m in methods:
            cells = [LABELS[m], len(agg.runs[m]), *(agg.cell(m, names, k, 3 if k == "ece" else None) for k in agg.metrics)]
            if vs_ts:
                cells += [mean_sd(agg.skill(m, names, "brier")), mean_sd(agg.skill(m, names, "nll")),
                          f"{agg.wins_over_ts(m, names)} of {len(names)}", format_number(agg.oracle_gap(m, names)), "; ".join(agg.flags(m, names)) or "-"]
            rows.append(cells)
        extra = ("Brier skill", "NLL skill", "sets below carried-over TS", "gap to oracle T", "flags") if vs_ts else ()
        how = ""
        if names is above:
            how = (f"; the uncalibrated model's 95% accuracy interval lies above chance (mean 1/K) on these "
                   f"{len(above)} of {len(t.ood)} out-of-domain sets")
        out += [f"**{title}** ({len(names)} sets: {', '.join(names)}); mean ± sd over seeds, conf-ECE with the "
                "bootstrap 95% interval of the seed-mean" + (f"; confidence = {CONFIDENCE[t.name]}" if vs_ts else "") + how
                + ("; skill = 1 − metric / the uncalibrated model's, averaged over the sets; flags: an ECE gain over the "
                   f"uncalibrated model with AUROC within {CHANCE_AUROC} of 0.5 or mean confidence within {NEAR_UNIFORM} "
                   "of 1/K" if vs_ts else ""), "",
                *markdown_table(("method", "seeds", *(METRIC_NAMES[k] for k in agg.metrics), *extra), rows), ""]
    return out


def _per_set_tables(agg: Aggregate, methods: Sequence[str], accuracy: bool = True) -> list[str]:
    t, out = agg.task, []
    methods = agg.present(methods)
    names = (*t.in_domain, *t.ood)

    def tag(n: str) -> str:
        return f"{n} ({'ID' if n in t.in_domain else 'OOD'})"

    rows = [(tag(n), *(agg.cell(m, [n], "ece", 2) for m in methods)) for n in names]
    out += ["**conf-ECE per set** (mean ± sd [bootstrap 95% interval of the seed-mean])", "",
            *markdown_table(("set", *(LABELS[m] for m in methods)), rows), ""]
    if not accuracy:
        return out
    rows = [(tag(n), *(f"{agg.mean(m, n, 'accuracy'):.3f} / {agg.mean(m, n, 'mean_confidence'):.3f}" for m in methods))
            for n in names]
    out += ["**accuracy / mean confidence per set** (seed means)", "",
            *markdown_table(("set", *(LABELS[m] for m in methods)), rows), ""]
    return out


def _cost_table(aggs: dict[str, Aggregate]) -> list[str]:
    out = ["| task | method | runs | train s | eval s | peak RSS train MB (over start) | peak RSS eval MB (over start) |",
           "|---|---|---|---|---|---|---|"]
    for name, agg in aggs.items():
        for m in agg.present(METHODS):
            runs = agg.runs[m]
            tr = [r["timing"]["train_s"] for r in runs]
            ev = [r["timing"]["eval_s"] for r in runs]

            def mem(phase: str, runs: list[dict[str, Any]] = runs) -> str:
                recs = [r["memory"][phase] for r in runs if phase in r.get("memory", {})]
                if not recs:
                    return "-"
                return f"{max(x['peak_rss_mb'] for x in recs):.0f} ({max(x['peak_over_start_mb'] for x in recs):.0f})"

            shared = " (shared pass)" if m in BASELINES else (f" (its {LABELS[DERIVED[m]]} run's)" if m in DERIVED else "")
            out.append(f"| {name} | {LABELS[m]} | {len(runs)} | {mean_sd(tr, 1)} | {mean_sd(ev, 1)}{shared} | "
                       f"{mem('train')} | {mem('eval')} |")
    return out


def _training_table(aggs: dict[str, Aggregate]) -> list[str]:
    out = ["| task | method | selected step per seed | held-out ECE before → after | held-out accuracy before → after | stopped early |",
           "|---|---|---|---|---|---|"]
    for name, agg in aggs.items():
        for m in [m for m in agg.present(METHODS) if m in TRAINED]:
            runs = [r["training"] for r in agg.runs[m]]
            after = [t["heldout_after"] for t in runs]
            before = runs[0]["heldout_before"]
            steps = ", ".join(str(int(a.get("selected_step", -1))) for a in after)
            out.append(f"| {name} | {LABELS[m]} | {steps} | {format_number(before.get('ece'))} → {mean_sd([a.get('ece') for a in after])} | "
                       f"{format_number(before.get('accuracy'))} → {mean_sd([a.get('accuracy') for a in after])} | "
                       f"{sum(bool(a.get('stopped_early')) for a in after)} of {len(after)} |")
    return out


def _reliability_plots(aggs: dict[str, Aggregate], plot_dir: Path) -> list[Path]:
    """One PNG per test set, one panel per method (pooled over seeds)."""
    files = []
    for name, agg in aggs.items():
        methods = agg.present(METHODS)
        for n in (*agg.task.in_domain, *agg.task.ood):
            panels = []
            for m in methods:
                c, k = agg.pooled(m, [n])
                panels.append((f"{LABELS[m]}\nacc {k.mean():.3f}, conf {c.mean():.3f}, ECE {ece(c, k, 10):.3f}",
                               reliability_bins(c, k, n_bins=10).to_dict()))
            path = plot_dir / f"reliability_{name}_{n}.png"
            plot_reliability(panels, path, title=f"{TASK_TITLES[name]}: {n} ({'in' if n in agg.task.in_domain else 'out of'} "
                             "domain; trained methods pooled over seeds)", columns=6)
            files.append(path)
    return files


def _summary_plot(aggs: dict[str, Aggregate], path: Path) -> Path:
    """Out-of-domain mean conf-ECE per method with the bootstrap 95% interval of the seed-mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(f"MC, regime {g}", aggs["mc"], REGIME_METHODS[g]) for g in ("A", "B") if "mc" in aggs]
    if "open" in aggs:
        groups.append(("open-ended (regime A)", aggs["open"], aggs["open"].ctx.methods_for("open")))
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.8), squeeze=False)
    for ax, (title, agg, methods) in zip(axes[0], groups, strict=True):
        ms = agg.present(methods)
        means = [agg.group_mean(m, agg.task.ood, "ece") for m in ms]
        cis = [agg.ece_interval(m, agg.task.ood) for m in ms]
        err = np.array([[mu - lo for mu, (lo, _) in zip(means, cis, strict=True)],
                        [hi - mu for mu, (_, hi) in zip(means, cis, strict=True)]])
        colors = ["tab:green" if m.startswith("calm") else "tab:gray" if m in BASELINES else "tab:blue" for m in ms]
        ax.barh(range(len(ms)), means, xerr=np.clip(err, 0, None), color=colors, capsize=3)
        ax.set_yticks(range(len(ms)), [LABELS[m] for m in ms], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(f"out-of-domain mean conf-ECE ({len(agg.task.ood)} sets)")
        ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _char_section(agg: Aggregate) -> list[str]:
    methods = agg.present(("uncalibrated", "temperature_scaling", "oracle_temperature", "lora_ce", "lora_ce_ts",
                           "calm_bome", "calm_bome_ts", "calm_f2sa", "calm_bome_B", "calm_bome_B_ts", "calm_f2sa_B",
                           *CHAR_TRAINED))
    temps = agg.runs.get("temperature_scaling", [{}])[0]
    return ["## Multiple choice under per-character scores (lm-eval `acc_norm`)", "",
            "The same forward passes, each option's summed log-likelihood divided by the length of `\" \" + option`; "
            f"temperature scaling refitted under this convention on the held-out split (T = "
            f"{format_number(temps.get('temperature_char'))}), the oracle per set; trained models as trained: under summed "
            "scores, except the rows `trained per-character` (trained and selected under this convention); `+ temperature "
            "scaling` rows refit their temperature on the trained model's held-out scores under this convention.",
            "", *_average_tables(agg, methods), *_per_set_tables(agg, methods, accuracy=False)]


def write_report(ctx: Ctx, tasks: dict[str, Task], command: str, elapsed: float) -> str:
    aggs = {name: Aggregate(ctx, task) for name, task in tasks.items()}
    char = Aggregate(ctx, tasks["mc"], "char") if "mc" in tasks else None
    plot_dir = ctx.out / "calibration"
    files = []
    if ctx.plots:
        files = [_summary_plot(aggs, plot_dir / "summary_ood_ece.png"), *_reliability_plots(aggs, plot_dir)]
    meta = machine_info(torch.get_num_threads())
    s = ctx.sizes
    compute = sum(r["timing"]["train_s"] + (0 if r["method"] != "uncalibrated" and r["method"] in BASELINES else r["timing"]["eval_s"])
                  for agg in aggs.values() for m, runs in agg.runs.items() if m not in DERIVED for r in runs)
    any_task = next(iter(tasks.values()))
    guard = f"{ctx.config(any_task, 'lora_ce', 0).selection.guard_accuracy:.0%}"
    lines = [
        "# Calibration benchmark v3: CALM against post-hoc and training-time baselines, alone and followed by a "
        "temperature, both regimes", "",
        *provenance_lines(command, meta, mode=s.name, elapsed_s=elapsed),
        f"- Compute recorded in the result files: {compute / 60:.1f} min",
        f"- Model: `{s.model}`; LoRA rank {s.lora_rank} (alpha {2 * s.lora_rank}) on q_proj/v_proj of the top {s.top_layers} "
        f"of {ctx.n_layers} layers; seeds with results: {_seed_counts(aggs)}; the same data, {s.steps} steps (open-ended: {ctx.steps('open')}) of batch "
        f"{s.batch_size}, held-out evaluations every {s.eval_every} steps and the library's selection rule (lowest "
        f"held-out ECE among evaluations whose held-out accuracy is at least {guard} of the initial one) for every method.",
        f"- Hyperparameters: {ctx.hparams_source}.",
        "- Methods without results (not run: time): " + ("; ".join(
            f"{name}: " + ", ".join(LABELS[m] for m in missing) for name, agg in aggs.items()
            if (missing := [m for m in METHODS if m not in agg.runs and not (name == "open" and m in OPEN_SKIPS)]))
            or "none") + ".",
        f"- Per-(method, seed) results: `{_rel(ctx.runs)}/<task>/<method>-seed<k>.json` (resumable).", "",
        "## Targets (v3)", "", "CALM (BOME) followed by a temperature fitted in domain on its held-out scores and "
        "carried out of domain (`+ T`), one column per regime of unlabelled inputs. Means over seeds; out-of-domain "
        "(OOD) means weigh the sets equally; `v2 sets` are the 13 out-of-domain sets of the v2 protocol, `above chance` "
        "those of them where the uncalibrated model's 95% accuracy interval lies above chance. The seed spread is the "
        "larger seed standard deviation of the two methods' OOD means. Rows marked `(reported)` repeat a target under "
        "another convention or subset. The last column trains and selects CALM and LoRA CE under per-character scores "
        "(`normalize=\"char\"`, the same hyperparameters) and is compared under that convention.", "",
        *_target_table(targets_v3(aggs.get("mc"), char),
                       (("A", "regime A: CALM (BOME) + T"), ("B", "regime B: CALM (BOME, B) + T"),
                        ("A_char", "regime A, trained per-character: CALM (BOME) + T"))), "",
        "### The v2 targets", "", "Kept for comparison (a trained model without a temperature against a carried "
        "temperature; retired in v3 as not reachable on this model, see `temperature_frontier.md`). Columns: CALM with "
        "BOME and with F2SA; rows `MC A` use regime A's CALM, `MC B` regime B's.", "",
        *_target_table(targets(aggs.get("mc"), aggs.get("open")), (("bome", "CALM (BOME)"), ("f2sa", "CALM (F2SA)"))), "",
    ]
    if files:
        lines += [f"![summary]({_rel(files[0], ctx.out)})", ""]
    for name, agg in aggs.items():
        how = (f"Cloze prompt, options scored by {CONVENTIONS['sum']}, softmax over options" if name == "mc" else
               f"Greedy answers up to {s.max_new_tokens} tokens, SQuAD exact match, confidence = mean token probability; "
               "temperature on the answer-token logits fitted on the held-out greedy answers (the oracle row: on each "
               "test set's own answers)")
        lines += [f"## {TASK_TITLES[name]}", "", f"{agg.task.description} {how}. Test sets: "
                  + "; ".join(f"{k}: {v}" for k, v in agg.task.sources.items()) + ".", ""]
        ts = agg.runs.get("temperature_scaling", [{}])[0]
        if ts.get("temperature"):
            lines += [f"Temperature fitted on the held-out split: T = {ts['temperature']:.3f}; oracle temperatures: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in agg.runs["oracle_temperature"][0]["temperature"].items())
                      + ".", ""] if "oracle_temperature" in agg.runs else [f"T = {ts['temperature']:.3f}.", ""]
        if name == "mc":
            for regime, title in (("A", "unlabelled inputs from the training domain (ARC dev)"),
                                  ("B", "unlabelled inputs from the target domains (OOD prompts)")):
                lines += [f"### Regime {regime}: {title}", "", *_average_tables(agg, REGIME_METHODS[regime])]
            lines += ["### Per set (both regimes)", "", *_per_set_tables(agg, METHODS)]
        else:
            lines += [*_average_tables(agg, ctx.methods_for(name)), *_per_set_tables(agg, ctx.methods_for(name))]
    if char is not None:
        lines += _char_section(char)
    lines += ["## Training: what the selection rule kept", "", "Selected step 0 means the run deployed the base model "
              "unchanged; open-ended held-out metrics are what selection measured (`selection.open_metric`: by default the "
              "held-out greedy answers' ECE; the teacher-forced proxy is recorded beside it as `teacher_forced_ece`).", "",
              *_training_table(aggs), "",
              "## Wall time and peak memory per method", "", "Seconds per run (mean ± sd over seeds), training and "
              "evaluation; peak RSS of the phase (`VmHWM` after a reset), max over seeds, in parentheses above the RSS at "
              f"the phase start. Trained runs in {ctx.workers} forked worker(s), {torch.get_num_threads()} thread(s) each; "
              f"base passes with {ctx.base_threads} thread(s).", "", *_cost_table(aggs), ""]
    if ctx.timings:
        lines += ["Phases of this invocation (s): " + ", ".join(f"{k} {v:.0f}" for k, v in ctx.timings.items()), ""]
    lines += ["## Reliability diagrams", "", "One figure per test set, one panel per method (trained methods pooled over "
              "their seeds).", "", *[f"![{f.stem}]({_rel(f, ctx.out)})" for f in files[1:]], "", "## Hyperparameters", "",
              f"Source: {ctx.hparams_source}. `--search` reruns a search on the in-domain held-out split. Rule: {SEARCH_RULE}", ""]
    for name, task in tasks.items():
        for m in [m for m in ctx.methods_for(name) if m in TRAINED]:
            cfg = flat_config(ctx.config(task, m, 0))
            keys = (*RELEVANT[base_method(m)], *(("normalize",) if m in TRAINED_NORMALIZE else ()))
            lines.append(f"- {name} / {LABELS[m]}: `{json.dumps({k: cfg[k] for k in keys})}`")
    lines.append("")
    text = "\n".join(lines)
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / "calibration.md").write_text(text)
    return text


def _seed_counts(aggs: dict[str, Aggregate]) -> str:
    """Seeds found per trained method and task, read from the results (not from the sizes asked for)."""
    return "; ".join(f"{name}: " + ", ".join(f"{LABELS[m]} {len(runs)}" for m, runs in agg.runs.items()
                                              if m not in BASELINES and m not in DERIVED)
                     for name, agg in aggs.items())


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
        source = f"the in-domain search `{_rel(path)}` ({', '.join(searched) or 'no task'}) over the built-in settings ({HPARAMS_SOURCE})"
        return {k: data.get(k, {}) for k in ("mc", "open")}, source
    if path is not None:
        raise SystemExit(f"--hparams {path}: file not found")
    return {}, HPARAMS_SOURCE


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
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated subset of {', '.join(METHODS)} (default: all but calm_f2sa_B)")
    p.add_argument("--open-methods", default=None,
                   help="comma-separated methods of the open-ended task (default: --methods)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the trained runs (default 1: faster than 2 on a busy 2-core machine)")
    p.add_argument("--base-threads", type=int, default=None,
                   help="torch threads of the base passes and the trunk fill, which run alone (default 2; --quick: 1)")
    p.add_argument("--hparams", type=Path, default=None,
                   help="search result to read (main run) or write (--search); default: the built-in settings")
    p.add_argument("--search", action="store_true", help="choose hyperparameters on in-domain data only, then exit")
    p.add_argument("--report-only", action="store_true",
                   help="write the report from the finished result files and run nothing (missing runs are listed)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-plots", action="store_true", help="skip the figures")
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
    open_methods = tuple(m.strip() for m in args.open_methods.split(",") if m.strip()) if args.open_methods else None
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    bad = [m for m in (*methods, *(open_methods or ())) if m not in METHODS] + [t for t in tasks if t not in ("mc", "open")]
    if bad:
        raise SystemExit(f"unknown method(s)/task(s): {bad} (methods: {', '.join(METHODS)}; tasks: mc, open)")
    if args.search and args.hparams is None:
        raise SystemExit("--search needs --hparams FILE (where to write the chosen settings)")
    hparams, source = load_hparams(None if args.search else args.hparams)
    base_threads = args.base_threads if args.base_threads is not None else (1 if args.quick else 2)
    return Ctx(sizes, data_dir, out, args.results_dir or out / "calibration_runs", methods, tasks, hparams, source,
               progress=not args.no_progress, plots=not args.no_plots,
               workers=args.workers if args.workers is not None else (1 if args.quick else 2), base_threads=base_threads,
               open_methods=open_methods)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        with torch_threads(args.threads):
            return _main(args, argv)
    finally:
        gc.unfreeze()  # a no-op unless --quick froze the objects alive after the model load


def _main(args: argparse.Namespace, argv: list[str]) -> int:
    ctx = build_ctx(args)
    if args.quick:  # a few built-in held-out questions, by design: the library's small-split warning is expected
        warnings.filterwarnings("ignore", message=".*held-out questions: model selection", category=UserWarning)
    command = "python benchmarks/calibration_bench.py" + ("" if not argv else " " + " ".join(argv))
    t_start = time.perf_counter()
    ctx.log(f"calibration benchmark ({ctx.sizes.name}): model {ctx.sizes.model}, data "
            f"{ctx.data_dir or 'built-in'}, results in {ctx.runs}")
    ctx.load_model()
    if args.quick:
        # Each run starts with a full garbage collection (free_memory, for its memory figures): the
        # quick run's 72 collections took 19.8 of its 40.2 CPU s (635k objects tracked at the end).
        # The objects alive now outlive the run; moved out of the collector's sight (gc.freeze), the
        # collections took 4.3 CPU s (total 25.0). main() gives them back (gc.unfreeze).
        gc.freeze()
    tasks = {}
    for name in ctx.tasks:
        tasks[name] = (mc_task if name == "mc" else open_task)(ctx.data_dir, ctx.sizes)
        t = tasks[name]
        ctx.log(f"[{name}] train {len(t.train)}, held-out {len(t.heldout)}, unlabelled "
                + ", ".join(f"{g} {len(u)}" for g, u in t.unlabeled.items()) + ", tests "
                + ", ".join(f"{k} {len(v)}" for k, v in t.tests.items()))
    if args.search:
        run_search(ctx, tasks, args.hparams)
        return 0
    for task in tasks.values() if not args.report_only else ():
        run_task(ctx, task)
    elapsed = time.perf_counter() - t_start
    write_report(ctx, tasks, command, elapsed)
    ctx.log(f"wrote {ctx.out / 'calibration.md'} ({elapsed / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
