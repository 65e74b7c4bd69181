"""Open-ended calibration, measured: CALM and its baselines on open questions, under token and
semantic confidence, at several seeds.

Trained on open questions the model can answer (capitals and chemical symbols, ``harness/open_facts.py``:
the built-in open domains plus the rest of the countries and elements), tested in domain and on
sets of other kinds (built-in sums, NQ-open, TriviaQA from SelfAware, WebQuestions). Rows:
uncalibrated, temperature scaling, LoRA CE, LoRA CE + T, CALM, CALM + T. Confidence:

- ``token``: mean answer-token probability of the greedy answer; ``+ T`` rows: the same answers'
  token probabilities at the temperature fitted on the held-out split (log-loss of correctness);
- ``semantic``: N sampled answers clustered by SQuAD-normalised exact match; the modal cluster's
  sample-split frequency (ECE here is Sem-ECE); ``+ T`` rows sample at the sampling temperature with
  the lowest held-out Sem-ECE (the post-hoc knob of semantic confidence).

Model selection is on the metric each row reports: the held-out greedy answers' ECE (token rows, the
library's rule in the training loop) or the held-out Sem-ECE (semantic rows, the same rule replayed on
the Sem-ECE measured at every evaluation). Every evaluation also records the teacher-forced proxy that
selection used before, so the report tabulates the proxy against the generated answers' ECE.

Usage (each part a process; ``--report`` joins the parts):
    PYTHONPATH=. python benchmarks/open_calibration.py --part base --out /tmp/open_cal
    PYTHONPATH=. python benchmarks/open_calibration.py --part 0 --out /tmp/open_cal   # seeds 0, 1, 2
    PYTHONPATH=. python benchmarks/open_calibration.py --report --out /tmp/open_cal \\
        --md benchmarks/results/open_calibration.md
    PYTHONPATH=. python benchmarks/open_calibration.py --quick --out /tmp/oc_quick   # tiny random model, all parts
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import math
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.open_facts import fact_questions
from harness.report import machine_info, machine_line
from scipy.stats import spearmanr

from llm_calib import (
    CalibrationConfig,
    Calm,
    LoraCE,
    LoraSettings,
    PromptSettings,
    SelectionSettings,
    TrainingSettings,
)
from llm_calib.calm import training
from llm_calib.calm.fast_eval import open_ended_set
from llm_calib.calm.run import resolve_run
from llm_calib.confidence.kinds import OpenConfidence, score_open
from llm_calib.confidence.temperature import (
    SAMPLING_TEMPERATURES,
    AnswerTokenLogits,
    choose_sampling_temperature,
    fit_token_temperature,
)
from llm_calib.confidence.token import encode_open_prompts
from llm_calib.data import builtin_open_questions, load
from llm_calib.data.records import OpenQA
from llm_calib.engine.decode import GenOut, generate_greedy
from llm_calib.evaluation.evaluate import evaluate_records
from llm_calib.files.atomic import write_json_atomic, write_text_atomic
from llm_calib.models import load as load_model
from llm_calib.models import tiny_random_model
from llm_calib.prompts.resolution import open_prompt_format
from llm_calib.prompts.templates import draw_short_answer_examples

ROWS = ("uncalibrated", "temperature", "lora_ce", "lora_ce+T", "calm", "calm+T")
LABELS = {"uncalibrated": "uncalibrated", "temperature": "temperature scaling", "lora_ce": "LoRA CE",
          "lora_ce+T": "LoRA CE + T", "calm": "CALM (BOME)", "calm+T": "CALM + T"}
KINDS = ("token", "semantic")
METRICS = ("accuracy", "mean_confidence", "ece", "adaptive_ece", "brier", "auroc")
NEAR_ZERO = 0.05  # accuracy below this: ECE only rewards low confidence


@dataclass(frozen=True)
class Sizes:
    """The data and budget of a run."""

    model: str = "smollm2-135m-instruct"
    test: int = 100  # in-domain test questions
    heldout: int = 60  # labelled: selection, the temperature fit; also CALM's unlabelled inputs
    ood: int = 60  # questions of the built-in sums set
    ood_real: int = 40  # questions per real out-of-domain set (NQ-open, ...): long sampled answers, costly
    real_sets: tuple[str, ...] = ("nq_open",)  # of nq_open, triviaqa, webquestions
    fewshot: int = 5
    steps: int = 40
    batch_size: int = 8
    eval_every: int = 5
    samples: int = 10
    sampling_temperatures: tuple[float, ...] = SAMPLING_TEMPERATURES  # the semantic knob's grid
    max_new_tokens: int = 24
    gen_batch: int = 8
    bootstrap: int = 1000
    seeds: int = 3


QUICK = Sizes(model="tiny", test=6, heldout=6, ood=4, ood_real=4, real_sets=("nq_open", "triviaqa", "webquestions"), fewshot=2, steps=2, batch_size=2, eval_every=1, samples=3,
              max_new_tokens=4, bootstrap=20, seeds=2)


def data(sizes: Sizes, data_dir: str | None) -> dict[str, Any]:
    """Train / held-out / test splits of the fact questions, and the out-of-domain sets."""
    facts = fact_questions()
    random.Random(0).shuffle(facts)
    test, heldout, train = facts[: sizes.test], facts[sizes.test : sizes.test + sizes.heldout], facts[sizes.test + sizes.heldout :]
    ood: dict[str, list[OpenQA]] = {"sums": builtin_open_questions(60, ["sums"])[: sizes.ood]}
    if data_dir:
        specs = {"nq_open": (f"nq_open:{data_dir}", lambda r: bool(r.answers)),
                 "triviaqa": (f"selfaware:{data_dir}:triviaqa", lambda r: r.answerable and bool(r.answers)),
                 "webquestions": (f"webquestions:{data_dir}", lambda r: bool(r.answers))}
        for name in sizes.real_sets:
            spec, keep = specs[name]
            recs = [r for r in load(spec).records if keep(r)]
            random.Random(1).shuffle(recs)
            ood[name] = [replace(r, domain=name) for r in recs[: sizes.ood_real]]
    return {"train": train, "heldout": heldout, "tests": {"facts": test, **ood},
            "examples": draw_short_answer_examples(train, sizes.fewshot, seed=0)}


def config(sizes: Sizes, examples: Any, method: str, seed: int, n_layers: int) -> CalibrationConfig:
    objective = Calm() if method == "calm" else LoraCE()
    top = min(6, n_layers - 1)
    return CalibrationConfig(objective=objective, seed=seed, lora=LoraSettings(top_layers=top),
                             prompt=PromptSettings(open_examples=examples),
                             training=TrainingSettings(steps=sizes.steps, batch_size=sizes.batch_size,
                                                       heldout_batch_size=sizes.batch_size),
                             selection=SelectionSettings(eval_every=sizes.eval_every))


def greedy_at(model: Any, tok: Any, records: list[OpenQA], fmt: Any, sizes: Sizes, temperature: float | None) -> list[GenOut]:
    """Greedy answers with every answer token's probability at 1 and (``temperature``) at T: the deployed model
    at T answers the same and only its token probabilities change."""
    prompts = encode_open_prompts(tok, records, fmt)
    outs: list[GenOut] = []
    for i in range(0, len(prompts), sizes.gen_batch):
        batch = generate_greedy(model, tok, prompts[i : i + sizes.gen_batch], max_new_tokens=sizes.max_new_tokens,
                                temperatures=None if temperature is None else [temperature],
                                until=[getattr(r, "until", None) for r in records[i : i + sizes.gen_batch]])
        outs += [GenOut(a.text, a.token_ids, a.token_probs, a.temp_probs) for a in batch]
    return outs


def _clean(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def fit_token_T(model: Any, tok: Any, d: dict[str, Any], fmt: Any, sizes: Sizes) -> tuple[float, dict[str, float]]:
    """The library's token-confidence temperature, fitted on the held-out greedy answers."""
    held = d["heldout"]
    outs = greedy_at(model, tok, held, fmt, sizes, None)
    view = AnswerTokenLogits(model, encode_open_prompts(tok, held, fmt), [o.token_ids for o in outs],
                             tok.pad_token_id if tok.pad_token_id is not None else 0, batch_size=sizes.gen_batch)
    fit = fit_token_temperature(open_ended_set(held, outs).correct, view.probs)
    return fit.temperature, {"log_loss_before": fit.log_loss_before, "log_loss_after": fit.log_loss_after}


