"""Open-ended calibration, measured: CALM and its baselines on open questions, under token and
semantic confidence, at several seeds.

Trained on open questions the model can answer (capitals and chemical symbols, ``harness/open_facts.py``:
the built-in open domains plus the rest of the countries and elements), tested in domain and on
sets of other kinds (built-in sums, NQ-open, TriviaQA from SelfAware, WebQuestions). Rows:
uncalibrated, temperature scaling, LoRA CE, LoRA CE + T, CALM, CALM + T. Confidence:

- ``token``: mean answer-token probability of the greedy answer; ``+ T`` rows: the same answers'
  token probabilities at the temperature fitted on the held-out split (log-loss of correctness);
- ``semantic``: N sampled answers clustered by SQuAD-normalised exact match; the modal cluster's
  sample-split frequency (ECE here is Sem-ECE); ``+ T`` rows sample from the temperature-scaled
  model, i.e. at the fitted temperature (the deployed model with temperature T is softmax(z / T)).

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

from calibration_bench import TEMPERATURE_GRID, fit_open_temperature
from harness.open_facts import fact_questions
from harness.report import machine_info, machine_line

from llm_calib import (
    CalibrationConfig,
    Calm,
    LoraCE,
    LoraSettings,
    PromptSettings,
    SelectionSettings,
    TrainingSettings,
    calibrate,
)
from llm_calib.calm.fast_eval import open_ended_set
from llm_calib.confidence.kinds import OpenConfidence
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
    eval_every: int = 10
    samples: int = 10
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


def greedy_grid(model: Any, tok: Any, records: list[OpenQA], fmt: Any, sizes: Sizes) -> list[GenOut]:
    """Greedy answers with every answer token's probability on the temperature grid."""
    prompts = encode_open_prompts(tok, records, fmt)
    outs: list[GenOut] = []
    for i in range(0, len(prompts), sizes.gen_batch):
        batch = generate_greedy(model, tok, prompts[i : i + sizes.gen_batch], max_new_tokens=sizes.max_new_tokens,
                                temperatures=TEMPERATURE_GRID,
                                until=[getattr(r, "until", None) for r in records[i : i + sizes.gen_batch]])
        outs += [GenOut(a.text, a.token_ids, a.token_probs, a.temp_probs) for a in batch]
    return outs


