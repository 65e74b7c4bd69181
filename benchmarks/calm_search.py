"""Search CALM's settings on the regimes benchmark's data, one trained model per setting.

Every setting trains on the same ARC questions with the same seed, selects on ARC-Easy dev and is
scored on ARC-Easy test (in domain) and the out-of-domain sets of ``benchmarks/calm_regimes.py``.
The base model's columns (uncalibrated, temperature carried over from the selection split) are
computed once. The *choice* among settings must use in-domain numbers only (selection-split ECE,
ARC-Easy test); the out-of-domain columns are reported, not searched on.

Each setting is one line of a JSON-lines file of ``name`` plus :class:`CalibrationConfig` fields
(over the base ``--config``); finished settings are kept in ``--out`` and skipped on a rerun.

Run::

    python benchmarks/calm_search.py --settings benchmarks/calm_search.jsonl --regime A
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from calm_regimes import OOD, real_data
from harness.report import machine_info, machine_line

from llm_calib.calm.run import task_format
from llm_calib.prompts.resolution import resolve_prompt_settings

ROOT = Path(__file__).resolve().parents[1]


def summarize(result, in_domain: str) -> dict[str, float]:
    per = {dom: r.uncalibrated for dom, r in result.domains.items()}
    ood = [d for d in per if d in OOD]
    return {
        "in_acc": per[in_domain]["accuracy"], "in_ece": per[in_domain]["ece"], "in_conf": per[in_domain]["mean_confidence"],
        "ood_acc": sum(per[d]["accuracy"] for d in ood) / len(ood), "ood_ece": sum(per[d]["ece"] for d in ood) / len(ood),
        "ood_conf": sum(per[d]["mean_confidence"] for d in ood) / len(ood),
        **{f"ece_{d}": per[d]["ece"] for d in ood},
    }


def fast_summary(model, tok, evals, encodings, cfg, in_domain: str) -> dict[str, float]:
    """In-domain and out-of-domain metrics of a top-layer LoRA model from cached trunks (the
    bottom layers are the base model's, computed once per question for every setting)."""
    from llm_calib.calm.encoding import encode_records
    from llm_calib.calm.fast_eval import trunk_scores
    from llm_calib.calm.lora import FunctionalLM
    from llm_calib.metrics.calibration import summarize as metrics_of

    lm = FunctionalLM(model)
    per = {}
    for name, records in evals:
        key = (name, cfg.prompt.scorer, cfg.prompt.style, cfg.prompt.chat_template, cfg.lora.layers)
        enc = encodings.setdefault(key, encode_records(tok, records, task_format(records, resolve_prompt_settings(cfg.prompt))))
        scores = trunk_scores(lm, enc, 8, tok.pad_token_id, cfg.prompt.normalize)
        per[name] = metrics_of([s.softmax(-1).numpy() for s in scores], [r.gold for r in records], ci=False)
    ood = [d for d in per if d in OOD]
    return {
        "in_acc": per[in_domain]["accuracy"], "in_ece": per[in_domain]["ece"],
        "in_conf": per[in_domain]["mean_confidence"],
        "ood_acc": sum(per[d]["accuracy"] for d in ood) / len(ood), "ood_ece": sum(per[d]["ece"] for d in ood) / len(ood),
        "ood_conf": sum(per[d]["mean_confidence"] for d in ood) / len(ood),
        **{f"ece_{d}": per[d]["ece"] for d in ood},
    }


def write_report(rows: list[dict], path: Path) -> None:
    """A markdown table of every finished setting, base columns first."""
    base = next(r for r in rows if r["name"] == "base")
    ts = base["ts"]
    ood_ts = sum(v for d, v in ts.items() if d in OOD) / len([d for d in ts if d in OOD])
    lines = [
        "# CALM settings searched (SmolLM2-135M-Instruct, one seed)",
        "",
        "- Command: `python benchmarks/calm_search.py --settings benchmarks/calm_search.jsonl --config "
        "benchmarks/calm_regimes.yaml --regime A` (and `--regime B`); every setting overrides the base config "
        "`benchmarks/calm_regimes.yaml` (BOME, 5 inner SGD steps of 0.05, gradient barrier, LoRA on layers 24-29, "
        "60 steps of 8).",
        f"- Machine: {rows[-1].get('machine', '')}, shared with other jobs (load 3-6); dates {rows[1].get('date', '')} "
        f"to {rows[-1].get('date', '')}.",
        "- Data as `benchmarks/calm_regimes.py`: ARC train 400, ARC-Easy dev 150 (selection), unlabelled A = 300 ARC "
        "dev questions, B = 300 prompts of the five OOD sets disjoint from their test questions; tests: ARC-Easy 100 "
        "(in domain) and OpenBookQA, QASC, CommonsenseQA, MMLU humanities, MMLU STEM, 100 each.",
        "- Choose settings on the in-domain columns only (held-out = selection split, ARC-Easy test); the OOD "
        "columns are reported, not searched on.",
        "",
        "| regime | setting | selected step | held-out ECE before → after | in-domain acc / conf / ECE | OOD mean acc / conf / ECE | train s |",
        "|---|---|---|---|---|---|---|",
        f"| - | uncalibrated | - | - | {base['in_acc']:.3f} / {base['in_conf']:.3f} / {base['in_ece']:.3f} | "
        f"{base['ood_acc']:.3f} / {base['ood_conf']:.3f} / {base['ood_ece']:.3f} | - |",
        f"| - | temperature (T = {base['T']:.2f}, selection split) | - | - | {base['in_acc']:.3f} / - / {ts['arc_easy']:.3f} | "
        f"{base['ood_acc']:.3f} / - / {ood_ts:.3f} | - |",
    ]
    for r in rows:
        if r["name"] == "base":
            continue
        lines.append(
            f"| {r['regime']} | {r['name']} `{json.dumps(r['setting'])}` | {int(r['selected_step'])} | "
            f"{r['heldout_before']:.3f} → {r['heldout_after']:.3f} | {r['in_acc']:.3f} / {r['in_conf']:.3f} / "
            f"{r['in_ece']:.3f} | {r['ood_acc']:.3f} / {r['ood_conf']:.3f} / {r['ood_ece']:.3f} | {r['train_s']:.0f} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    from harness.flat_config import with_flat

    from llm_calib.calm.encoding import encode_records
    from llm_calib.calm.trainer import calibrate
    from llm_calib.config.calibration import CalibrationConfig
    from llm_calib.evaluation.evaluate import evaluate_records
    from llm_calib.models import load as load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--settings", type=Path, required=True, help="JSON lines: name + CalibrationConfig fields")
    p.add_argument("--only", default=None, help="comma-separated names to run (default: all)")
    p.add_argument("--config", type=Path, default=None, help="base CalibrationConfig (YAML/JSON)")
    p.add_argument("--regime", default="A", choices=("A", "B"))
    p.add_argument("--n-train", type=int, default=400)
    p.add_argument("--n-select", type=int, default=150)
    p.add_argument("--n-unlabeled", type=int, default=300)
    p.add_argument("--n-unlabeled-per-set", type=int, default=60)
    p.add_argument("--n-eval", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--normalize", default=None, choices=("sum", "mean"),
                   help="option-score aggregation of every setting and of the base columns (default: the config's)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "calm_search.jsonl")
    p.add_argument("--report", action="store_true", help="only write the markdown table of --out next to it")
    args = p.parse_args()
    if args.report:
        write_report([json.loads(line) for line in args.out.read_text().splitlines() if line.strip()],
                     args.out.with_suffix(".md"))
        return
    torch.set_num_threads(args.threads)
    data = real_data(args)
    base_cfg = CalibrationConfig.from_file(args.config) if args.config else CalibrationConfig()
    if args.normalize:
        base_cfg = with_flat(base_cfg, normalize=args.normalize)
    model, tok = load_model("smollm2-135m-instruct")
    in_domain = data["evals"][0][0]
    done = {}
    if args.out.exists():
        done = {(r["regime"], r["name"]): r for r in map(json.loads, args.out.read_text().splitlines()) if r}
    if ("-", "base") not in done:
        t0 = time.perf_counter()
        base = evaluate_records(model, tok, data["evals"], temperature_fit=("select", data["select"]), ci=False,
                                normalize=base_cfg.prompt.normalize)
        row = {"regime": "-", "name": "base", **summarize(base, in_domain),
               "ts": {dom: r.temperature_scaled["ece"] for dom, r in base.domains.items()},
               "T": base.temperature.temperature, "seconds": time.perf_counter() - t0}
        with args.out.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(row, flush=True)
    del model
    settings = [json.loads(line) for line in args.settings.read_text().splitlines() if line.strip()]
    wanted = set(args.only.split(",")) if args.only else None
    encodings: dict[tuple, tuple] = {}
    eval_encodings: dict[tuple, object] = {}
    for s in settings:
        name = s.pop("name")
        if (wanted and name not in wanted) or (args.regime, name) in done:
            continue
        cfg = with_flat(base_cfg, **s)  # a setting: flat keys (harness.flat_config)
        key = (cfg.prompt.scorer, cfg.prompt.style, cfg.prompt.chat_template, cfg.lora.layers)
        if key not in encodings:  # the trunk cache is shared by settings adapting the same layers
            encodings[key] = tuple(encode_records(tok, data[k] if k != "unlabeled" else data[k][args.regime], task_format(data[k] if k != 'unlabeled' else data[k][args.regime], resolve_prompt_settings(cfg.prompt)))
                                   for k in ("train", "select", "unlabeled"))
        train, select, unlabeled = encodings[key]
        t0 = time.perf_counter()
        res = calibrate(load_model("smollm2-135m-instruct")[0], tok, train, select, cfg, unlabeled=unlabeled,
                        progress=False)
        train_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        metrics = fast_summary(res.model, tok, data["evals"], eval_encodings, cfg, in_domain)
        eval_s = time.perf_counter() - t0
        last = res.history[-1]
        row = {"regime": args.regime, "name": name, "setting": s, **metrics, "eval_s": eval_s,
               "selected_step": res.metrics["after"]["selected_step"],
               "heldout_before": res.metrics["before"]["ece"], "heldout_after": res.metrics["after"]["ece"],
               "last": {k: v for k, v in last.items() if isinstance(v, float)},
               "train_s": train_s, "machine": machine_line(machine_info(args.threads)).removeprefix("- Machine: "),
               "date": time.strftime("%Y-%m-%d %H:%M")}
        with args.out.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k not in ("last",)}), flush=True)
        del res


if __name__ == "__main__":
    main()