def heldout_semantic(model: Any, tok: Any, d: dict[str, Any], fmt: Any, sizes: Sizes, temperature: float) -> dict[str, float]:
    """Sem-ECE and modal accuracy of the held-out split, answers sampled at ``temperature`` (seed 0)."""
    conf = OpenConfidence("semantic", samples=sizes.samples, temperature=temperature, seed=0)
    scored = score_open(model, tok, d["heldout"], conf, prompt=fmt, max_new_tokens=sizes.max_new_tokens,
                        batch_size=sizes.gen_batch)
    return _clean(scored.summary(ci=False))


def score_token(model: Any, tok: Any, d: dict[str, Any], fmt: Any, sizes: Sizes, log: Any) -> dict[str, Any]:
    """Token rows of one model: the test sets at T = 1 and at the temperature fitted on the held-out split."""
    t0 = time.perf_counter()
    T, fit = fit_token_T(model, tok, d, fmt, sizes)
    log(f"  token temperature fitted on the held-out split: T = {T:.3f}")
    out: dict[str, Any] = {"temperature": T, "temperature_fit": fit, "token": {}, "token+T": {}}
    boot = {"ci": sizes.bootstrap > 0, "n_resamples": max(sizes.bootstrap, 1), "seed": 0}
    for name, recs in d["tests"].items():
        outs = greedy_at(model, tok, recs, fmt, sizes, T)
        out["token"][name] = _clean(open_ended_set(recs, outs).summary(**boot))
        out["token+T"][name] = _clean(open_ended_set(recs, outs, 0).summary(**boot))
        log(f"  greedy {name}: accuracy {out['token'][name]['accuracy']:.3f}")
    out["token_s"] = time.perf_counter() - t0
    return out


