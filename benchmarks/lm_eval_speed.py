"""Speed side by side with EleutherAI's lm-evaluation-harness: the same model directory, the same
questions (local lm-eval task YAMLs over ``../shared/data``), the same batch size, both as a user
runs them (command-line processes), in interleaved rounds.

Four task shapes:

* ``piqa_style`` (zero-shot): two solutions of several tokens each (``doc_to_choice:
  "{{[sol1, sol2]}}"``), built from ARC-Easy test questions (the gold answer and one distractor,
  the gold one first on even rows);
* ``letter_choice`` (zero-shot): MMLU test questions with the options listed and the letters
  ``A``-``D`` as choices, no description (a MedMCQA-like letter task);
* ``mmlu_5shot``: lm-eval's MMLU prompt (per-subject description) with 5 examples of the
  subject's dev split (``first_n``), ``--per-subject`` questions of each of ``--subjects``;
* ``csqa_5shot``: CommonsenseQA dev questions (``--text-n``) with the five option texts as
  choices (``Question: ...\nAnswer:``, multi-token continuations), 5 examples of the train split
  (``first_n``).

Each round runs ``lm_eval --model hf ... --log_samples`` and ``llm-calib evaluate --data
lm_eval:TASK:include=DIR --log-samples`` (and, with ``--baseline-tree DIR``, the same command on
another llm-calib source tree, e.g. a checkout of the commit before a change); the order rotates
each round. It records wall time and the CPU time of each child process; the tools' per-option
log-likelihoods are matched by task and document and compared (maximum absolute difference,
argmax agreement). The environment passes to every child, so ``OMP_NUM_THREADS`` sets the
threads of all sides alike (recorded).

lm-eval is not a dependency of llm-calib (``pip install "llm-calib[bench]"``).

Usage::

    .venv/bin/python benchmarks/lm_eval_speed.py --rounds 2 --zero-shot-n 100 --per-subject 60
    .venv/bin/python benchmarks/lm_eval_speed.py --baseline-tree ../base  # also time an older tree
    .venv/bin/python benchmarks/lm_eval_speed.py --quick          # a few questions, prints only
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from harness.report import machine_info

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

PIQA_YAML = """\
task: speed_piqa_style
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{goal}}}}\\nAnswer:"
doc_to_target: label
doc_to_choice: "{{{{[sol1, sol2]}}}}"
metric_list:
  - metric: acc
"""

LETTER_YAML = """\
task: speed_letter_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question.strip()}}}}\\nChoices:\\nA. {{{{choices[0]}}}}\\nB. {{{{choices[1]}}}}\\nC. {{{{choices[2]}}}}\\nD. {{{{choices[3]}}}}\\nAnswer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
metric_list:
  - metric: acc
"""

# lm-eval 0.4.13 tasks/mmlu/default/_default_template_yaml with a subject's dev split as few-shot pool
MMLU_YAML = """\
task: speed_mmlu5_{subject}
tag: speed_mmlu5
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
num_fewshot: 5
description: "The following are multiple choice questions (with answers) about {subject_text}.\\n\\n"
doc_to_text: "{{{{question.strip()}}}}\\nA. {{{{choices[0]}}}}\\nB. {{{{choices[1]}}}}\\nC. {{{{choices[2]}}}}\\nD. {{{{choices[3]}}}}\\nAnswer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
metric_list:
  - metric: acc
"""

# CommonsenseQA as text choices (the option texts scored after "Answer:"), 5 examples of the train split (first_n)
CSQA_YAML = """\
task: speed_csqa5
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
    train: {train}
output_type: multiple_choice
test_split: test
fewshot_split: train
fewshot_config:
  sampler: first_n
num_fewshot: 5
doc_to_text: "Question: {{{{question.strip()}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""

SUBJECTS = ("high_school_geography", "high_school_psychology", "miscellaneous", "nutrition", "prehistory",
            "high_school_macroeconomics", "marketing")
LETTER_SUBJECTS = ("clinical_knowledge", "college_medicine", "medical_genetics", "anatomy", "professional_medicine")


