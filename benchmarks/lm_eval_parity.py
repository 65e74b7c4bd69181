"""Parity with EleutherAI's lm-evaluation-harness: the same questions, the same prompts, both tools.

For ARC-Easy (first N test questions, ``--limit-mode first``) and MMLU (a seeded sample of N test
questions across subjects) this script

1. scores the questions with ``llm_calib`` under the lm-eval presets (``lm_eval_arc``,
   ``lm_eval_mmlu``; public API only: :func:`llm_calib.scoring.score_option_likelihood`),
2. writes the same questions to local JSON files and lm-eval task YAMLs of its own (lm-eval's
   ``arc_easy`` and ``mmlu`` prompts, ``dataset_path: json``; no hub access) and runs lm-eval's
   ``simple_evaluate`` with the ``hf`` backend on the same converted model directory, in a
   subprocess,
3. compares per question and option: identical prompt text, identical continuation, max and
   mean |Δ log-likelihood|, argmax disagreements for the summed (acc), per-character (acc_norm)
   and per-byte (acc_bytes) scores, the three accuracies both ways and the ECE of the softmax
   over the summed log-likelihoods computed from each tool's numbers.

lm-eval is not a dependency of llm-calib. Install it into the environment
(``pip install "llm-calib[bench]"`` or ``pip install "lm-eval[hf]==0.4.13"``), or into a separate
directory that only the lm-eval subprocess sees (keeps the test environment free of ``datasets``)::

    .venv/bin/pip install --target .bench-site --no-deps lm_eval==0.4.13 <its dependencies>
    .venv/bin/python benchmarks/lm_eval_parity.py --lm-eval-path .bench-site

Usage::

    .venv/bin/python benchmarks/lm_eval_parity.py            # 300 + 300 questions, writes the result
    .venv/bin/python benchmarks/lm_eval_parity.py --quick    # 20 + 20, prints only

``--write-fixture PATH`` also stores lm-eval's per-option log-likelihoods of the first few
questions of each set (ids and numbers only, no question text), which
``tests/test_lm_eval_parity.py`` checks llm_calib against without lm-eval.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from harness.report import machine_info, machine_line

ROOT = Path(__file__).resolve().parents[1]

ARC_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: gold
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
  - metric: acc_bytes
"""

# lm-eval 0.4.13 tasks/mmlu/default/_default_template_yaml, with the per-subject description
# written as a template over the document's subject.
MMLU_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
description: "The following are multiple choice questions (with answers) about {{{{subject}}}}.\\n\\n"
doc_to_text: "{{{{question.strip()}}}}\\nA. {{{{choices[0]}}}}\\nB. {{{{choices[1]}}}}\\nC. {{{{choices[2]}}}}\\nD. {{{{choices[3]}}}}\\nAnswer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: gold
metric_list:
  - metric: acc
  - metric: acc_norm
  - metric: acc_bytes
"""

SETS = {
    # name: (spec, limit mode, preset, yaml)
    "arc_easy": ("arc_easy:{root}:test", "first", "lm_eval_arc", ARC_YAML),
    "mmlu": ("mmlu:{root}/mmlu/test", "sample", "lm_eval_mmlu", MMLU_YAML),
}


def _lm_eval_contexts(cfg: dict[str, Any]) -> None:
    """Build lm-eval's few-shot requests (no model) and write each document's context."""
    from lm_eval.tasks import TaskManager, get_task_dict

    tm = TaskManager(include_path=cfg["task_dir"])
    out: dict[str, dict[str, str]] = {}
    for name, task in get_task_dict(cfg["tasks"], tm).items():
        task.set_config(key="num_fewshot", value=cfg["num_fewshot"])
        task.set_fewshot_seed(seed=1234)
        task.build_all_requests()
        docs = {i: d for i, d in enumerate(task.eval_docs)}
        out[name] = {docs[inst.doc_id]["id"]: inst.args[0] for inst in task.instances}
    Path(cfg["out"]).write_text(json.dumps(out))


def _lm_eval_worker(config_path: str) -> None:
    """Run lm-eval on the written tasks (in a subprocess that can import lm_eval)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    cfg = json.loads(Path(config_path).read_text())
    if cfg.get("contexts_only"):
        _lm_eval_contexts(cfg)
        return
    tm = TaskManager(include_path=cfg["task_dir"])
    t0 = time.perf_counter()
    res = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={cfg['model_dir']},dtype=float32",
        tasks=cfg["tasks"],
        task_manager=tm,
        num_fewshot=0,
        batch_size=cfg["batch_size"],
        device="cpu",
        log_samples=True,
    )
    seconds = time.perf_counter() - t0
    out: dict[str, Any] = {"version": getattr(lm_eval, "__version__", "?"), "seconds": seconds, "tasks": {}}
    for task in cfg["tasks"]:
        rows = []
        for s in sorted(res["samples"][task], key=lambda s: s["doc_id"]):
            args = s["arguments"]
            pairs = [(a["arg_0"], a["arg_1"]) for a in args.values()] if isinstance(args, dict) else [tuple(a) for a in args]
            rows.append({
                "id": s["doc"]["id"],
                "context": pairs[0][0],
                "continuations": [p[1] for p in pairs],
                "loglik": [float(r[0]) for r in s["filtered_resps"]],
                "acc": float(s["acc"]), "acc_norm": float(s["acc_norm"]), "acc_bytes": float(s["acc_bytes"]),
            })
        out["tasks"][task] = {"rows": rows, "results": res["results"][task]}
    Path(cfg["out"]).write_text(json.dumps(out))


