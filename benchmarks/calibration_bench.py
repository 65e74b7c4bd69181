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
    .venv/bin/python benchmarks/calibration_bench.py --set open_test=200 --steps 40   # other sizes

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
import contextlib
import copy
import dataclasses
import datetime as _dt
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers beside this script
from _memory import Phase as MeasuredPhase
from torch import Tensor

from llm_calib.calm.encoding import encode_records
from llm_calib.calm.fast_eval import GenOut, TrunkGenerator, base_scores, trunk_scores
from llm_calib.calm.training import is_selectable
from llm_calib.checkpoint import write_json_atomic
from llm_calib.metrics import ece_resamples
from llm_calib.models import free_memory
from llm_calib.report import machine_info

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_DATA = ROOT.parent / "shared" / "data"
DEFAULT_HPARAMS = RESULTS / "calibration_hparams.json"
ALIAS = "smollm2-135m-instruct"
MB = 1024.0 * 1024.0

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
    """Sizes and budgets of one mode (the full run: about 75 minutes on 2 cores)."""

    name: str
    model: str = ALIAS  # a model name for llm_calib.models.load, or "tiny" (tiny_random_model)
    seeds: int = 3
    top_layers: int = 6
    lora_rank: int = 8
    mc_train: int = 400  # ARC-Easy + ARC-Challenge train, half each
    mc_heldout: int = 150  # ARC-Easy dev: upper-level inputs, early stopping, temperature fit
    mc_select: int = 300  # --search only: rest of ARC-Easy dev + ARC-Challenge dev
    mc_test: int = 300
    open_train: int = 400
    open_heldout: int = 150
    open_select: int = 150
    open_test: int = 150
    steps: int = 30
    open_steps: int = 30
    batch_size: int = 8
    evals_per_run: int = 2  # held-out evaluations during training (plus before and after)
    eval_batch_size: int = 16
    gen_batch_size: int = 16
    max_new_tokens: int = 10
    bootstrap: int = 1000
    builtin_per_domain: int = 30  # built-in data (no data directory)