def _mmlu_rows(data: Path, subject: str, split: str) -> list[dict[str, Any]]:
    with open(data / "mmlu" / split / f"{subject}_{split}.csv", newline="", encoding="utf-8") as f:
        return [{"question": r[0], "choices": r[1:5], "answer": "ABCD".index(r[5].strip()), "subject": subject}
                for r in csv.reader(f)]


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _csqa_rows(path: Path, n: int) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines()[:n]:
        r = json.loads(line)
        labels = [c["label"] for c in r["question"]["choices"]]
        rows.append({"question": r["question"]["stem"], "choices": [c["text"] for c in r["question"]["choices"]],
                     "label": labels.index(r["answerKey"])})
    return rows


def build_tasks(work: Path, data: Path, zero_n: int, subjects: list[str], per_subject: int,
                text_n: int) -> dict[str, dict]:
    """Write the task YAMLs and their rows; returns ``{shape: {"task": name, "n": questions}}``."""
    arc = [json.loads(line) for line in (data / "arc_easy" / "test.jsonl").read_text().splitlines()[:zero_n]]
    piqa = []
    for i, r in enumerate(arc):
        labels = [c["label"] for c in r["question"]["choices"]]
        texts = [c["text"] for c in r["question"]["choices"]]
        gold = labels.index(r["answerKey"])
        sols = [texts[gold], texts[(gold + 1) % len(texts)]]
        piqa.append({"goal": r["question"]["stem"], "sol1": sols[i % 2], "sol2": sols[1 - i % 2], "label": i % 2})
    _write(work / "piqa.jsonl", piqa)
    (work / "speed_piqa_style.yaml").write_text(PIQA_YAML.format(data=work / "piqa.jsonl"))
    letter: list[dict[str, Any]] = []
    for s in LETTER_SUBJECTS:
        letter.extend(_mmlu_rows(data, s, "test")[: -(-zero_n // len(LETTER_SUBJECTS))])
    _write(work / "letter.jsonl", letter[:zero_n])
    (work / "speed_letter_choice.yaml").write_text(LETTER_YAML.format(data=work / "letter.jsonl"))
    for s in subjects:
        _write(work / f"mmlu_{s}_test.jsonl", _mmlu_rows(data, s, "test")[:per_subject])
        _write(work / f"mmlu_{s}_dev.jsonl", _mmlu_rows(data, s, "dev"))
        (work / f"speed_mmlu5_{s}.yaml").write_text(MMLU_YAML.format(
            subject=s, subject_text=s.replace("_", " "), data=work / f"mmlu_{s}_test.jsonl",
            dev=work / f"mmlu_{s}_dev.jsonl"))
    csqa = _csqa_rows(data / "commonsenseqa" / "genmc_dev.jsonl", text_n)
    _write(work / "csqa_test.jsonl", csqa)
    _write(work / "csqa_train.jsonl", _csqa_rows(data / "commonsenseqa" / "genmc_train.jsonl", 5))
    (work / "speed_csqa5.yaml").write_text(CSQA_YAML.format(data=work / "csqa_test.jsonl",
                                                            train=work / "csqa_train.jsonl"))
    return {"piqa_style": {"task": "speed_piqa_style", "n": len(piqa), "fewshot": 0},
            "letter_choice": {"task": "speed_letter_choice", "n": len(letter[:zero_n]), "fewshot": 0},
            "mmlu_5shot": {"task": "speed_mmlu5", "n": len(subjects) * per_subject, "fewshot": 5,
                           "subjects": subjects},
            "csqa_5shot": {"task": "speed_csqa5", "n": len(csqa), "fewshot": 5}}


def _timed(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, float]:
    """Run ``cmd`` in ``log``'s folder (``python -m`` puts the working directory first on ``sys.path``: the
    environment's ``PYTHONPATH`` chooses the tree); its wall time and the CPU time (user + system) of the child."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, check=False, cwd=log.parent)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed (exit {proc.returncode}); see {log}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu}


def run_lm_eval(task: str, work: Path, model_dir: Path, batch: int, out: Path, env: dict[str, str]) -> dict:
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf",
           "--model_args", f"pretrained={model_dir},dtype=float32", "--tasks", task, "--include_path", str(work),
           "--batch_size", str(batch), "--device", "cpu", "--log_samples", "--output_path", str(out)]
    return _timed(cmd, env, out.with_suffix(".log"))


def run_llm_calib(task: str, work: Path, model_dir: Path, batch: int, out: Path, env: dict[str, str],
                  extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "llm_calib.cli", "evaluate", "--model", str(model_dir),
           "--data", f"lm_eval:{task}:include={work}", "--batch-size", str(batch), "--bootstrap", "0",
           "--log-samples", "--quiet", "--out", str(out), *extra]
    return _timed(cmd, env, out.with_suffix(".log"))


def lm_eval_loglik(out: Path) -> dict[tuple[str, int], list[float]]:
    """``(task, doc_id) -> per-option log-likelihoods`` from lm-eval's samples files."""
    rows = {}
    for f in out.rglob("samples_*.jsonl"):
        task = f.name[len("samples_"):].rsplit("_", 1)[0]
        for line in f.read_text().splitlines():
            s = json.loads(line)
            rows[(task, int(s["doc_id"]))] = [float(r[0]) for r in s["filtered_resps"]]
    return rows


def llm_calib_loglik(out: Path) -> dict[tuple[str, int], list[float]]:
    """The same from ``llm-calib evaluate --log-samples`` (ids ``TASK/DOC_ID``)."""
    rows = {}
    for line in (out / "samples.jsonl").read_text().splitlines():
        s = json.loads(line)
        task, doc = s["id"].rsplit("/", 1)
        rows[(task, int(doc))] = [float(v) for v in s["loglik"]]
    return rows


def compare(theirs: dict, ours: dict) -> dict[str, Any]:
    if set(theirs) != set(ours):
        raise RuntimeError(f"different documents: {len(theirs)} in lm-eval, {len(ours)} in llm-calib")
    diffs = [abs(a - b) for k in theirs for a, b in zip(theirs[k], ours[k], strict=True)]
    agree = sum(int(np.argmax(theirs[k])) == int(np.argmax(ours[k])) for k in theirs)
    return {"questions": len(theirs), "options": len(diffs), "max_abs_dll": max(diffs),
            "mean_abs_dll": float(np.mean(diffs)), "argmax_agree": agree}


def prefix_cache_stats(task: str, work: Path, model_dir: Path, batch: int) -> dict[str, Any]:
    """What llm-calib's prefix cache does on a task (groups, requests, tokens saved, peak bytes), from its
    batch plan (:func:`llm_calib.engine.prefix.plan_prefix_batches`, the default bound), without running the model."""
    from transformers import AutoConfig, AutoTokenizer

    from llm_calib.data import load
    from llm_calib.engine.prefix import DEFAULT_PREFIX_CACHE_MB, plan_prefix_batches
    from llm_calib.prompts.templates import PromptFormat
    from llm_calib.scoring.option_likelihood import encode_questions

    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = AutoConfig.from_pretrained(model_dir)
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # float32 keys/values
    items = encode_questions(tok, load(f"lm_eval:{task}:include={work}").records, PromptFormat())
    plan = plan_prefix_batches([it.prompt for it in items], [it.n_tokens for it in items], batch,
                               bytes_per_token=per_token, max_bytes=DEFAULT_PREFIX_CACHE_MB * 2**20)
    shared = [b for b in plan if b.prefix_len > 0]
    groups = {(b.prefix_len, tuple(items[b.indices[0]].prompt[: b.prefix_len])) for b in shared}
    total = sum(it.n_tokens for it in items)
    saved = sum(len(b.indices) * b.prefix_len for b in shared) - sum(n for n, _ in groups)
    return {"groups": len(groups), "requests": sum(len(b.indices) for b in shared), "tokens_saved": saved,
            "tokens_total": total, "peak_bytes": max(((len(b.indices) + 1) * b.prefix_len * per_token
                                                      for b in shared), default=0),
            "prompt_tokens_mean": float(np.mean([len(it.prompt) for it in items]))}


def scoring_only(tasks: dict[str, str], work: Path, model_dir: Path, batch: int, rounds: int) -> dict[str, Any]:
    """The scoring engine alone, in this process: each task's records (loaded once) scored with flat batches
    and with the padded layout (:func:`llm_calib.engine.flat.flat_batches`), alternating which runs first;
    CPU time of each (``time.process_time``), and the largest log-likelihood difference between them."""
    import torch

    from llm_calib.data import load
    from llm_calib.engine.flat import flat_batches
    from llm_calib.models import load as load_model
    from llm_calib.scoring import score_option_likelihood

    model, tok = load_model(str(model_dir))
    out: dict[str, Any] = {}
    for name, task in tasks.items():
        records = load(f"lm_eval:{task}:include={work}").records
        times: dict[str, list[float]] = {"flat": [], "padded": []}
        scored: dict[str, Any] = {}
        for r in range(rounds):
            for layout in (("flat", "padded") if r % 2 == 0 else ("padded", "flat")):
                with flat_batches(layout == "flat"), torch.inference_mode():
                    t0 = time.process_time()
                    scored[layout] = score_option_likelihood(model, tok, records, batch_size=batch)
                    times[layout].append(time.process_time() - t0)
        diff = max(abs(a - b) for x, y in zip(scored["flat"].details, scored["padded"].details, strict=True)
                   for a, b in zip(x["loglik"], y["loglik"], strict=True))
        out[name] = {"questions": len(records), "flat_cpu_s": times["flat"], "padded_cpu_s": times["padded"],
                     "speedup": float(np.mean(times["padded"]) / np.mean(times["flat"])), "max_abs_dll": diff,
                     "argmax_agree": int((scored["flat"].predictions == scored["padded"].predictions).sum())}
        print(name, json.dumps(out[name]), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a model directory, or a built-in alias (its converted cache directory is used)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--zero-shot-n", type=int, default=100)
    p.add_argument("--per-subject", type=int, default=60)
    p.add_argument("--subjects", type=int, default=5)
    p.add_argument("--text-n", type=int, default=240, help="CommonsenseQA questions of the csqa_5shot shape")
    p.add_argument("--shapes", default="mmlu_5shot,csqa_5shot,piqa_style,letter_choice")
    p.add_argument("--quick", action="store_true", help="8 questions per shape, 1 round, print only")
    p.add_argument("--out", type=Path, default=RESULTS / "lm_eval_speed")
    p.add_argument("--baseline-tree", type=Path, default=None,
                   help="another llm-calib source tree run as a third side (llm_calib_base) in the same rounds")
    p.add_argument("--scoring-only", action="store_true",
                   help="only time the scoring engine in this process, flat batches against the padded layout, "
                        "and add it to --out's JSON (scoring_only)")
    p.add_argument("--prefix-stats-only", action="store_true",
                   help="only add the prefix cache's plan (groups, tokens saved, peak bytes) to --out's JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.zero_shot_n, args.per_subject, args.subjects, args.text_n = 1, 8, 4, 2, 8
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        from llm_calib.models import default_cache_dir, load

        model_dir = default_cache_dir(args.model)
        if not (model_dir / "model.safetensors").is_file():
            load(args.model)  # converts the GGUF into the cache directory once
    model_dir = model_dir.resolve()  # the children run in the work folder
    work = Path(tempfile.mkdtemp(prefix="lm_eval_speed_"))
    shapes = build_tasks(work, args.data_root, args.zero_shot_n, list(SUBJECTS[: args.subjects]), args.per_subject,
                          args.text_n)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", HF_DATASETS_CACHE=str(work / "hf_datasets"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if args.scoring_only:
        path = args.out.with_suffix(".json")
        saved = json.loads(path.read_text()) if path.is_file() else {}
        saved["scoring_only"] = {
            "machine": machine_info(libraries=("torch", "transformers")), "batch_size": args.batch_size,
            "command": "python benchmarks/lm_eval_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "shapes": scoring_only({n: shapes[n]["task"] for n in args.shapes.split(",")}, work, model_dir,
                                   args.batch_size, args.rounds)}
        if not args.quick:
            path.write_text(json.dumps(saved, indent=2) + "\n")
        return 0
    if args.prefix_stats_only:
        path = args.out.with_suffix(".json")
        saved = json.loads(path.read_text())
        for name, entry in saved["shapes"].items():
            entry["prefix_cache"] = prefix_cache_stats(shapes[name]["task"], work, model_dir, saved["batch_size"])
            print(name, entry["prefix_cache"])
        path.write_text(json.dumps(saved, indent=2) + "\n")
        return 0
    sides = ["lm_eval", "llm_calib"] + (["llm_calib_base"] if args.baseline_tree is not None else [])
    envs = {"lm_eval": env, "llm_calib": env}
    if args.baseline_tree is not None:
        base = args.baseline_tree.resolve()
        if not (base / "llm_calib" / "__init__.py").is_file():
            raise SystemExit(f"--baseline-tree {base}: not an llm-calib source tree (no llm_calib/__init__.py)")
        envs["llm_calib_base"] = dict(env, PYTHONPATH=os.pathsep.join(
            [str(base), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(libraries=("torch", "transformers", "lm_eval")),
        "child_threads": os.environ.get("OMP_NUM_THREADS", "torch default"), "model": str(args.model),
        "batch_size": args.batch_size, "rounds": args.rounds, "baseline_tree": str(args.baseline_tree or ""),
        "command": "python benchmarks/lm_eval_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "shapes": {},
    }
    for name in args.shapes.split(","):
        shape = shapes[name]
        rows: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = sides[r % len(sides):] + sides[: r % len(sides)]
            times: dict[str, dict] = {}
            for side in order:
                out = work / f"{name}_{side}_{r}"
                if side == "lm_eval":
                    times[side] = run_lm_eval(shape["task"], work, model_dir, args.batch_size, out, envs[side])
                else:
                    times[side] = run_llm_calib(shape["task"], work, model_dir, args.batch_size, out, envs[side], [])
                print(f"{name} round {r + 1} {side}: {times[side]['wall_s']:.1f} s wall, "
                      f"{times[side]['cpu_s']:.1f} s CPU", flush=True)
            ours = llm_calib_loglik(work / f"{name}_llm_calib_{r}")
            row = {"round": r + 1, "order": list(order), **{f"{s}_{k}": v for s in times for k, v in times[s].items()},
                   "wall_ratio": times["lm_eval"]["wall_s"] / times["llm_calib"]["wall_s"],
                   "cpu_ratio": times["lm_eval"]["cpu_s"] / times["llm_calib"]["cpu_s"],
                   **compare(lm_eval_loglik(work / f"{name}_lm_eval_{r}"), ours)}
            if "llm_calib_base" in times:
                before = compare(llm_calib_loglik(work / f"{name}_llm_calib_base_{r}"), ours)
                row |= {"base_wall_ratio": times["llm_calib_base"]["wall_s"] / times["llm_calib"]["wall_s"],
                        "base_cpu_ratio": times["llm_calib_base"]["cpu_s"] / times["llm_calib"]["cpu_s"],
                        "base_lm_eval_cpu_ratio": times["lm_eval"]["cpu_s"] / times["llm_calib_base"]["cpu_s"],
                        "base_max_abs_dll": before["max_abs_dll"], "base_argmax_agree": before["argmax_agree"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            means = {f"{k}_mean": float(np.mean([x[k] for x in rows])) for k in
                     ("wall_ratio", "cpu_ratio", "base_wall_ratio", "base_cpu_ratio", "base_lm_eval_cpu_ratio")
                     if k in row}
            result["shapes"][name] = {**shape, "rows": rows, **means}
            if not args.quick:  # written after every round, so a cut-short run keeps what it measured
                args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: {m: v[m] for m in v if m.endswith("_mean")} for k, v in result["shapes"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