def _ece(lls: list[list[float]], gold: list[int]) -> float:
    from llm_calib.metrics import calibration as metrics

    probs = [np.exp(np.asarray(z) - np.logaddexp.reduce(np.asarray(z))) for z in lls]
    conf, correct = metrics.confidence_correct(probs, np.asarray(gold))
    return metrics.ece(conf, correct, 10)


def _compare(ours: Any, records: list[Any], theirs: list[dict[str, Any]]) -> dict[str, Any]:
    by_id = {r["id"]: r for r in theirs}
    d_ll, prompt_diff, cont_diff = [], 0, 0
    disagree = {"acc": 0, "acc_norm": 0, "acc_bytes": 0}
    acc_ours = {"acc": [], "acc_norm": [], "acc_bytes": []}
    acc_theirs = {"acc": [], "acc_norm": [], "acc_bytes": []}
    lls_theirs, gold = [], []
    for det, rec in zip(ours.details, records, strict=True):
        t = by_id[rec.id]
        prompt_diff += det["prompt"] != t["context"]
        cont_diff += det["continuations"] != t["continuations"]
        a, b = np.asarray(det["loglik"]), np.asarray(t["loglik"])
        d_ll.extend(np.abs(a - b).tolist())
        for name, div in (("acc", None), ("acc_norm", "n_chars"), ("acc_bytes", "n_bytes")):
            scale = 1.0 if div is None else np.asarray(det[div], dtype=np.float64)
            pa, pb = int(np.argmax(a / scale)), int(np.argmax(b / scale))
            disagree[name] += pa != pb
            acc_ours[name].append(pa == rec.gold)
            acc_theirs[name].append(t[name])
        lls_theirs.append(t["loglik"])
        gold.append(rec.gold)
    return {
        "n": len(records),
        "n_options": sum(len(r.options) for r in records),
        "prompt_mismatches": prompt_diff,
        "continuation_mismatches": cont_diff,
        "max_abs_dll": float(max(d_ll)),
        "mean_abs_dll": float(np.mean(d_ll)),
        "disagreements": disagree,
        "ours": {k: float(np.mean(v)) for k, v in acc_ours.items()}
        | {"ece": _ece([d["loglik"] for d in ours.details], gold)},
        "lm_eval": {k: float(np.mean(v)) for k, v in acc_theirs.items()} | {"ece": _ece(lls_theirs, gold)},
    }


FEWSHOT_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
    dev: {dev}