def score_semantic(model: Any, tok: Any, d: dict[str, Any], fmt: Any, sizes: Sizes, log: Any,
                   heldout_at_1: dict[str, float] | None = None) -> dict[str, Any]:
    """Semantic rows of one model: the test sets sampled at T = 1 and at the sampling temperature chosen on the
    held-out Sem-ECE (the post-hoc knob of semantic confidence)."""
    t0 = time.perf_counter()
    at: dict[float, dict[str, float]] = {}

    def metrics(t: float) -> tuple[float, float]:
        if t == 1.0 and heldout_at_1 is not None:
            at[t] = heldout_at_1
        else:
            at[t] = heldout_semantic(model, tok, d, fmt, sizes, t)
        return at[t]["ece"], at[t]["accuracy"]

    T, values = choose_sampling_temperature(metrics, sizes.sampling_temperatures)
    log(f"  sampling temperature chosen on the held-out Sem-ECE (accuracy guarded): T = {T:g} ({values})")
    out: dict[str, Any] = {"sampling_temperature": T, "heldout_semantic_at": {f"{t:g}": m for t, m in at.items()}}
    boot = {"ci": sizes.bootstrap > 0, "n_resamples": max(sizes.bootstrap, 1), "seed": 0}
    for key, temp in (("semantic", 1.0), ("semantic+T", T)):
        if key == "semantic+T" and T == 1.0:
            out[key] = out["semantic"]
            continue
        conf = OpenConfidence("semantic", samples=sizes.samples, temperature=temp, seed=0)
        res = evaluate_records(model, tok, list(d["tests"].items()), open_prompt=fmt, confidence=conf,
                               max_new_tokens=sizes.max_new_tokens, batch_size=sizes.gen_batch, **boot)
        out[key] = {dom: _clean(r.uncalibrated) for dom, r in res.domains.items()}
    out["semantic_s"] = time.perf_counter() - t0
    log(f"  semantic rows: {out['semantic_s']:.0f} s")
    return out


def train_keeping_evaluations(model: Any, tok: Any, d: dict[str, Any], cfg: CalibrationConfig,
                              log: Any) -> tuple[Any, Any, dict[int, dict[str, Any]]]:
    """The library's training loop (:mod:`llm_calib.calm.training`, as ``calibrate`` runs it, with selection on
    the held-out greedy answers' ECE), keeping θ at every evaluation; returns the trainer, its state and the
    θ per evaluated step (0: the initial model)."""
    trainer = training.build_trainer(copy.deepcopy(model), tok, d["train"], d["heldout"],
                                     resolve_run(cfg, d["train"], d["heldout"]))
    state = training.init_state(trainer)
    thetas = {0: {k: v.clone() for k, v in state.theta.items()}}
    while not training.done(trainer, state):
        record = training.train_step(trainer, state)
        if training.evaluation_due(trainer, state.step):
            record.update(training.select(trainer, state, training.evaluate(trainer, state.theta)))
            thetas[state.step] = {k: v.clone() for k, v in state.theta.items()}
            log(f"  step {state.step}: held-out greedy ECE {record['heldout_ece']:.3f} (accuracy "
                f"{record['heldout_accuracy']:.3f}), teacher-forced {record['heldout_teacher_forced_ece']:.3f}")
        state.history.append(record)
    return trainer, state, thetas