def _clean(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def score_model(model: Any, tok: Any, d: dict[str, Any], fmt: Any, sizes: Sizes, log: Any) -> dict[str, Any]:
    """One model's rows: token and semantic confidence, at T = 1 and at the temperature fitted on the
    held-out split; per test set, every metric (with bootstrap intervals)."""
    t0 = time.perf_counter()
    held = greedy_grid(model, tok, d["heldout"], fmt, sizes)
    T, g = fit_open_temperature(d["heldout"], held, TEMPERATURE_GRID)
    log(f"  temperature fitted on the held-out split: T = {T:.3f}")
    out: dict[str, Any] = {"temperature": T, "token": {}, "token+T": {}, "semantic": {}, "semantic+T": {}}
    boot = {"ci": sizes.bootstrap > 0, "n_resamples": max(sizes.bootstrap, 1), "seed": 0}
    for name, recs in d["tests"].items():
        outs = greedy_grid(model, tok, recs, fmt, sizes)
        out["token"][name] = _clean(open_ended_set(recs, outs).summary(**boot))
        out["token+T"][name] = _clean(open_ended_set(recs, outs, g).summary(**boot))
        log(f"  greedy {name}: accuracy {out['token'][name]['accuracy']:.3f}")
    out["greedy_s"] = time.perf_counter() - t0
    for key, temp in (("semantic", 1.0), ("semantic+T", T)):
        t1 = time.perf_counter()
        conf = OpenConfidence("semantic", samples=sizes.samples, temperature=temp, seed=0)
        res = evaluate_records(model, tok, list(d["tests"].items()), open_prompt=fmt, confidence=conf,
                               max_new_tokens=sizes.max_new_tokens, batch_size=sizes.gen_batch, **boot)
        out[key] = {dom: _clean(r.uncalibrated) for dom, r in res.domains.items()}
        out[f"{key}_s"] = time.perf_counter() - t1
        log(f"  {key} (T = {temp:.3f}): {out[f'{key}_s']:.0f} s")
    return out


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
    fmt = open_prompt_format(config(sizes, d["examples"], "lora_ce", 0, n_layers).prompt)
    record: dict[str, Any] = {"part": part, "sizes": sizes.__dict__, "started": _dt.datetime.now(_dt.UTC).isoformat(),
                              "n": {"train": len(d["train"]), "heldout": len(d["heldout"]),
                                    **{k: len(v) for k, v in d["tests"].items()}}, "examples": d["examples"]}
    t0, cpu0 = time.perf_counter(), time.process_time()
    if part == "base":
        log("scoring the base model")
        base = score_model(model, tok, d, fmt, sizes, log)
        # the benchmark's token path is the library's: evaluate's token confidence on the same answers
        check = evaluate_records(model, tok, list(d["tests"].items()), open_prompt=fmt, ci=False,
                                 max_new_tokens=sizes.max_new_tokens, batch_size=sizes.gen_batch)
        record["token_check_max_abs_diff"] = max(
            abs(check.domains[n].uncalibrated[m] - base["token"][n][m]) for n in d["tests"] for m in ("accuracy", "ece"))
        record["rows"] = {"uncalibrated": base}
    else:
        seed = int(part)
        record["rows"] = {}
        for method in ("lora_ce", "calm"):
            cfg = config(sizes, d["examples"], method, seed, n_layers)
            log(f"training {method}, seed {seed}: {sizes.steps} steps")
            t1 = time.perf_counter()
            result = calibrate(copy.deepcopy(model), tok, d["train"], d["heldout"], cfg, progress=False)
            train_s = time.perf_counter() - t1
            selected = result.metrics.get("after", {}).get("selected_step")
            base_part = out_dir / "parts" / "base.json"
            if selected == 0 and base_part.is_file():
                # the selection rule kept the initial model: the deployed model is the base model (LoRA's B = 0)
                # and the samples are seeded alike, so its rows are the base part's (scored anyway once, on
                # 2026-12-06, seed 0's LoRA CE at step 0 matched the base part to 2.3e-08 under token, exactly
                # under semantic)
                log(f"  {method}: the initial model was kept (selected step 0): its rows are the base part's")
                scored = {**json.loads(base_part.read_text())["rows"]["uncalibrated"], "reused": "base"}
            else:
                scored = score_model(result.model, tok, d, fmt, sizes, log)
            scored["train_s"] = train_s
            scored["selected_step"] = selected
            scored["notes"] = list(getattr(result, "notes", []) or [])
            scored["history"] = result.history
            record["rows"][method] = scored
            del result
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


def _histories(trained: list[tuple[str, int, dict[str, Any]]]) -> list[str]:
    """The held-out (teacher-forced) ECE and accuracy at each evaluation of the runs that recorded them."""
    rows = [(m, seed, r["history"]) for m, seed, r in sorted(trained, key=lambda t: (t[0], t[1])) if r.get("history")]
    if not rows:
        return []
    lines = ["## Held-out split during training (teacher-forced proxy: ECE / accuracy per evaluation)", "",
             "| run | selected step | evaluations |", "|---|---|---|"]
    for m, seed, hist in rows:
        evals = ", ".join(f"step {int(h['step'])}: {h['heldout_ece']:.3f} / {h['heldout_accuracy']:.3f}"
                          for h in hist if "heldout_ece" in h)
        selected = next(r["selected_step"] for name, s, r in trained if name == m and s == seed)
        lines.append(f"| {LABELS[m]}, seed {seed} | {selected} | {evals} |")
    missing = sorted({seed for m, seed, r in trained if not r.get("history")})
    if missing:
        lines += ["", f"(Seeds {', '.join(map(str, missing))} ran before the parts kept the history; their selected steps "
                  "are above.)"]
    return [*lines, ""]


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
        f"- Command: `{command}` (parts `base`, {', '.join(map(str, seeds))}, one process each, run two at a time); "
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
        "`+ T` rows: T fitted on the held-out greedy answers (log-loss of correctness of the token confidence, "
        "grid 0.25-64); under `token` the same answers at T, under `semantic` answers sampled at T (the "
        "temperature-scaled model's own samples).",
        f"- Check: the benchmark's token path equals `evaluate_records`' token confidence on the base model "
        f"(max |diff| of accuracy and ECE {base.get('token_check_max_abs_diff', float('nan')):.1e}).",
        "",
    ]
    temps = {"temperature": [base["rows"]["uncalibrated"]["temperature"]]}
    for p in parts:
        for m, r in p["rows"].items():
            if m != "uncalibrated":
                temps.setdefault(f"{m}+T", []).append(r["temperature"])
    lines.append("Fitted temperatures: " + "; ".join(f"{LABELS[k]} {', '.join(f'{t:.2f}' for t in v)}" for k, v in temps.items()) + ".")
    lines.append("")
    trained = [(m, int(p["part"]), r) for p in parts if p["part"] != "base" for m, r in p["rows"].items()]
    for m in ("lora_ce", "calm"):
        runs = sorted((seed, r) for name, seed, r in trained if name == m)
        if runs:
            lines.append(f"- {LABELS[m]}: selected step per seed " + ", ".join(f"{r['selected_step']}" for _, r in runs)
                         + f" of {s['steps']}; training " + ", ".join(f"{r['train_s'] / 60:.1f}" for _, r in runs) + " min"
                         + ("; rows of runs that kept the initial model are the base part's (the deployed model is "
                            "the base model)" if any(r.get("reused") for _, r in runs) else "") + ".")
    lines += ["- Selection is the library's rule: the lowest held-out ECE (for open questions a teacher-forced proxy) "
              "among evaluations whose held-out accuracy is at least 95% of the initial one; step 0 (the initial "
              "model) is a candidate, so a run whose training only raised the held-out ECE deploys the base model.", ""]
    lines += [*_summary(parts, sets), ""]
    lines += _histories(trained)
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
        write_json_atomic(md.with_suffix(".json"), {"parts": parts})
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
