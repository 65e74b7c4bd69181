#!/usr/bin/env python
"""Which out-of-domain multiple-choice sets is the model above chance on? A pilot for the
calibration benchmark's set list, scored on questions the benchmark never tests.

For every OpenTriviaQA category (and the other out-of-domain sets of ``calibration_bench.py``),
the uncalibrated model scores up to ``--n`` questions drawn from the part of the set the benchmark
does NOT use as its test sample (``split_items(full, [mc_test, rest])``: the rest), under summed
and per-character option scores. A set is above chance when the lower end of the bootstrap 95%
interval of its accuracy exceeds the mean 1/K of its questions.

Usage (from the repository root, after ``make setup``)::

    .venv/bin/python benchmarks/ood_pilot.py --out benchmarks/results/ood_pilot.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from calibration_bench import ALIAS, DEFAULT_DATA, FULL, V2_OOD, per_char
from harness.evaluation import score_records, split_items, summarize_scored
from harness.report import machine_info, markdown_table, provenance_lines

from llm_calib.data import load
from llm_calib.models import load as load_model

OTHER = {"openbookqa": "openbookqa:{D}", "qasc": "qasc:{D}:dev", "commonsenseqa": "commonsenseqa:{D}:dev",
         **{f"mmlu_{g}": f"mmlu_{g}:{{D}}:test" for g in ("stem", "humanities", "social_sciences", "other")}}
ALL_OTQA = ("animals", "brain-teasers", "celebrities", "entertainment", "for-kids", "general", "geography", "history",
            "hobbies", "humanities", "literature", "movies", "music", "newest", "people", "rated", "religion-faith",
            "science-technology", "sports", "television", "video-games", "world")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    p.add_argument("--n", type=int, default=120, help="questions per set (from the non-test part)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bootstrap", type=int, default=1000)
    p.add_argument("--out", type=Path, default=None, help="markdown report (default: print)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    D = str(args.data_dir)
    specs = {**{k: v.format(D=D) for k, v in OTHER.items()},
             **{f"otqa_{c.replace('-', '_')}": f"opentriviaqa:{D}:{c}" for c in ALL_OTQA}}
    model, tok = load_model(ALIAS, dtype="float32")
    rows = []
    for name, spec in specs.items():
        full = load(spec).records
        spare = split_items(full, [FULL.mc_test, len(full) - FULL.mc_test])[1]
        recs = split_items(spare, [min(args.n, len(spare))], seed=7)[0]
        scored = score_records(model, tok, recs, batch_size=16)
        chance = float(np.mean([1.0 / len(r.options) for r in recs]))
        cells = [name, len(recs), len(full), f"{chance:.3f}"]
        above = []
        for s in (scored, per_char(scored, recs)):
            m = summarize_scored(s, ci=True, n_resamples=args.bootstrap, seed=0)
            cells.append(f"{m['accuracy']:.3f} [{m['accuracy_ci_low']:.3f}, {m['accuracy_ci_high']:.3f}]")
            cells.append(f"{m['auroc']:.3f}" if m.get("auroc") == m.get("auroc") else "n/a")
            above.append(m["accuracy_ci_low"] > chance)
        cells += ["yes" if above[0] else "no", "yes" if above[1] else "no", "yes" if name in V2_OOD else ""]
        rows.append(cells)
        print(" | ".join(map(str, cells)), flush=True)
    elapsed = time.perf_counter() - t0
    argv = sys.argv[1:] if argv is None else argv
    command = "python benchmarks/ood_pilot.py" + ("" if not argv else " " + " ".join(argv))
    lines = ["# Out-of-domain pilot: where is the uncalibrated model above chance?", "",
             *provenance_lines(command, machine_info(torch.get_num_threads()), mode="full", elapsed_s=elapsed),
             f"- Model: `{ALIAS}` (float32), cloze prompt, option likelihood; up to {args.n} questions per set drawn "
             "from the part the calibration benchmark does not test (its test sample is the first "
             f"{FULL.mc_test} of a seeded split); bootstrap {args.bootstrap} resamples.", "",
             "A set is above chance when the lower end of the 95% interval of its accuracy exceeds chance (the mean 1/K "
             "of its questions).", "",
             *markdown_table(("set", "questions", "in set", "chance", "accuracy (sum) [95%]", "AUROC (sum)",
                              "accuracy (char) [95%]", "AUROC (char)", "above chance (sum)", "above chance (char)",
                              "in v2"), rows), ""]
    text = "\n".join(lines)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