output_type: multiple_choice
test_split: test
fewshot_split: dev
fewshot_config:
  sampler: first_n
{body}
"""


def _fewshot_check(args: argparse.Namespace, records: dict[str, list[Any]], env: dict[str, str]) -> dict[str, Any]:
    """Prompt-level parity of k-shot prompts (lm-eval's first_n sampler; no model is run)."""
    from llm_calib.data import load as load_data
    from llm_calib.prompts.templates import preset, record_prompt, with_fewshot

    k = args.fewshot_check
    work = Path(tempfile.mkdtemp(prefix="lm_eval_fewshot_"))
    # the task bodies after test_split, with the str.format escapes undone
    bodies = {
        name: yaml.split("test_split: test\n", 1)[1].replace("{{", "{").replace("}}", "}")
        for name, yaml in (("arc_easy", ARC_YAML), ("mmlu", MMLU_YAML))
    }

    def write(path: Path, recs: list[Any]) -> None:
        path.write_text("".join(json.dumps({"id": r.id, "question": r.question, "choices": list(r.options),
                                            "gold": r.gold, "subject": (r.meta.get("subject") or "").replace("_", " ")}) + "\n"
                                for r in recs))

    ours: dict[str, dict[str, str]] = {}
    tasks = []
    # ARC-Easy: k examples from train (first_n)
    arc = records["arc_easy"][: args.fewshot_n]
    train = load_data(f"arc_easy:{args.data_root}:train").records
    write(work / "arc_test.jsonl", arc)
    write(work / "arc_dev.jsonl", train[: 4 * k])
    (work / "fs_arc_easy.yaml").write_text(FEWSHOT_YAML.format(
        task="fs_arc_easy", data=work / "arc_test.jsonl", dev=work / "arc_dev.jsonl", body=bodies["arc_easy"]))
    tasks.append("fs_arc_easy")
    fmt = with_fewshot(preset("lm_eval_arc", fewshot=k, fewshot_sampler="first_n"), train[: 4 * k], exclude=arc)
    ours["fs_arc_easy"] = {r.id: record_prompt(None, r, fmt) for r in arc}
    # MMLU: one task per subject, k examples of that subject's dev split (lm-eval's mmlu k-shot)
    mmlu = records["mmlu"][: args.fewshot_n]
    dev = load_data(f"mmlu:{args.data_root}/mmlu/dev").records
    fmt = with_fewshot(preset("lm_eval_mmlu", fewshot=k), dev, exclude=mmlu)
    ours_mmlu = {}
    for subject in sorted({r.meta["subject"] for r in mmlu}):
        name = f"fs_mmlu_{subject}"
        test = [r for r in mmlu if r.meta["subject"] == subject]
        write(work / f"{name}_test.jsonl", test)
        write(work / f"{name}_dev.jsonl", [r for r in dev if r.meta["subject"] == subject])
        (work / f"{name}.yaml").write_text(FEWSHOT_YAML.format(
            task=name, data=work / f"{name}_test.jsonl", dev=work / f"{name}_dev.jsonl", body=bodies["mmlu"]))
        tasks.append(name)
        ours_mmlu.update({r.id: record_prompt(None, r, fmt) for r in test})
    cfg = {"task_dir": str(work), "tasks": tasks, "num_fewshot": k, "contexts_only": True,
           "out": str(work / "contexts.json")}
    (work / "config.json").write_text(json.dumps(cfg))
    subprocess.run([sys.executable, __file__, "--worker", str(work / "config.json")], env=env, check=True)
    theirs = json.loads((work / "contexts.json").read_text())
    arc_theirs = theirs["fs_arc_easy"]
    mmlu_theirs = {i: c for t in tasks[1:] for i, c in theirs[t].items()}
    out = {}
    for name, mine, other in (("arc_easy", ours["fs_arc_easy"], arc_theirs), ("mmlu", ours_mmlu, mmlu_theirs)):
        diff = [i for i in mine if mine[i] != other.get(i)]
        # "Answer:" cues per lm-eval context: k examples + the question (the examples are really there)
        cues = float(np.mean([c.count("Answer:") for c in other.values()]))
        out[name] = {"n": len(mine), "k": k, "prompt_mismatches": len(diff), "lm_eval_answer_cues": cues}
        if diff:
            out[name]["example"] = {"id": diff[0], "llm_calib": mine[diff[0]], "lm_eval": other.get(diff[0])}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=300, help="questions per set (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="20 questions per set, print only")
    p.add_argument("--data-root", default=str(ROOT.parent / "shared" / "data"))
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lm-eval-path", default=None, help="extra sys.path entry for the lm-eval subprocess")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lm_eval_parity.md"))
    p.add_argument("--write-fixture", default=None, metavar="PATH")
    p.add_argument("--fixture-n", type=int, default=4, help="questions per set in the fixture")
    p.add_argument("--fewshot-check", type=int, default=5, metavar="K",
                   help="also compare K-shot prompt texts with lm-eval's (first_n sampler; 0: skip) (default: %(default)s)")
    p.add_argument("--fewshot-n", type=int, default=50, help="questions per set in the few-shot prompt check")
    p.add_argument("--fewshot-only", action="store_true", help="run only the few-shot prompt check")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _lm_eval_worker(args.worker)
        return 0
    import torch

    from llm_calib.data import load as load_data
    from llm_calib.models import ALIASES, default_cache_dir
    from llm_calib.models import load as load_model
    from llm_calib.prompts.templates import preset
    from llm_calib.scoring import score_option_likelihood

    n = 20 if args.quick else args.n
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if args.lm_eval_path:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(args.lm_eval_path).resolve()), env.get("PYTHONPATH", "")])
    if args.fewshot_only:
        records = {name: load_data(spec.format(root=args.data_root), limit=n, limit_mode=mode, seed=0).records
                   for name, (spec, mode, _, _) in SETS.items()}
        fs = _fewshot_check(args, records, env)
        print(json.dumps(fs, indent=2))
        if not args.quick:
            _write_fewshot_section(Path(args.out), fs, argv)
        return 0
    model, tok = load_model(args.model)  # converts the GGUF into the cache directory once
    model_dir = str(default_cache_dir(args.model)) if args.model in ALIASES else args.model
    work = Path(tempfile.mkdtemp(prefix="lm_eval_parity_"))
    records, ours, seconds_ours = {}, {}, {}
    for name, (spec, mode, preset_name, yaml) in SETS.items():
        recs = load_data(spec.format(root=args.data_root), limit=n, limit_mode=mode, seed=0).records
        records[name] = recs
        rows = [{"id": r.id, "question": r.question, "choices": list(r.options), "gold": r.gold,
                 "subject": (r.meta.get("subject") or "").replace("_", " ")} for r in recs]
        data = work / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (work / f"parity_{name}.yaml").write_text(yaml.format(task=f"parity_{name}", data=data))
        t0 = time.perf_counter()
        ours[name] = score_option_likelihood(model, tok, recs, prompt=preset(preset_name), batch_size=args.batch_size)
        seconds_ours[name] = time.perf_counter() - t0
        print(f"llm_calib {name}: {len(recs)} questions in {seconds_ours[name]:.1f} s", file=sys.stderr)
    cfg = {"task_dir": str(work), "model_dir": model_dir, "tasks": [f"parity_{k}" for k in SETS],
           "batch_size": args.batch_size, "out": str(work / "lm_eval.json")}
    (work / "config.json").write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--worker", str(work / "config.json")], env=env, check=True)
    wall_theirs = time.perf_counter() - t0
    theirs = json.loads((work / "lm_eval.json").read_text())
    results = {name: _compare(ours[name], records[name], theirs["tasks"][f"parity_{name}"]["rows"]) for name in SETS}
    for name, r in results.items():
        r["seconds_llm_calib"] = seconds_ours[name]
    print(json.dumps(results, indent=2))
    if args.write_fixture:
        fixture = {"model": args.model, "lm_eval_version": theirs["version"],
                   "note": "lm-eval's per-option log-likelihoods (ids and numbers only; question texts are read from the data root at test time)",
                   "sets": {}}
        for name, (spec, mode, preset_name, _) in SETS.items():
            rows = theirs["tasks"][f"parity_{name}"]["rows"][: args.fixture_n]
            fixture["sets"][name] = {
                "spec": spec, "limit": n, "limit_mode": mode, "seed": 0, "preset": preset_name,
                "questions": [{"id": r["id"], "loglik": r["loglik"]} for r in rows],
            }
        Path(args.write_fixture).write_text(json.dumps(fixture, indent=1) + "\n")
    if args.quick:
        return 0
    cmd = "python benchmarks/lm_eval_parity.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "# lm-eval parity: llm-calib evaluate vs lm-evaluation-harness",
        "",
        f"- command: `{cmd.strip()}`",
        f"- date: {datetime.date.today().isoformat()}; torch {torch.__version__}, lm-eval {theirs['version']}, "
        "float32, CPU",
        machine_line(machine_info(), "shared with other jobs"),
        f"- model: {args.model} (the same converted directory for both tools), no chat template, zero-shot",
        "- ARC-Easy: the first N test questions (`--limit-mode first`); MMLU: a seeded sample of N test",
        "  questions (seed 0) across subjects; both tools get the same questions (lm-eval from local",
        "  JSON files and task YAMLs this script writes, lm-eval's arc_easy and mmlu prompts)",
        "- llm-calib: `score_option_likelihood` with the presets `lm_eval_arc` / `lm_eval_mmlu`",
        "  (what `llm-calib evaluate --prompt-preset ...` runs); ECE: 10 bins, softmax over the summed",
        "  log-likelihoods of each tool",
        "",
        "| | ARC-Easy | MMLU |",
        "|---|---|---|",
    ]
    a, m = results["arc_easy"], results["mmlu"]

    def row(label: str, f: Any) -> str:
        return f"| {label} | {f(a)} | {f(m)} |"

    lines += [
        row("questions (options)", lambda r: f"{r['n']} ({r['n_options']})"),
        row("prompt texts differing", lambda r: r["prompt_mismatches"]),
        row("continuation texts differing", lambda r: r["continuation_mismatches"]),
        row("max abs Δ log-likelihood", lambda r: f"{r['max_abs_dll']:.2e}"),
        row("mean abs Δ log-likelihood", lambda r: f"{r['mean_abs_dll']:.2e}"),
        row("argmax disagreements acc / acc_norm / acc_bytes",
            lambda r: " / ".join(str(r["disagreements"][k]) for k in ("acc", "acc_norm", "acc_bytes"))),
        row("acc: llm-calib / lm-eval", lambda r: f"{r['ours']['acc']:.4f} / {r['lm_eval']['acc']:.4f}"),
        row("acc_norm: llm-calib / lm-eval", lambda r: f"{r['ours']['acc_norm']:.4f} / {r['lm_eval']['acc_norm']:.4f}"),
        row("acc_bytes: llm-calib / lm-eval", lambda r: f"{r['ours']['acc_bytes']:.4f} / {r['lm_eval']['acc_bytes']:.4f}"),
        row("ECE (acc scores): llm-calib / lm-eval numbers", lambda r: f"{r['ours']['ece']:.6f} / {r['lm_eval']['ece']:.6f}"),
    ]
    total_ours = sum(seconds_ours.values())
    lines += [
        "",
        f"Time: llm-calib scored both sets in {total_ours:.1f} s (model already loaded); the lm-eval",
        f"subprocess took {wall_theirs:.1f} s wall, {theirs['seconds']:.1f} s inside `simple_evaluate`"
        f" (ratio {theirs['seconds'] / total_ours:.1f}x; measured one after the other, not interleaved, on a shared machine: indicative only).",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    if args.fewshot_check:
        _write_fewshot_section(Path(args.out), _fewshot_check(args, records, env), argv)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _write_fewshot_section(path: Path, fs: dict[str, Any], argv: list[str] | None) -> None:
    """Replace the few-shot section of the result file."""
    text = path.read_text() if path.is_file() else "# lm-eval parity: llm-calib evaluate vs lm-evaluation-harness\n"
    text = text.split("\n## Few-shot prompts")[0].rstrip("\n") + "\n"
    cmd = "python benchmarks/lm_eval_parity.py " + " ".join(argv if argv is not None else sys.argv[1:])
    a, m = fs["arc_easy"], fs["mmlu"]
    text += (
        "\n## Few-shot prompts\n\n"
        f"`{cmd.strip()}` builds lm-eval's {a['k']}-shot requests (no model run) with the `first_n` sampler "
        "(ARC-Easy: examples from train; MMLU: one task per subject, examples from that subject's dev "
        "split, as lm-eval's `mmlu` does) and compares each context with `record_prompt` under "
        f"`preset(..., fewshot={a['k']}, fewshot_sampler=\"first_n\")` (the MMLU preset matches the subject).\n\n"
        "| | ARC-Easy | MMLU |\n|---|---|---|\n"
        f"| questions | {a['n']} | {m['n']} |\n"
        f"| prompt texts differing | {a['prompt_mismatches']} | {m['prompt_mismatches']} |\n"
        f"| `Answer:` cues per lm-eval context (k + 1 expected) | {a['lm_eval_answer_cues']:.2f} | "
        f"{m['lm_eval_answer_cues']:.2f} |\n"
    )
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