def _commit() -> str:
    """The git commit the part ran at (``+dirty`` with uncommitted changes), or ``?``."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + ("+dirty" if dirty else "")


def run_part(part: str, sizes: Sizes, args: argparse.Namespace) -> None:
    out_dir = Path(args.out)
    (out_dir / "parts").mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)

    def log(message: str) -> None:
        print(f"[{part}] {message}", file=sys.stderr, flush=True)

    d = data(sizes, args.data_dir)
    if sizes.model == "tiny":
        model, tok = tiny_random_model(seed=0, num_layers=3)
    else:
        model, tok = load_model(sizes.model)
    n_layers = int(model.config.num_hidden_layers)
    cfg0 = config(sizes, d["examples"], "lora_ce", 0, n_layers)
    fmt = open_prompt_format(cfg0.prompt)
    record: dict[str, Any] = {"part": part, "sizes": sizes.__dict__, "started": _dt.datetime.now(_dt.UTC).isoformat(),
                              "commit": _commit(), "selection": {k: getattr(cfg0.selection, k) for k in
                                                                  ("guard_accuracy", "guard_patience")},
                              "n": {"train": len(d["train"]), "heldout": len(d["heldout"]),
                                    **{k: len(v) for k, v in d["tests"].items()}}, "examples": d["examples"]}
    t0, cpu0 = time.perf_counter(), time.process_time()
    if part == "base":
        log("scoring the base model")
        base = {**score_token(model, tok, d, fmt, sizes, log), **score_semantic(model, tok, d, fmt, sizes, log)}
        # the benchmark's token path is the library's: evaluate's token confidence on the same answers
        check = evaluate_records(model, tok, list(d["tests"].items()), open_prompt=fmt, ci=False,
                                 max_new_tokens=sizes.max_new_tokens, batch_size=sizes.gen_batch)
        record["token_check_max_abs_diff"] = max(
            abs(check.domains[n].uncalibrated[m] - base["token"][n][m]) for n in d["tests"] for m in ("accuracy", "ece"))
        record["rows"] = {"uncalibrated": base}
    else:
        seed = int(part)
        record["rows"] = {}
        base_sem = heldout_semantic(model, tok, d, fmt, sizes, 1.0)  # step 0 of every run's semantic history
        for method in ("lora_ce", "calm"):
            cfg = config(sizes, d["examples"], method, seed, n_layers)
            log(f"training {method}, seed {seed}: {sizes.steps} steps, held-out evaluation every {sizes.eval_every}")
            t1 = time.perf_counter()
            trainer, state, thetas = train_keeping_evaluations(model, tok, d, cfg, log)
            train_s = time.perf_counter() - t1
            # every kept evaluation, scored again with semantic confidence (Sem-ECE of the held-out samples)
            t1 = time.perf_counter()
            before = {**state.before, "sem_ece": base_sem["ece"], "sem_accuracy": base_sem["accuracy"]}
            sem_at_step = {0: base_sem}
            for rec in state.history:
                if "heldout_ece" in rec:
                    trainer.lm.load_theta(thetas[rec["step"]])
                    sem_at_step[rec["step"]] = heldout_semantic(trainer.model, tok, d, fmt, sizes, 1.0)
                    rec["heldout_sem_ece"] = sem_at_step[rec["step"]]["ece"]
                    rec["heldout_sem_accuracy"] = sem_at_step[rec["step"]]["accuracy"]
            sem_eval_s = time.perf_counter() - t1
            token_step = int(state.best["step"])
            replayed = training.replay_selection(state.history, before, cfg.selection)
            assert replayed["step"] == token_step, (replayed, token_step)  # the replay is the loop's rule
            semantic_step = training.replay_selection(state.history, before, cfg.selection, metric="sem_ece",
                                                      accuracy="sem_accuracy")["step"]
            proxy_step = training.replay_selection(state.history, before, cfg.selection, metric="teacher_forced_ece",
                                                   accuracy="teacher_forced_accuracy")["step"]
            log(f"  {method}: selected step {token_step} (greedy ECE), {semantic_step} (Sem-ECE); the proxy would "
                f"pick {proxy_step}")
            base_part = out_dir / "parts" / "base.json"
            base_rows = json.loads(base_part.read_text())["rows"]["uncalibrated"] if base_part.is_file() else None
            scored: dict[str, Any] = {"reused": []}
            for kind, step in (("token", token_step), ("semantic", semantic_step)):
                if step == 0 and base_rows is not None:
                    # the initial model was kept (LoRA's B = 0): the deployed model is the base model, and the
                    # samples are seeded alike, so its rows are the base part's
                    keys = (("token", "token+T", "temperature", "temperature_fit") if kind == "token" else
                            ("semantic", "semantic+T", "sampling_temperature", "heldout_semantic_at"))
                    scored.update({k: base_rows[k] for k in keys})
                    scored["reused"].append(kind)
                    continue
                trainer.lm.load_theta(thetas[step])
                if kind == "token":
                    scored.update(score_token(trainer.model, tok, d, fmt, sizes, log))
                else:
                    scored.update(score_semantic(trainer.model, tok, d, fmt, sizes, log, sem_at_step[step]))
            scored.update({"train_s": train_s, "sem_eval_s": sem_eval_s, "selected_step": token_step,
                           "semantic_selected_step": semantic_step, "proxy_selected_step": proxy_step,
                           "stopped_early": bool(state.stopped_early),
                           "notes": [n for n in [training.selection_note(state.history, state.before, token_step, cfg.selection,
                                                                          "greedy-answer ECE")] if n],
                           "history": state.history, "before": before})
            record["rows"][method] = scored
            del trainer, state, thetas
    record["wall_s"], record["cpu_s"] = time.perf_counter() - t0, time.process_time() - cpu0
    record["finished"] = _dt.datetime.now(_dt.UTC).isoformat()
    write_json_atomic(out_dir / "parts" / f"{part}.json", record)
    log(f"done in {record['wall_s']:.0f} s wall, {record['cpu_s']:.0f} s CPU")


# ------------------------------------------------------------------------------------------- report


def _rows(parts: list[dict[str, Any]], kind: str) -> dict[str, list[dict[str, dict[str, float]]]]:
    """Per report row, one {set: metrics} per seed (one for the untrained rows)."""
    rows: dict[str, list[dict[str, dict[str, float]]]] = {r: [] for r in ROWS}
    for p in parts:
        for method, res in p["rows"].items():
            plain = "uncalibrated" if method == "uncalibrated" else method
            scaled = "temperature" if method == "uncalibrated" else f"{method}+T"
            rows[plain].append(res[kind])
            rows[scaled].append(res[f"{kind}+T"])
    return rows


def _cell(values: list[dict[str, float]], name: str, metric: str) -> str:
    xs = [v[name][metric] for v in values if name in v and metric in v[name]]
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return "n/a"
    if len(xs) == 1:
        lo, hi = values[0][name].get(f"{metric}_ci_low"), values[0][name].get(f"{metric}_ci_high")
        ci = f" [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None and math.isfinite(lo) else ""
        return f"{xs[0]:.3f}{ci}"
    return f"{np.mean(xs):.3f} ± {np.std(xs, ddof=1):.3f}"


def _evaluations(trained: list[tuple[str, int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (run, evaluated step): the held-out teacher-forced proxy, greedy-answer and semantic metrics."""
    rows = []
    for m, seed, r in sorted(trained, key=lambda t: (t[1], t[0])):
        if not r.get("history") or "before" not in r:
            continue
        b = r["before"]
        rows.append({"method": m, "seed": seed, "step": 0, "proxy_ece": b["teacher_forced_ece"],
                     "proxy_acc": b["teacher_forced_accuracy"], "greedy_ece": b["ece"], "greedy_acc": b["accuracy"],
                     "sem_ece": b["sem_ece"], "sem_acc": b["sem_accuracy"]})
        for h in r["history"]:
            if "heldout_sem_ece" in h:
                rows.append({"method": m, "seed": seed, "step": int(h["step"]), "proxy_ece": h["heldout_teacher_forced_ece"],
                             "proxy_acc": h["heldout_teacher_forced_accuracy"], "greedy_ece": h["heldout_ece"],
                             "greedy_acc": h["heldout_accuracy"], "sem_ece": h["heldout_sem_ece"],
                             "sem_acc": h["heldout_sem_accuracy"]})
    return rows