FULL = Sizes("full")
QUICK = Sizes(
    "quick", model="tiny", seeds=2, top_layers=1, lora_rank=2, mc_train=16, mc_heldout=8,
    mc_select=8, mc_test=10, open_train=8, open_heldout=6, open_select=6, open_test=8, steps=3,
    open_steps=3, batch_size=4, evals_per_run=1, eval_batch_size=8, gen_batch_size=8,
    max_new_tokens=4, bootstrap=50, builtin_per_domain=30,
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
        return _hash(parts)


def _hash(obj: Any) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _split(records: Sequence[Any], sizes: Sequence[int], seed: int = 0) -> list[list[Any]]:
    """Disjoint seeded parts of ``records`` (each in file order)."""
    perm = np.random.default_rng(seed).permutation(len(records))
    out, start = [], 0
    for n in sizes:
        take = np.sort(perm[start : start + n])
        out.append([records[int(i)] for i in take])
        start += n
    if start > len(records):
        raise ValueError(f"need {start} records, have {len(records)}")
    return out


def mc_task(data_dir: Path | None, sizes: Sizes) -> Task:
    """The multiple-choice task: real data from ``data_dir``, or the built-in generated set."""
    from llm_calib.data import builtin_multiple_choice, load

    if data_dir is None:
        qs = builtin_multiple_choice(n_per_domain=sizes.builtin_per_domain, seed=0)
        by: dict[str, list[Any]] = {}
        for q in qs:
            by.setdefault(q.domain, []).append(q)
        half = sizes.mc_train // 2
        a_train, a_held, a_sel, a_test = _split(by["arithmetic"], [half, sizes.mc_heldout, sizes.mc_select // 2, sizes.mc_test])
        u_train, u_sel, u_test = _split(by["unit_conversion"], [sizes.mc_train - half, sizes.mc_select - sizes.mc_select // 2, sizes.mc_test])
        tests = {"arithmetic": a_test, "unit_conversion": u_test}
        ood = ("calendar", "capitals", "chemical_symbols")
        for d in ood:
            tests[d] = _split(by[d], [sizes.mc_test])[0]
        src = {k: f"`builtin:{k}` ({len(v)})" for k, v in tests.items()}
        desc = (f"Built-in generated questions. Training: {len(a_train) + len(u_train)} arithmetic and unit-conversion "
                f"questions; held-out inputs and temperature fit: {len(a_held)} arithmetic questions.")
        return Task("mc", a_train + u_train, a_held, a_sel + u_sel, tests, ("arithmetic", "unit_conversion"), ood, src, desc)
    D = str(data_dir)
    half = sizes.mc_train // 2
    train = load(f"arc_easy:{D}:train", limit=half).records + load(f"arc_challenge:{D}:train", limit=sizes.mc_train - half).records
    dev = load(f"arc_easy:{D}:dev").records
    heldout, sel_easy = _split(dev, [sizes.mc_heldout, min(sizes.mc_select // 2, len(dev) - sizes.mc_heldout)])
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


def _builtin_open(n: int) -> dict[str, list[Any]]:
    from llm_calib.data import CAPITALS, ELEMENTS, OpenQA

    sums = [OpenQA(f"What is {a} plus {b}?", (str(a + b),), "sums", f"sum-{a}-{b}")
            for a in range(2, 12) for b in range(3, 9)][: 4 * n]
    caps = [OpenQA(f"What is the capital of {c[0]}?", (c[1],), "capitals", f"cap-{c[0]}") for c in CAPITALS][:n]
    els = [OpenQA(f"What is the chemical symbol of {e[0]}?", (e[1],), "elements", f"el-{e[0]}") for e in ELEMENTS][:n]
    return {"sums": sums, "capitals": caps, "elements": els}


def open_task(data_dir: Path | None, sizes: Sizes) -> Task:
    """The open-ended task: NQ-open dev split into train / held-out / selection / in-domain test."""
    from llm_calib.data import load

    parts = [sizes.open_test, sizes.open_heldout, sizes.open_select, sizes.open_train]
    if data_dir is None:
        pools = _builtin_open(max(sizes.open_test, 1) + sum(parts))
        test, heldout, select, train = _split(pools["sums"], parts)
        tests = {"sums": test, "capitals": _split(pools["capitals"], [sizes.open_test])[0],
                 "elements": _split(pools["elements"], [sizes.open_test])[0]}
        src = {k: f"built-in open questions `{k}` ({len(v)})" for k, v in tests.items()}
        desc = f"Built-in open questions. Training: {len(train)} sums; held-out: {len(heldout)} other sums."
        return Task("open", train, heldout, select, tests, ("sums",), ("capitals", "elements"), src, desc)
    D = str(data_dir)
    nq = [r for r in load(f"nq_open:{D}").records if r.answers]
    test, heldout, select, train = _split(nq, parts)
    tests = {"nq_open": test}
    src = {"nq_open": f"`nq_open:<data>` ({len(test)} of {len(nq)}, disjoint from train/held-out)"}
    for name, spec in (("webquestions", f"webquestions:{D}"), ("selfaware_triviaqa", f"selfaware:{D}:triviaqa")):
        full = [r for r in load(spec).records if r.answerable and r.answers]
        tests[name] = _split(full, [min(sizes.open_test, len(full))])[0]
        src[name] = f"`{spec.replace(D, '<data>')}` ({len(tests[name])} of {len(full)} answerable)"
    desc = (f"Training: {len(train)} NQ-open dev questions (first alias as the target); held-out: {len(heldout)} "
            "other NQ-open dev questions.")
    return Task("open", train, heldout, select, tests, ("nq_open",), ("webquestions", "selfaware_triviaqa"), src, desc)


# ------------------------------------------------------------------------- timing and memory






class Phase(MeasuredPhase):
    """Wall time and peak RSS of one phase, as a result-file record."""

    def record(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "peak_rss_mb": self.peak / MB, "peak_over_start_mb": self.over / MB, "how": self.how}


def shared_encoding(memo: dict[Any, Any], tokenizer: Any, records: Sequence[Any], config: Any) -> Any:
    """One encoding (and trunk cache) per split, reused by every run of a task (same records and LoRA layers)."""
    key = (tuple(f"{r.domain}/{r.id}" for r in records), config.scorer, config.prompt_style, config.chat_template,
           config.lora.layers)
    if key not in memo:
        memo[key] = encode_records(tokenizer, records, config)
    return memo[key]


# ---------------------------------------------------------------- multiple choice: scoring


def open_set(records: Sequence[Any], outs: Sequence[GenOut], temperature_index: int | None = None) -> Any:
    """An :class:`~llm_calib.scoring.open_ended.OpenEndedSet` of greedy answers; with
    ``temperature_index`` the token probabilities at that grid temperature."""
    from llm_calib.scoring.open_ended import OpenEndedSet

    if temperature_index is None:
        token_probs = [o.token_probs for o in outs]
    else:
        token_probs = [tuple(float(p) for p in o.temp_probs[:, temperature_index]) for o in outs]
    return OpenEndedSet([o.text for o in outs], [tuple(r.answers) for r in records], [r.domain for r in records],
                        [r.id for r in records], token_probs)


def fit_open_temperature(records: Sequence[Any], outs: Sequence[GenOut]) -> tuple[float, int]:
    """The grid temperature minimising the log-loss of correctness of the mean-token-probability
    confidence on held-out greedy answers (answers do not change with T; confidences do)."""
    scored = open_set(records, outs)
    correct = scored.correct.astype(np.float64)
    conf = np.stack([o.temp_probs.mean(0) for o in outs])  # (N, G)
    conf = np.clip(conf, 1e-12, 1 - 1e-12)
    loss = -(correct[:, None] * np.log(conf) + (1 - correct[:, None]) * np.log(1 - conf)).mean(0)
    g = int(np.argmin(loss))
    return float(TEMPERATURE_GRID[g]), g


# --------------------------------------------------------------------------------- metrics


def mc_metrics(scores: Sequence[Tensor], labels: Sequence[int], bootstrap: int) -> dict[str, float]:
    from llm_calib.metrics import summarize

    probs = [torch.softmax(s.double(), 0).numpy() for s in scores]
    return summarize(probs, np.asarray(labels), n_bins=10, ci=bootstrap > 0, n_resamples=max(bootstrap, 1), seed=0)


def open_metrics(scored: Any, bootstrap: int) -> dict[str, float]:
    from llm_calib.evaluate import open_ended_summary

    return open_ended_summary(scored, n_bins=10, ci=bootstrap > 0, n_resamples=max(bootstrap, 1), seed=0)


def _mc_questions(scores: Sequence[Tensor], labels: Sequence[int]) -> dict[str, Any]:
    return {"probs": [[round(float(p), 6) for p in torch.softmax(s.double(), 0)] for s in scores],
            "labels": [int(y) for y in labels]}


def _open_questions(scored: Any) -> dict[str, Any]:
    conf = np.clip(scored.confidence("mean"), 0, 1)
    return {"conf": [round(float(c), 6) for c in conf], "correct": [int(k) for k in scored.correct],
            "answers": list(scored.answers)}


def conf_correct(task: str, q: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Per-question confidence and correctness from a stored result."""
    if task == "mc":
        conf = np.asarray([max(p) for p in q["probs"]], dtype=np.float64)
        pred = np.asarray([int(np.argmax(p)) for p in q["probs"]])
        return np.clip(conf, 0, 1), (pred == np.asarray(q["labels"])).astype(np.float64)
    return np.asarray(q["conf"], dtype=np.float64), np.asarray(q["correct"], dtype=np.float64)


# ------------------------------------------------------------------------------ result files


def result_path(runs: Path, task: str, method: str, seed: int) -> Path:
    return runs / task / f"{method}-seed{seed}.json"


def read_result(path: Path, fingerprint: str | None = None) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if fingerprint is not None and data.get("fingerprint") != fingerprint:
        return None
    return data


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
    worker: int | None = None  # set inside a forked worker
    log_lines: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    model: Any = None
    tokenizer: Any = None

    def log(self, message: str) -> None:
        tag = f" (worker {self.worker})" if self.worker is not None else ""
        line = f"[{_dt.datetime.now().strftime('%H:%M:%S')}] {message}{tag}"
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
        self.log_lines.append(line)
        with contextlib.suppress(OSError):
            self.runs.mkdir(parents=True, exist_ok=True)
            with (self.runs / "bench.log").open("a") as fh:
                fh.write(line + "\n")

    def bar(self, total: int, desc: str) -> Any:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="q", dynamic_ncols=True, disable=not self.progress, leave=False)

    def seeds(self, method: str) -> list[int]:
        return [0] if method in BASELINES else list(range(self.sizes.seeds))

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
            from llm_calib.models import tiny_random_model

            self.model, self.tokenizer = tiny_random_model(seed=0, num_layers=3)
        else:
            from llm_calib.models import load

            self.model, self.tokenizer = load(self.sizes.model)
        for p in self.model.parameters():
            p.requires_grad_(False)
        if not 0 < self.sizes.top_layers < self.n_layers:
            raise ValueError(f"top_layers must be in [1, {self.n_layers - 1}], got {self.sizes.top_layers}")
        self.timings["load model"] = time.perf_counter() - t0

    def config(self, task: str, method: str, seed: int, overrides: dict[str, Any] | None = None) -> Any:
        from llm_calib.calm.config import CalibrationConfig, LoraSettings

        objective, solver = TRAINED[method]
        steps = self.sizes.steps if task == "mc" else self.sizes.open_steps
        params = dict(BUILTIN_HPARAMS[method])
        params.update(self.hparams.get(task, {}).get(method, {}))
        params.update(overrides or {})
        return CalibrationConfig(
            method=objective, solver=solver, steps=steps, batch_size=self.sizes.batch_size,
            heldout_batch_size=self.sizes.batch_size, eval_every=max(1, steps // self.sizes.evals_per_run),
            seed=seed, lora=LoraSettings(rank=self.sizes.lora_rank, alpha=2.0 * self.sizes.lora_rank,
                                         layers=tuple(range(self.trunk_layers, self.n_layers))),
            **params,
        )

    def encoding_config(self) -> Any:
        from llm_calib.calm.config import CalibrationConfig, LoraSettings

        return CalibrationConfig(lora=LoraSettings(rank=self.sizes.lora_rank, layers=tuple(range(self.trunk_layers, self.n_layers))))

    def fingerprint(self, task: Task, method: str, cfg: Any = None) -> str:
        s = self.sizes
        eval_part = {"model": s.model, "top_layers": s.top_layers, "bootstrap": s.bootstrap,
                     "eval": "option_likelihood/sum/cloze" if task.name == "mc" else f"greedy/{s.max_new_tokens}"}
        return _hash({"task": task.fingerprint(), "method": method, "eval": eval_part,
                      "config": cfg.to_dict() if cfg is not None else None})


def _timed_calibrate(ctx: Ctx, task: Task, cfg: Any, memo: dict[Any, Any]) -> tuple[Any, Phase]:
    from llm_calib.calm.trainer import calibrate

    model = copy.deepcopy(ctx.model)
    with Phase() as phase:
        train, heldout = (shared_encoding(memo, ctx.tokenizer, r, cfg) for r in (task.train, task.heldout))
        result = calibrate(model, ctx.tokenizer, train, heldout, cfg, progress=ctx.progress)
    return result, phase


def _prefill_training(ctx: Ctx, task: Task, memo: dict[Any, Any]) -> None:
    """Fill the trunk caches of the training and held-out encodings once for every run of the task."""
    from llm_calib.calm.encoding import TRUNK_CHUNK
    from llm_calib.calm.lora import FunctionalLM, attach_lora

    cfg = ctx.encoding_config()
    lm = FunctionalLM(attach_lora(copy.deepcopy(ctx.model), cfg.lora))
    encs = [shared_encoding(memo, ctx.tokenizer, r, cfg) for r in (task.train, task.heldout)]
    n = sum(len(e) - len(e.trunk_cache) for e in encs)
    ctx.log(f"[{task.name}] trunk of the training and held-out questions ({n} to compute)")
    bar = ctx.bar(n, f"{task.name} training trunk")
    for enc in encs:
        for start in range(0, len(enc), TRUNK_CHUNK):
            chunk = range(start, min(start + TRUNK_CHUNK, len(enc)))
            bar.update(sum(i not in enc.trunk_cache for i in chunk))
            enc.fill_trunk_cache(lm, ctx.tokenizer.pad_token_id or 0, chunk)
    bar.close()
    del lm
    free_memory()


def _training_record(result: Any) -> dict[str, Any]:
    return {"heldout_before": result.metrics.get("before", {}), "heldout_after": result.metrics.get("after", {}),
            "timings": result.timings, "history": result.history}


def _write_baseline_run(ctx: Ctx, task: Task, method: str, sets: dict[str, Any], questions: dict[str, Any],
                        phase: Phase, *, temperature: float | None, train_s: float, note: str) -> None:
    """Write one baseline (uncalibrated or temperature-scaled) result file atomically and log it."""
    record = {
        "task": task.name, "method": method, "seed": 0, "fingerprint": ctx.fingerprint(task, method),
        "sets": sets, "questions": questions, "temperature": temperature,
        "timing": {"train_s": train_s, "eval_s": phase.seconds}, "memory": {"eval": phase.record()},
        "note": note, "finished": _dt.datetime.now().isoformat(timespec="seconds"),
    }
    write_json_atomic(result_path(ctx.runs, task.name, method, 0), record)
    ctx.log(f"[{task.name}] {method}: written (OOD mean ECE {np.mean([sets[n]['ece'] for n in task.ood]):.3f})")


def _write_trained_run(ctx: Ctx, task: Task, method: str, seed: int, cfg: Any, result: Any, sets: dict[str, Any],
                       questions: dict[str, Any], train_phase: Phase, eval_phase: Phase) -> None:
    """Write one trained (method, seed) result file atomically, account its time, log it."""
    kind = task.name
    record = {
        "task": kind, "method": method, "seed": seed, "fingerprint": ctx.fingerprint(task, method, cfg),
        "config": cfg.to_dict(), "sets": sets, "questions": questions, "training": _training_record(result),
        "timing": {"train_s": train_phase.seconds, "eval_s": eval_phase.seconds},
        "memory": {"train": train_phase.record(), "eval": eval_phase.record()},
        "process": {"workers": ctx.workers, "threads": torch.get_num_threads()},
        "finished": _dt.datetime.now().isoformat(timespec="seconds"),
    }
    write_json_atomic(result_path(ctx.runs, kind, method, seed), record)
    ctx.timings[f"{kind} train"] = ctx.timings.get(f"{kind} train", 0.0) + train_phase.seconds
    ctx.timings[f"{kind} eval trained"] = ctx.timings.get(f"{kind} eval trained", 0.0) + eval_phase.seconds
    ctx.log(f"[{kind}] {method} seed {seed}: written (train {train_phase.seconds:.0f}s, eval {eval_phase.seconds:.0f}s, "
            f"OOD mean ECE {np.mean([sets[n]['ece'] for n in task.ood]):.3f})")


# ------------------------------------------------------------------------- the MC task


class MCRunner:
    """Runs the multiple-choice task: base pass, temperature fit, trained methods."""

    def __init__(self, ctx: Ctx, task: Task) -> None:
        self.ctx, self.task = ctx, task
        self.tok = ctx.tokenizer
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        self.enc_cfg = ctx.encoding_config()

        self.memo: dict[Any, Any] = {}
        self.heldout = shared_encoding(self.memo, self.tok, task.heldout, self.enc_cfg)
        self.tests = {name: encode_records(self.tok, recs, self.enc_cfg) for name, recs in task.tests.items()}
        self.base_scores: dict[str, list[Tensor]] | None = None

    def prepare_training(self) -> None:
        _prefill_training(self.ctx, self.task, self.memo)

    def base_pass(self) -> Phase:
        s = self.ctx.sizes
        encs = {"heldout": self.heldout, **self.tests}
        total = sum(len(e.records) for e in encs.values())
        self.ctx.log(f"[mc] base pass: {total} questions through the full model (uncalibrated scores + trunk at layer {self.ctx.trunk_layers})")
        bar = self.ctx.bar(total, "mc base pass")
        with Phase() as phase:
            self.base_scores = {name: base_scores(self.ctx.model, enc, self.ctx.trunk_layers, s.eval_batch_size,
                                                   self.pad_id, self.enc_cfg.normalize, bar) for name, enc in encs.items()}
        bar.close()
        self.ctx.timings["mc base pass"] = self.ctx.timings.get("mc base pass", 0.0) + phase.seconds
        return phase

    def baselines(self, pending: set[str], phase: Phase) -> None:
        from llm_calib.temperature import fit_temperature

        assert self.base_scores is not None
        t0 = time.perf_counter()
        held = self.base_scores["heldout"]
        temperature = fit_temperature(held, [r.gold for r in self.task.heldout])
        fit_s = time.perf_counter() - t0
        self.ctx.log(f"[mc] temperature fitted on the held-out split ({len(held)} questions): T = {temperature:.3f}")
        for method in BASELINES:
            if method not in pending:
                continue
            T = temperature if method == "temperature_scaling" else 1.0
            sets, questions = {}, {}
            for name, recs in self.task.tests.items():
                scores = [z / T for z in self.base_scores[name]]
                labels = [r.gold for r in recs]
                sets[name] = mc_metrics(scores, labels, self.ctx.sizes.bootstrap)
                questions[name] = _mc_questions(scores, labels)
            _write_baseline_run(self.ctx, self.task, method, sets, questions, phase,
                                temperature=temperature if T != 1.0 else None, train_s=fit_s if T != 1.0 else 0.0,
                                note="one full-model pass gives both baselines"
                                + (f"; T fitted on held-out in {fit_s:.2f}s" if T != 1.0 else ""))

    def trained(self, method: str, seed: int) -> None:
        from llm_calib.calm.lora import FunctionalLM

        ctx = self.ctx
        cfg = ctx.config("mc", method, seed)
        ctx.log(f"[mc] {method} seed {seed}: training {cfg.steps} steps")
        result, train_phase = _timed_calibrate(ctx, self.task, cfg, self.memo)
        lm = FunctionalLM(result.model)
        if lm.trunk_layers != ctx.trunk_layers:
            raise RuntimeError(f"expected the trunk to end at layer {ctx.trunk_layers}, got {lm.trunk_layers}")
        total = sum(len(e.records) for e in self.tests.values())
        bar = ctx.bar(total, f"mc eval {method} s{seed}")
        with Phase() as eval_phase:
            scores = {name: trunk_scores(lm, enc, ctx.sizes.eval_batch_size, self.pad_id, cfg.normalize, bar)
                      for name, enc in self.tests.items()}
        bar.close()
        sets, questions = {}, {}
        for name, recs in self.task.tests.items():
            labels = [r.gold for r in recs]
            sets[name] = mc_metrics(scores[name], labels, ctx.sizes.bootstrap)
            questions[name] = _mc_questions(scores[name], labels)
        _write_trained_run(ctx, self.task, method, seed, cfg, result, sets, questions, train_phase, eval_phase)
        del result, lm
        free_memory()


# ---------------------------------------------------------------------- the open-ended task


class OpenRunner:
    """Runs the open-ended task: base greedy pass (answers, trunk, temperature grid), trained methods."""

    def __init__(self, ctx: Ctx, task: Task) -> None:
        from llm_calib.prompts import PromptFormat
        from llm_calib.scoring.open_ended import encode_open_prompts

        self.ctx, self.task = ctx, task
        self.memo: dict[Any, Any] = {}
        s = ctx.sizes
        fmt = PromptFormat()
        self.held_gen = TrunkGenerator(ctx.tokenizer, encode_open_prompts(ctx.tokenizer, task.heldout, fmt),
                                      s.gen_batch_size, s.max_new_tokens, ctx.trunk_layers, TEMPERATURE_GRID)
        self.test_records = [r for recs in task.tests.values() for r in recs]
        self.gen = TrunkGenerator(ctx.tokenizer, encode_open_prompts(ctx.tokenizer, self.test_records, fmt),
                                 s.gen_batch_size, s.max_new_tokens, ctx.trunk_layers, TEMPERATURE_GRID)
        self.base_outs: list[GenOut] | None = None
        self.temperature: tuple[float, int] | None = None

    def _slices(self) -> dict[str, slice]:
        out, start = {}, 0
        for name, recs in self.task.tests.items():
            out[name] = slice(start, start + len(recs))
            start += len(recs)
        return out

    def prepare_training(self) -> None:
        _prefill_training(self.ctx, self.task, self.memo)

    def base_pass(self) -> Phase:
        n = len(self.task.heldout) + len(self.test_records)
        self.ctx.log(f"[open] base pass: greedy answers to {n} questions (held-out + tests), trunk kept for the tests")
        bar = self.ctx.bar(n, "open base pass")
        with Phase() as phase:
            held = self.held_gen.base(self.ctx.model, keep_trunk=False, temperatures=True, bar=bar)
            self.temperature = fit_open_temperature(self.task.heldout, held)
            self.base_outs = self.gen.base(self.ctx.model, keep_trunk=True, temperatures=True, bar=bar)
        bar.close()
        self.ctx.timings["open base pass"] = self.ctx.timings.get("open base pass", 0.0) + phase.seconds
        return phase

    def _sets(self, outs: Sequence[GenOut], temperature_index: int | None = None) -> tuple[dict, dict]:
        sets, questions = {}, {}
        for name, sl in self._slices().items():
            scored = open_set(self.task.tests[name], outs[sl], temperature_index)
            sets[name] = open_metrics(scored, self.ctx.sizes.bootstrap)
            questions[name] = _open_questions(scored)
        return sets, questions

    def baselines(self, pending: set[str], phase: Phase) -> None:
        assert self.base_outs is not None and self.temperature is not None
        T, g = self.temperature
        self.ctx.log(f"[open] temperature fitted on the held-out greedy answers: T = {T:.3f}")
        for method in BASELINES:
            if method not in pending:
                continue
            sets, questions = self._sets(self.base_outs, g if method == "temperature_scaling" else None)
            _write_baseline_run(self.ctx, self.task, method, sets, questions, phase,
                                temperature=T if method == "temperature_scaling" else None, train_s=0.0,
                                note="one greedy pass gives both baselines (answers do not depend on T)")

    def trained(self, method: str, seed: int) -> None:
        ctx = self.ctx
        cfg = ctx.config("open", method, seed)
        ctx.log(f"[open] {method} seed {seed}: training {cfg.steps} steps")
        result, train_phase = _timed_calibrate(ctx, self.task, cfg, self.memo)
        bar = ctx.bar(len(self.test_records), f"open eval {method} s{seed}")
        with Phase() as eval_phase:
            outs = self.gen.trained(result.model, bar)
        bar.close()
        sets, questions = self._sets(outs)
        _write_trained_run(ctx, self.task, method, seed, cfg, result, sets, questions, train_phase, eval_phase)
        del result
        free_memory()


def run_task(ctx: Ctx, task: Task) -> None:
    """Run every pending (method, seed) of a task, skipping finished results."""
    from llm_calib.calm.config import CalibrationConfig  # noqa: F401  (fail early on a broken install)

    todo: list[tuple[str, int]] = []
    for seed in range(ctx.sizes.seeds):
        for method in ctx.methods:
            if seed in ctx.seeds(method):
                todo.append((method, seed))
    pending: list[tuple[str, int]] = []
    for method, seed in todo:
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
    runner: MCRunner | OpenRunner = MCRunner(ctx, task) if task.name == "mc" else OpenRunner(ctx, task)
    pending_baselines = {m for m, _ in pending if m in BASELINES}
    phase = runner.base_pass()  # the uncalibrated predictions and the trunk every trained model starts from
    if pending_baselines:
        runner.baselines(pending_baselines, phase)
    jobs = [(m, s) for m, s in pending if m in TRAINED]
    if not jobs:
        return
    with Phase() as prep:
        runner.prepare_training()
    ctx.timings[f"{task.name} training-set trunk"] = prep.seconds
    workers = min(ctx.workers, len(jobs))
    if workers <= 1 or not hasattr(os, "fork"):
        for method, seed in jobs:
            runner.trained(method, seed)
    else:
        t0 = time.perf_counter()
        run_forked(ctx, task, runner, jobs, workers)
        ctx.timings[f"{task.name} trained runs ({workers} workers, wall)"] = time.perf_counter() - t0


def run_forked(ctx: Ctx, task: Task, runner: MCRunner | OpenRunner, jobs: list[tuple[str, int]], workers: int) -> None:
    """Run ``jobs`` in ``workers`` forked processes (one torch thread each).

    The children are forked after the base pass, so they share the base model, the cached trunk and
    the encoded training data copy-on-write. A child claims a job by creating its lock file
    (``O_CREAT | O_EXCL``), so every job runs once, the longest-first order keeps the workers busy,
    and each result is written by the child that computed it (per-process peak memory stays per
    method). The parent shows the finished runs and reports children that failed.
    """
    folder = ctx.runs / task.name
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.lock"):
        stale.unlink()
    order = sorted(jobs, key=lambda j: -STEP_COST.get(j[0], 1.0))
    ctx.log(f"[{task.name}] {len(jobs)} runs on {workers} forked workers")
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for w in range(workers):
        pid = os.fork()
        if pid == 0:  # child
            code = 0
            try:
                ctx.progress = False
                ctx.worker = w
                for method, seed in order:
                    lock = result_path(ctx.runs, task.name, method, seed).with_suffix(".lock")
                    try:
                        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    except FileExistsError:
                        continue
                    runner.trained(method, seed)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    bar = ctx.bar(len(jobs), f"{task.name} runs")
    done, failed = 0, []
    alive = set(pids)
    while alive:
        for pid in list(alive):
            finished, status = os.waitpid(pid, os.WNOHANG)
            if finished:
                alive.discard(pid)
                if status != 0:
                    failed.append(pid)
        now = sum(result_path(ctx.runs, task.name, m, s).is_file() for m, s in jobs)
        bar.update(now - done)
        done = now
        if alive:
            time.sleep(1.0)
    bar.close()
    for lock in folder.glob("*.lock"):
        lock.unlink()
    missing = [f"{m} seed {s}" for m, s in jobs if not result_path(ctx.runs, task.name, m, s).is_file()]
    if failed or missing:
        ctx.log(f"[{task.name}] {len(failed)} worker(s) failed; missing results: {', '.join(missing) or 'none'}")


# --------------------------------------------------------------------------------- search


def run_search(ctx: Ctx, tasks: dict[str, Task], hparams_out: Path) -> dict[str, Any]:
    """Choose each trained method's hyperparameters on in-domain selection data only."""
    from llm_calib.calm.lora import FunctionalLM
    from llm_calib.prompts import PromptFormat
    from llm_calib.scoring.open_ended import encode_open_prompts

    chosen: dict[str, Any] = {"procedure": SEARCH_RULE, "grid": SEARCH_GRID, "mc": {}, "open": {}, "candidates": []}
    grid = {m: SEARCH_GRID[m][: 2 if ctx.sizes.name == "quick" else None] for m in ctx.methods if m in TRAINED}
    for name, task in tasks.items():
        s = ctx.sizes
        pad_id = ctx.tokenizer.pad_token_id or 0
        memo: dict[Any, Any] = {}
        if name == "mc":
            sel = encode_records(ctx.tokenizer, task.select, ctx.encoding_config())
            base = base_scores(ctx.model, sel, ctx.trunk_layers, s.eval_batch_size, pad_id, "sum")
            base_m = mc_metrics(base, [r.gold for r in task.select], 0)
        else:
            sel_gen = TrunkGenerator(ctx.tokenizer, encode_open_prompts(ctx.tokenizer, task.select, PromptFormat()),
                                     s.gen_batch_size, s.max_new_tokens, ctx.trunk_layers)
            base_m = open_metrics(open_set(task.select, sel_gen.base(ctx.model, keep_trunk=True, temperatures=False)), 0)
        ctx.log(f"[search/{name}] uncalibrated on the selection split ({len(task.select)}): "
                f"accuracy {base_m['accuracy']:.3f}, ECE {base_m['ece']:.3f}")
        for method, candidates in grid.items():
            rows = []
            for ci, cand in enumerate(candidates):
                cfg = ctx.config(name, method, 0, cand)
                path = ctx.runs / "search" / name / f"{method}-c{ci}.json"
                fp = _hash({"task": task.fingerprint(), "select": [r.id for r in task.select], "config": cfg.to_dict()})
                rec = read_result(path, fp)
                if rec is None:
                    ctx.log(f"[search/{name}] {method} candidate {ci} {cand}")
                    result, phase = _timed_calibrate(ctx, task, cfg, memo)
                    if name == "mc":
                        sc = trunk_scores(FunctionalLM(result.model), sel, s.eval_batch_size, pad_id, cfg.normalize)
                        m = mc_metrics(sc, [r.gold for r in task.select], 0)
                    else:
                        m = open_metrics(open_set(task.select, sel_gen.trained(result.model)), 0)
                    rec = {"fingerprint": fp, "method": method, "candidate": cand, "metrics": m, "train_s": phase.seconds}
                    write_json_atomic(path, rec)
                    del result
                    free_memory()
                else:
                    ctx.log(f"[search/{name}] {method} candidate {ci}: skipped (finished)")
                rows.append(rec)
            guard = ctx.config(name, method, 0)  # the library's selection rule (guard_accuracy) picks the candidate
            ok = [r for r in rows if is_selectable(r["metrics"]["accuracy"], base_m["accuracy"], guard)]
            best = min(ok, key=lambda r: r["metrics"]["ece"]) if ok else max(rows, key=lambda r: r["metrics"]["accuracy"])
            chosen[name][method] = best["candidate"]
            for r in rows:
                chosen["candidates"].append({"task": name, "method": method, "candidate": r["candidate"],
                                             "accuracy": r["metrics"]["accuracy"], "ece": r["metrics"]["ece"],
                                             "chosen": r is best, "train_s": r["train_s"]})
            ctx.log(f"[search/{name}] {method}: chose {best['candidate']} (selection ECE {best['metrics']['ece']:.3f}, "
                    f"accuracy {best['metrics']['accuracy']:.3f})")
        chosen[f"{name}_uncalibrated"] = {"accuracy": base_m["accuracy"], "ece": base_m["ece"]}
    write_json_atomic(hparams_out, chosen)
    lines = ["# Calibration benchmark: hyperparameter search", "", f"Rule: {SEARCH_RULE}", "",
             "| task | method | candidate | selection accuracy | selection ECE | chosen |", "|---|---|---|---|---|---|"]
    for c in chosen["candidates"]:
        lines.append(f"| {c['task']} | {c['method']} | `{json.dumps(c['candidate'])}` | {c['accuracy']:.3f} | "
                     f"{c['ece']:.3f} | {'**yes**' if c['chosen'] else ''} |")
    (hparams_out.with_suffix(".md")).write_text("\n".join(lines) + "\n")
    ctx.log(f"wrote {hparams_out} and {hparams_out.with_suffix('.md')}")
    return chosen


# --------------------------------------------------------------------------------- report


def _num(x: Any) -> float:
    return math.nan if x is None else float(x)


def _fmt(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{x:.{digits}f}"


def _mean_sd(values: Sequence[float], digits: int = 3) -> str:
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return "n/a"
    if v.size == 1:
        return f"{v[0]:.{digits}f}"
    return f"{v.mean():.{digits}f} ± {v.std(ddof=1):.{digits}f}"


class Aggregate:
    """Results of one task, all methods and seeds, with seed-averaged metrics and bootstrap CIs."""

    def __init__(self, ctx: Ctx, task: Task) -> None:
        self.task, self.ctx = task, ctx
        self.metrics = MC_METRICS if task.name == "mc" else OPEN_METRICS
        self.runs: dict[str, list[dict[str, Any]]] = {}
        for method in ctx.methods:
            runs = [read_result(result_path(ctx.runs, task.name, method, s)) for s in ctx.seeds(method)]
            runs = [r for r in runs if r is not None]
            if runs:
                self.runs[method] = runs
        rng = np.random.default_rng(12345)
        R = max(ctx.sizes.bootstrap, 1)
        self.idx = {name: rng.integers(0, len(recs), size=(R, len(recs))) for name, recs in task.tests.items() if recs}

    def values(self, method: str, name: str, metric: str) -> list[float]:
        return [_num(r["sets"][name].get(metric)) for r in self.runs.get(method, [])]

    def mean(self, method: str, name: str, metric: str) -> float:
        v = self.values(method, name, metric)
        return float(np.nanmean(v)) if v and not all(np.isnan(v)) else math.nan

    def group_values(self, method: str, names: Sequence[str], metric: str) -> list[float]:
        """Per seed, the mean over the sets ``names``."""
        return [float(np.mean([_num(r["sets"][n].get(metric)) for n in names])) for r in self.runs.get(method, [])]

    def group_mean(self, method: str, names: Sequence[str], metric: str) -> float:
        v = self.group_values(method, names, metric)
        return float(np.mean(v)) if v else math.nan

    def ece_ci(self, method: str, names: Sequence[str]) -> tuple[float, float]:
        """Bootstrap 95% interval of the seed-mean ECE averaged over ``names`` (questions resampled
        within each set, the same resamples for every seed and method)."""
        runs = self.runs.get(method, [])
        if not runs:
            return math.nan, math.nan
        total = np.zeros(next(iter(self.idx.values())).shape[0])
        for name in names:
            per_seed = [ece_resamples(*conf_correct(self.task.name, r["questions"][name]), self.idx[name]) for r in runs]
            total += np.mean(per_seed, axis=0)
        vals = total / len(names)
        lo, hi = np.percentile(vals, [2.5, 97.5])
        return float(lo), float(hi)

    def pooled(self, method: str, names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        cs, ks = [], []
        for r in self.runs.get(method, []):
            for name in names:
                c, k = conf_correct(self.task.name, r["questions"][name])
                cs.append(c)
                ks.append(k)
        return np.concatenate(cs), np.concatenate(ks)


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
            status = {True: "PASS", False: "**MISS**", None: "info" if c["value"] is not None else "n/a"}[c["pass"]]
            cells += [f"{_fmt(c['value'])} ({c['detail']})", status]
        out.append(f"| {r['target']} | {r['limit']} | " + " | ".join(cells) + " |")
    return out


def _task_tables(agg: Aggregate) -> list[str]:
    t = agg.task
    methods = [m for m in agg.ctx.methods if m in agg.runs]
    out: list[str] = []
    for title, names in (("out-of-domain average", t.ood), ("in-domain average", t.in_domain)):
        out += [f"**{title}** ({len(names)} sets: {', '.join(names)}); mean ± sd over seeds, conf-ECE with the "
                "bootstrap 95% interval of the seed-mean", "",
                "| method | seeds | " + " | ".join(METRIC_NAMES[m] for m in agg.metrics) + " |",
                "|---|---|" + "---|" * len(agg.metrics)]
        for m in methods:
            cells = []
            for metric in agg.metrics:
                cell = _mean_sd(agg.group_values(m, names, metric))
                if metric == "ece":
                    lo, hi = agg.ece_ci(m, names)
                    cell += f" [{lo:.3f}, {hi:.3f}]"
                cells.append(cell)
            out.append(f"| {LABELS[m]} | {len(agg.runs[m])} | " + " | ".join(cells) + " |")
        out.append("")
    for metric, title in (("ece", "conf-ECE per set (mean ± sd [bootstrap 95% interval of the seed-mean])"),
                          ("accuracy", "accuracy per set (mean ± sd)")):
        out += [f"**{title}**", "", "| set | " + " | ".join(LABELS[m] for m in methods) + " |",
                "|---|" + "---|" * len(methods)]
        for name in (*t.in_domain, *t.ood):
            tag = "ID" if name in t.in_domain else "OOD"
            cells = []
            for m in methods:
                cell = _mean_sd(agg.values(m, name, metric))
                if metric == "ece":
                    lo, hi = agg.ece_ci(m, [name])
                    cell += f" [{lo:.2f}, {hi:.2f}]"
                cells.append(cell)
            out.append(f"| {name} ({tag}) | " + " | ".join(cells) + " |")
        out.append("")
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
            out.append(f"| {name} | {LABELS[m]} | {len(runs)} | {_mean_sd(tr, 1)} | {_mean_sd(ev, 1)}{shared} | "
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
            out.append(f"| {name} | {LABELS[m]} | {steps} | {_fmt(before.get('ece'))} → {_mean_sd([a.get('ece') for a in after])} | "
                       f"{_fmt(before.get('accuracy'))} → {_mean_sd([a.get('accuracy') for a in after])} | "
                       f"{sum(bool(a.get('stopped_early')) for a in after)} of {len(after)} |")
    return out


def _plots(ctx: Ctx, aggs: dict[str, Aggregate], plot_dir: Path) -> list[str]:
    from llm_calib.metrics import ece, reliability_bins
    from llm_calib.report import plot_reliability

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
        f"- Command: `{command}` ({s.name} mode); date {meta['date']}",
        f"- Machine: {meta['cpu']}, {meta['cores']} cores, {meta['threads']} torch threads; torch {meta['torch']}, "
        f"transformers {meta['transformers']}, Python {meta['python']}; load average at the end "
        + (", ".join(f"{x:.1f}" for x in meta["load"]) if meta["load"] else "?"),
        f"- Wall time of this invocation: {elapsed / 60:.1f} min; compute recorded in the result files: {compute / 60:.1f} min",
        f"- Model: `{s.model}`; LoRA rank {s.lora_rank} (alpha {2 * s.lora_rank}) on q_proj/v_proj of the top {s.top_layers} "
        f"of {ctx.n_layers} layers; {s.seeds} seeds per trained method; the same data, {s.steps} steps (open-ended: "
        f"{s.open_steps}) of batch {s.batch_size} (held-out batch {s.batch_size}) and the library's selection rule (lowest "
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
    p.add_argument("--seeds", type=int, default=None, help="seeds per trained method")
    p.add_argument("--steps", type=int, default=None, help="training steps (both tasks)")
    p.add_argument("--top-layers", type=int, default=None, help="LoRA on the top k decoder layers")
    p.add_argument("--n-test", type=int, default=None, help="questions per MC test set")
    p.add_argument("--bootstrap", type=int, default=None, help="bootstrap resamples")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any size field (e.g. --set open_test=200 --set max_new_tokens=12); repeatable")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: faster than 2 on a busy 2-core machine; try 2 on a quiet one)")
    p.add_argument("--hparams", type=Path, default=None,
                   help=f"search result to read (main run) or write (--search); default {_rel(DEFAULT_HPARAMS)}")
    p.add_argument("--search", action="store_true", help="choose hyperparameters on in-domain data only, then exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--no-plots", action="store_true", help="skip the reliability diagrams")
    p.add_argument("--workers", type=int, default=None,
                   help="forked processes for the trained runs, one torch thread each (default 2; --quick: 1)")
    return p.parse_args(argv)


def build_ctx(args: argparse.Namespace) -> Ctx:
    sizes = QUICK if args.quick else FULL
    over = {k: v for k, v in (("seeds", args.seeds), ("top_layers", args.top_layers), ("mc_test", args.n_test),
                              ("bootstrap", args.bootstrap)) if v is not None}
    if args.steps is not None:
        over.update(steps=args.steps, open_steps=args.steps)
    fields = {f.name: f.type for f in dataclasses.fields(Sizes)}
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in fields or key == "name":
            raise SystemExit(f"--set: unknown field {key!r}; fields: {', '.join(k for k in fields if k != 'name')}")
        over[key] = value if key == "model" else int(value)
    sizes = replace(sizes, **over)
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
