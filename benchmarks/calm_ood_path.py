"""Out-of-domain calibration along a training run, not only at the selected step.

Model selection sees in-domain data only; this script asks whether the run passes through a model
that is well calibrated out of domain *at any step*, i.e. whether a better selection rule could
find one, or whether the trajectory never gets there. It runs the public training loop
(:func:`llm_calib.calm.training.train_step`) of one setting on the data of
``benchmarks/calm_regimes.py`` and scores ARC-Easy test and the OOD sets every ``--every`` steps
from the cached trunk.

Run::

    python benchmarks/calm_ood_path.py '{"method": "confidence_penalty", "lr": 0.005, "output_scale_lr": 0.1}' B \
        --normalize mean --steps 120 --every 20 --out benchmarks/results/calm_ood_path.md
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from calm_regimes import OOD, one_setting, one_setting_parser
from harness.report import machine_info, machine_line

from llm_calib.calm.run import resolve_run, task_format
from llm_calib.prompts.resolution import resolve_prompt_settings

ROOT = Path(__file__).resolve().parents[1]


def domain_metrics(trainer, encodings, normalize: str) -> dict[str, dict[str, float]]:
    from llm_calib.calm.fast_eval import trunk_scores
    from llm_calib.metrics.calibration import summarize

    out = {}
    for name, enc in encodings.items():
        scores = trunk_scores(trainer.lm, enc, 8, trainer.pad_id, normalize)
        out[name] = summarize([s.softmax(-1).numpy() for s in scores], [r.gold for r in enc.records], ci=False)
    return out


def main() -> None:
    from llm_calib.calm import training
    from llm_calib.calm.encoding import encode_records
    from llm_calib.models import load as load_model

    p = one_setting_parser(__doc__.splitlines()[0])
    p.add_argument("--normalize", default="sum", choices=("sum", "mean"))
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    t0 = time.perf_counter()
    data, cfg = one_setting(args, normalize=args.normalize, steps=args.steps, eval_every=args.every)
    model, tok = load_model("smollm2-135m-instruct")
    trainer = training.build_trainer(model, tok, data["train"], data["select"], resolve_run(cfg, data["train"], data["select"], data["unlabeled"][args.regime]),
                                     unlabeled=data["unlabeled"][args.regime])
    encodings = {name: encode_records(tok, recs, task_format(recs, resolve_prompt_settings(cfg.prompt))) for name, recs in data["evals"]}
    in_domain = data["evals"][0][0]
    state = training.init_state(trainer)
    rows = []

    def record(step: int) -> None:
        held = training.evaluate(trainer, state.theta)
        per = domain_metrics(trainer, encodings, args.normalize)
        ood = [d for d in per if d in OOD]
        rows.append({"step": step, "held_acc": held["accuracy"], "held_ece": held["ece"],
                     "in_acc": per[in_domain]["accuracy"], "in_conf": per[in_domain]["mean_confidence"],
                     "in_ece": per[in_domain]["ece"],
                     "ood_acc": float(np.mean([per[d]["accuracy"] for d in ood])),
                     "ood_conf": float(np.mean([per[d]["mean_confidence"] for d in ood])),
                     "ood_ece": float(np.mean([per[d]["ece"] for d in ood]))})
        print(json.dumps(rows[-1]), flush=True)

    record(0)
    while state.step < args.steps:
        training.train_step(trainer, state)
        if state.step % args.every == 0:
            record(state.step)
    lines = [
        "# Out-of-domain calibration along one training run",
        "",
        f"- Command: `python benchmarks/calm_ood_path.py '{args.setting}' {args.regime} --normalize {args.normalize} "
        f"--steps {args.steps} --every {args.every}` ({time.perf_counter() - t0:.0f} s)",
        machine_line(machine_info(args.threads), f"torch {torch.__version__}, shared; date {time.strftime('%Y-%m-%d %H:%M')}"),
        f"- Data as `benchmarks/calm_regimes.py`, regime {args.regime}; base config `{args.config.name}`; option "
        f"scores aggregated by `{args.normalize}`. Held-out = the 150-question selection split.",
        "",
        "| step | held-out acc / ECE | ARC-Easy test acc / conf / ECE | OOD mean acc / conf / ECE |",
        "|---|---|---|---|",
        *[f"| {r['step']} | {r['held_acc']:.3f} / {r['held_ece']:.3f} | {r['in_acc']:.3f} / {r['in_conf']:.3f} / "
          f"{r['in_ece']:.3f} | {r['ood_acc']:.3f} / {r['ood_conf']:.3f} / {r['ood_ece']:.3f} |" for r in rows],
    ]
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