def _spearman(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Spearman's rho and its two-sided p-value; NaN for fewer than 3 points or a constant side."""
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return math.nan, math.nan
    res = spearmanr(xs, ys)
    return float(res.statistic), float(res.pvalue)


def rank_correlations(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Spearman's rank correlation of the proxy ECE with the greedy-answer ECE and with the Sem-ECE (and of those
    two), over the evaluations of each seed (both methods' runs; the initial model, the same in every run of a
    seed, once), of each run (``"<method>, seed <s>"``: its initial model and its evaluations), and of all seeds.

    Example:
        >>> rows = [{"method": "calm", "seed": 0, "step": k, "proxy_ece": p, "greedy_ece": g, "sem_ece": g}
        ...         for k, p, g in ((0, 0.1, 0.3), (5, 0.2, 0.2), (10, 0.3, 0.1))]
        >>> rank_correlations(rows)["seed 0"]["proxy_vs_greedy"]
        -1.0
    """
    out: dict[str, dict[str, float]] = {}
    seeds = sorted({r["seed"] for r in rows})
    groups = {f"seed {s}": [r for r in rows if r["seed"] == s] for s in seeds}
    for m in sorted({r["method"] for r in rows}):
        for s in seeds:
            run = [r for r in rows if r["method"] == m and r["seed"] == s]
            if run:
                groups[f"{m}, seed {s}"] = run
    groups["all seeds"] = rows
    pairs = {"proxy_vs_greedy": ("proxy_ece", "greedy_ece"), "proxy_vs_sem": ("proxy_ece", "sem_ece"),
             "greedy_vs_sem": ("greedy_ece", "sem_ece")}
    for name, rs in groups.items():
        seen, uniq = set(), []
        for r in rs:  # the initial model is the same in every run of a seed: count it once per seed
            key = (r["seed"], r["step"]) if r["step"] == 0 else (r["seed"], r["method"], r["step"])
            if key not in seen:
                seen.add(key)
                uniq.append(r)
        out[name] = {"n": len(uniq)}
        for pair, (x, y) in pairs.items():
            out[name][pair], out[name][f"{pair}_p"] = _spearman([r[x] for r in uniq], [r[y] for r in uniq])
    return out


def lowest_within_guard(evaluations: list[dict[str, Any]], before: dict[str, float], ece: str, accuracy: str,
                        guard_accuracy: float = 0.95, patience: int = 2) -> int:
    """The step with the lowest held-out ``ece`` among the initial model (step 0) and the evaluations whose
    ``accuracy`` is at least ``guard_accuracy`` times the initial one (ties: the earliest), up to where
    ``patience`` consecutive evaluations below that floor stop a run; found by brute force over the recorded
    numbers, apart from the library's rule: the step selection must pick.

    Example:
        >>> evals = [{"step": 5, "e": 0.20, "a": 0.50}, {"step": 10, "e": 0.05, "a": 0.30}, {"step": 15, "e": 0.10, "a": 0.49}]
        >>> lowest_within_guard(evals, {"e": 0.14, "a": 0.5}, "e", "a")   # step 10 is below the floor 0.475
        15
        >>> lowest_within_guard(evals, {"e": 0.14, "a": 0.5}, "e", "a", patience=1)   # the guard stops the run at 10
        0
    """
    floor = guard_accuracy * before[accuracy]
    candidates, below = [(before[ece], 0)], 0
    for r in sorted(evaluations, key=lambda r: r["step"]):
        if r[accuracy] + 1e-12 >= floor:
            candidates.append((r[ece], int(r["step"])))
            below = 0
        else:
            below += 1
            if below >= patience:
                break
    return min(candidates)[1]


def _measurement(trained: list[tuple[str, int, dict[str, Any]]], n_heldout: int, samples: int) -> list[str]:
    """The proxy-vs-generated table: every kept evaluation of the held-out split, and the rank correlations."""
    rows = _evaluations(trained)
    if not rows:
        return []
    lines = ["## Held-out split at every evaluation: the teacher-forced proxy against the generated answers", "",
             f"ECE / accuracy of the held-out split ({n_heldout} questions) at each evaluation of each run: the teacher-forced "
             "proxy (the reference answer fed token by token; confidence = mean top-token probability, correct = "
             f"every reference token is the top token), the greedy answers (token confidence), and {samples} sampled answers "
             "(semantic confidence, Sem-ECE; modal answer's accuracy). Step 0 is the initial model.", "",
             "| run | step | proxy ECE / acc | greedy ECE / acc | Sem-ECE / modal acc |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {LABELS[r['method']]}, seed {r['seed']} | {r['step']} | {r['proxy_ece']:.3f} / {r['proxy_acc']:.3f} | "
                     f"{r['greedy_ece']:.3f} / {r['greedy_acc']:.3f} | {r['sem_ece']:.3f} / {r['sem_acc']:.3f} |")
    corr = rank_correlations(rows)
    lines += ["", "Spearman rank correlation (two-sided p-value in parentheses) over the evaluations of each seed (both methods' runs; "
              "the initial model counted once), of each run, and of all seeds:", "",
              "| evaluations | n | proxy vs greedy ECE | proxy vs Sem-ECE | greedy ECE vs Sem-ECE |", "|---|---|---|---|---|"]
    for name, c in corr.items():
        label = name if name.startswith(("seed", "all")) else f"{LABELS[name.split(', ')[0]]}, {name.split(', ')[1]}"
        cells = [_rho(c[k], c[f"{k}_p"]) for k in ("proxy_vs_greedy", "proxy_vs_sem", "greedy_vs_sem")]
        lines.append(f"| {label} | {c['n']} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _rho(rho: float, p: float) -> str:
    return "n/a" if not math.isfinite(rho) else f"{rho:.2f} ({p:.2g})"


def _at_step(r: dict[str, Any], step: int, key: str) -> float:
    """The held-out ``key`` (``ece``, ``sem_ece``, ``teacher_forced_ece``) of a run at an evaluated step (0: before)."""
    if step == 0:
        return r["before"][key]
    (rec,) = [h for h in r["history"] if h.get("step") == step and f"heldout_{key}" in h]
    return rec[f"heldout_{key}"]


def selection_checks(trained: list[tuple[str, int, dict[str, Any]]], guard_accuracy: float,
                     patience: int) -> list[dict[str, Any]]:
    """Per run: the step each rule selected, and the brute-force lowest step within the accuracy guard of the
    greedy-answer ECE and of the Sem-ECE (:func:`lowest_within_guard`); they must agree."""
    out = []
    for m, seed, r in sorted(trained, key=lambda t: (t[0], t[1])):
        if not r.get("history") or "before" not in r:
            continue
        evals = [h for h in r["history"] if "heldout_sem_ece" in h]
        last = max((int(h["step"]) for h in evals), default=0)
        before = {**r["before"], "heldout_sem_ece": r["before"]["sem_ece"], "heldout_sem_accuracy": r["before"]["sem_accuracy"],
                  "heldout_ece": r["before"]["ece"], "heldout_accuracy": r["before"]["accuracy"]}
        token_low = lowest_within_guard(evals, before, "heldout_ece", "heldout_accuracy", guard_accuracy, patience)
        sem_low = lowest_within_guard(evals, before, "heldout_sem_ece", "heldout_sem_accuracy", guard_accuracy, patience)
        out.append({"method": m, "seed": seed, "last_step": last, "token_step": int(r["selected_step"]),
                    "token_lowest": token_low, "semantic_step": int(r["semantic_selected_step"]), "semantic_lowest": sem_low,
                    "proxy_step": int(r["proxy_selected_step"]), "stopped_early": bool(r.get("stopped_early")),
                    "greedy_ece_initial": r["before"]["ece"], "greedy_ece_selected": _at_step(r, r["selected_step"], "ece"),
                    "greedy_ece_at_proxy_step": _at_step(r, r["proxy_selected_step"], "ece"),
                    "sem_ece_initial": r["before"]["sem_ece"],
                    "sem_ece_selected": _at_step(r, r["semantic_selected_step"], "sem_ece")})
    return out


def _selections(trained: list[tuple[str, int, dict[str, Any]]], guard_accuracy: float, patience: int) -> list[str]:
    """The step each rule selects per run: greedy ECE (the token rows), Sem-ECE (the semantic rows), the proxy;
    with the brute-force lowest step within the guard beside each."""
    checks = selection_checks(trained, guard_accuracy, patience)
    lines = ["## Selected steps", "",
             "Held-out ECE initial → selected. \"lowest\": the step with the lowest held-out ECE among the initial "
             f"model and the evaluations whose accuracy is at least {guard_accuracy:g} of the initial one (until "
             f"{patience} evaluations in a row below that stop the run), found by brute force over the table below (it must "
             "be the selected step). The proxy column: the step the "
             "teacher-forced proxy (the old rule) would have picked, and the held-out greedy ECE of that step.", "",
             "| run | token rows: greedy ECE (step) | lowest | semantic rows: Sem-ECE (step) | lowest | proxy's pick: its "
             "greedy ECE (step) | stopped early |", "|---|---|---|---|---|---|---|"]
    for c in checks:
        lines.append(
            f"| {LABELS[c['method']]}, seed {c['seed']} | {c['greedy_ece_initial']:.3f} → {c['greedy_ece_selected']:.3f} "
            f"({c['token_step']}) | {c['token_lowest']} | {c['sem_ece_initial']:.3f} → {c['sem_ece_selected']:.3f} "
            f"({c['semantic_step']}) | {c['semantic_lowest']} | {c['greedy_ece_at_proxy_step']:.3f} ({c['proxy_step']}) | "
            f"{'yes, after step ' + str(c['last_step']) if c['stopped_early'] else 'no'} |")
    moved = [c for c in checks if c["token_step"] > 0]
    lines += ["", f"Token rows: {len(moved)} of {len(checks)} runs selected a trained step"
              + (" (" + ", ".join(f"{LABELS[c['method']]} seed {c['seed']}: step {c['token_step']}" for c in moved) + ")"
                 if moved else "") + f"; selected = lowest within the guard in "
              f"{sum(c['token_step'] == c['token_lowest'] for c in checks)} of {len(checks)} (semantic rows: "
              f"{sum(c['semantic_step'] == c['semantic_lowest'] for c in checks)} of {len(checks)}).", ""]
    return lines


def _summary(parts: list[dict[str, Any]], sets: list[str]) -> list[str]:
    """The headline table: accuracy / ECE per set under both confidences (means over seeds)."""
    head = " | ".join(f"{n}, token | {n}, semantic" for n in sets)
    lines = ["## Summary: accuracy / ECE (Sem-ECE under semantic), mean over seeds", "",
             f"| row | {head} |", "|---|" + "---|" * (2 * len(sets))]
    rows = {k: _rows(parts, k) for k in KINDS}
    for r in ROWS:
        if not rows["token"][r]:
            continue
        cells = []
        for n in sets:
            for k in KINDS:
                acc = [v[n]["accuracy"] for v in rows[k][r] if n in v]
                ece = [v[n]["ece"] for v in rows[k][r] if n in v]
                cells.append(f"{np.mean(acc):.3f} / {np.mean(ece):.3f}" if acc else "n/a")
        lines.append(f"| {LABELS[r]} | " + " | ".join(cells) + " |")
    return lines


def report(out_dir: Path, md: Path | None, command: str) -> str:
    parts = [json.loads(p.read_text()) for p in sorted((out_dir / "parts").glob("*.json"))]
    if not parts:
        raise SystemExit(f"no parts in {out_dir / 'parts'}")
    base = next(p for p in parts if p["part"] == "base")
    seeds = sorted(int(p["part"]) for p in parts if p["part"] != "base")
    sets = list(base["rows"]["uncalibrated"]["token"])
    s = base["sizes"]
    acc0 = {n: base["rows"]["uncalibrated"]["token"][n]["accuracy"] for n in sets}
    near_zero = [n for n in sets if acc0[n] < NEAR_ZERO]
    lines = ["# Open-ended calibration: CALM and its baselines under token and semantic confidence", ""]
    lines += [
        f"- Command: `{command}` (parts `base`, {', '.join(map(str, seeds))}, one process each, run side by side); "
        f"date {base['started'][:10]}",
        machine_line(machine_info(1), f"torch {torch.__version__}, 1 torch thread per part; wall / CPU per part: "
                     + ", ".join(f"{p['part']} {p['wall_s'] / 60:.1f} / {p['cpu_s'] / 60:.1f} min" for p in parts)),
        f"- Model `{s['model']}` (float32). Training: {base['n']['train']} capital and chemical-symbol questions "
        f"(`benchmarks/harness/open_facts.py`: the built-in open domains plus the other countries and elements); held-out: "
        f"{base['n']['heldout']} more (model selection, the temperature fits, CALM's unlabelled inputs); tests: "
        + ", ".join(f"{n} ({base['n'][n]})" for n in sets) + ". Prompt: "
        f"{s['fewshot']} solved examples from the training split (`Q: ... A: ...`), greedy answers stop at the newline.",
        f"- LoRA rank 8 on q_proj/v_proj of the top 6 layers; {s['steps']} steps of batch {s['batch_size']}, "
        f"held-out evaluation every {s['eval_every']} steps and the library's selection rule; CALM = the library's "
        "default (BOME); seeds " + ", ".join(map(str, seeds)) + " for the trained rows (mean ± sd over seeds); the "
        "untrained rows are one run with 95% bootstrap intervals.",
        f"- Confidence `token`: mean answer-token probability of the greedy answer. `semantic`: {s['samples']} answers "
        "sampled per question (temperature 1, top-p 1, seed 0 for every model), clustered by SQuAD-normalised exact "
        "match; the modal cluster is the answer, its sample-split frequency (10 splits) the confidence; ECE is Sem-ECE. "
        "`+ T` rows, the post-hoc knob of each kind: under `token`, T fitted on the held-out greedy answers by the "
        "log-loss of correctness of the token confidence (`llm_calib.confidence.temperature.fit_token_temperature`, "
        "exact token probabilities at any T), and the same answers at T; under `semantic`, the sampling temperature "
        "with the lowest held-out Sem-ECE among those keeping 95% of the held-out modal accuracy at T = 1 "
        "(`choose_sampling_temperature`: a hot temperature makes every sample differ, so Sem-ECE falls with the "
        "accuracy), and the test answers sampled at it.",
        f"- Check: the benchmark's token path equals `evaluate_records`' token confidence on the base model "
        f"(max |diff| of accuracy and ECE {base.get('token_check_max_abs_diff', float('nan')):.1e}).",
        "",
    ]
    unc = base["rows"]["uncalibrated"]
    temps = {"temperature": [unc["temperature"]]}
    samp = {"temperature": [unc["sampling_temperature"]]}
    for p in parts:
        for m, r in p["rows"].items():
            if m != "uncalibrated":
                temps.setdefault(f"{m}+T", []).append(r["temperature"])
                samp.setdefault(f"{m}+T", []).append(r["sampling_temperature"])
    lines.append("Token confidence, T fitted on the held-out greedy answers: "
                 + "; ".join(f"{LABELS[k]} {', '.join(f'{t:.3f}' for t in v)}" for k, v in temps.items()) + ".")
    lines.append("Semantic confidence, sampling temperature chosen on the held-out Sem-ECE from "
                 + ", ".join(f"{t:g}" for t in s.get("sampling_temperatures", SAMPLING_TEMPERATURES)) + ": "
                 + "; ".join(f"{LABELS[k]} {', '.join(f'{t:g}' for t in v)}" for k, v in samp.items()) + ".")
    at = unc.get("heldout_semantic_at", {})
    if at:
        lines.append("Held-out Sem-ECE / modal accuracy of the base model by sampling temperature: "
                     + ", ".join(f"T = {t}: {m['ece']:.3f} / {m['accuracy']:.3f}"
                                 for t, m in sorted(at.items(), key=lambda kv: float(kv[0]))) + ".")
    lines.append("")
    trained = [(m, int(p["part"]), r) for p in parts if p["part"] != "base" for m, r in p["rows"].items()]
    sel = SelectionSettings(**base.get("selection", {}))  # parts before the field: the defaults they ran with
    for m in ("lora_ce", "calm"):
        runs = sorted((seed, r) for name, seed, r in trained if name == m)
        if runs:
            lines.append(f"- {LABELS[m]}: selected step per seed " + ", ".join(
                f"{r['selected_step']} (token) / {r.get('semantic_selected_step', '?')} (semantic)" for _, r in runs)
                + f" of {s['steps']}; training " + ", ".join(f"{r['train_s'] / 60:.1f}" for _, r in runs) + " min"
                + ("; rows of a kept initial model are the base part's (the deployed model is the base model)"
                   if any(r.get("reused") for _, r in runs) else "") + ".")
    lines += ["- Selection is the library's rule on the metric each row reports: the lowest held-out ECE of the "
              "greedy answers (token rows; `selection.open_metric: generated`, in the training loop) or the lowest "
              "held-out Sem-ECE (semantic rows; the same rule replayed on the Sem-ECE recorded at every evaluation, "
              "`training.replay_selection`), among evaluations whose held-out accuracy (greedy, or the modal answer's) "
              "is at least 95% of the initial one; step 0 (the initial model) is a candidate. Evaluations every "
              f"{s['eval_every']} steps.", ""]
    lines += [*_summary(parts, sets), ""]
    lines += _selections(trained, sel.guard_accuracy, sel.guard_patience)
    lines += _measurement(trained, base["n"]["heldout"], s["samples"])
    if near_zero:
        lines += [f"**Near-zero accuracy** (uncalibrated token accuracy < {NEAR_ZERO}): {', '.join(near_zero)}. There the "
                  "model answers (almost) nothing correctly, so ECE equals the mean confidence and only rewards low "
                  "confidence; a lower ECE on these sets says the confidence fell, not that it became informative. "
                  "Read them with the accuracy and AUROC columns.", ""]
    for kind in KINDS:
        rows = _rows(parts, kind)
        title = "token confidence" if kind == "token" else "semantic confidence"
        for metric, name in (("accuracy", "Accuracy"), ("ece", "ECE" if kind == "token" else "Sem-ECE"),
                             ("brier", "Brier"), ("auroc", "AUROC"), ("mean_confidence", "Mean confidence")):
            lines += [f"## {name}, {title}", "", "| row | " + " | ".join(sets) + " |", "|---|" + "---|" * len(sets)]
            for r in ROWS:
                if rows[r]:
                    lines.append(f"| {LABELS[r]} | " + " | ".join(_cell(rows[r], n, metric) for n in sets) + " |")
            lines.append("")
    text = "\n".join(lines)
    if md is not None:
        write_text_atomic(md, text + "\n")
        write_json_atomic(md.with_suffix(".json"), {"parts": parts, "evaluations": _evaluations(trained),
                                                     "rank_correlations": rank_correlations(_evaluations(trained))})
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", default=None, help="base, or a seed (0, 1, 2): one process per part")
    p.add_argument("--report", action="store_true", help="join the parts in --out into --md")
    p.add_argument("--quick", action="store_true", help="tiny random model, every part and the report (seconds)")
    p.add_argument("--out", required=True, help="folder of the parts")
    p.add_argument("--md", type=Path, default=None, help="the report (and its JSON beside it)")
    p.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--real-sets", default=None, help="comma-separated real OOD sets (default: nq_open)")
    args = p.parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    if args.steps:
        sizes = replace(sizes, steps=args.steps)
    if args.real_sets:
        sizes = replace(sizes, real_sets=tuple(x.strip() for x in args.real_sets.split(",") if x.strip()))
    if not Path(args.data_dir).is_dir():
        args.data_dir = None
    command = "python benchmarks/open_calibration.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.quick:
        for part in ("base", *map(str, range(sizes.seeds))):
            run_part(part, sizes, args)
        print(report(Path(args.out), args.md, command))
        return 0
    if args.report:
        print(report(Path(args.out), args.md, command))
        return 0
    if args.part is None:
        p.error("give --part, --report or --quick")
    run_part(args.part, sizes, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
