"""CALM against its baselines in the two regimes of unlabelled upper-level inputs (one seed).

* Regime A: the unlabelled inputs come from the training domain (ARC dev questions disjoint from
  the selection split): the paper's setting.
* Regime B: the unlabelled inputs are prompts of the target domains, disjoint from every test
  question: a user calibrating for their deployment traffic.

Both train on ARC (Easy + Challenge train), select on ARC-Easy dev (labelled, used for model
selection and the accuracy guard only) and test on ARC-Easy test (in domain) and several
out-of-domain sets. Every trained method gets the same data, budget and seed; temperature
scaling is fitted on the selection split and carried to every set. Uses only the public API
(``llm_calib.evaluation.compare.run_comparison``).

Run::

    python benchmarks/calm_regimes.py --data-dir ../shared/data
    python benchmarks/calm_regimes.py --quick      # tiny random model on built-in data, seconds
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from harness.report import machine_info, machine_line

ROOT = Path(__file__).resolve().parents[1]
OOD = ("openbookqa", "qasc", "commonsenseqa", "mmlu_humanities", "mmlu_stem")


def specs(d: Path) -> dict[str, str]:
    return {
        "arc_easy": f"arc_easy:{d}:test", "openbookqa": f"openbookqa:{d}", "qasc": f"qasc:{d}:dev",
        "commonsenseqa": f"commonsenseqa:{d}:dev", "mmlu_humanities": f"mmlu_humanities:{d}:test",
        "mmlu_stem": f"mmlu_stem:{d}:test",
    }


def real_data(args: argparse.Namespace) -> dict:
    from llm_calib.data import load

    d = args.data_dir
    train = load(f"arc_easy:{d}:train", limit=args.n_train // 2).records + load(
        f"arc_challenge:{d}:train", limit=args.n_train - args.n_train // 2).records
    dev = load(f"arc_easy:{d}:dev").records
    select, pool_a = dev[: args.n_select], dev[args.n_select :] + load(f"arc_challenge:{d}:dev").records
    evals, pool_b = [], []
    for name, spec in specs(d).items():
        records = load(spec, limit=args.n_eval + (args.n_unlabeled_per_set if name in OOD else 0), seed=1).records
        evals.append((name, records[: args.n_eval]))
        if name in OOD:  # the rest of the same seeded sample: disjoint from the test questions
            pool_b += records[args.n_eval :]
    return {"train": train, "select": select, "evals": evals,
            "unlabeled": {"A": pool_a[: args.n_unlabeled], "B": pool_b}}


def one_setting_parser(description: str) -> argparse.ArgumentParser:
    """Arguments of the scripts that study one setting on this benchmark's data: the setting (JSON
    object of flat CalibrationConfig fields, see ``harness.flat_config``, over ``--config``), the regime,
    data folder and threads."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("setting", help="JSON object of flat CalibrationConfig fields (harness.flat_config)")
    p.add_argument("regime", choices=("A", "B"))
    p.add_argument("--config", type=Path, default=ROOT / "benchmarks" / "calm_regimes.yaml")
    p.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--threads", type=int, default=1)
    return p


def one_setting(args: argparse.Namespace, **overrides) -> tuple[dict, object]:
    """The data (default sizes of this benchmark) and the config of a :func:`one_setting_parser` run."""
    from harness.flat_config import with_flat

    from llm_calib.config.calibration import CalibrationConfig

    torch.set_num_threads(args.threads)
    sizes = argparse.Namespace(data_dir=args.data_dir, n_train=400, n_select=150, n_unlabeled=300,
                               n_unlabeled_per_set=60, n_eval=100)
    cfg = with_flat(CalibrationConfig.from_file(args.config), **json.loads(args.setting), **overrides)
    return real_data(sizes), cfg


def quick_data() -> dict:
    from llm_calib.data import builtin_multiple_choice

    qs = builtin_multiple_choice(n_per_domain=12, domains=["capitals", "arithmetic", "chemical_symbols"])
    cap, ari, chem = qs[:12], qs[12:24], qs[24:]
    return {"train": cap[:6] + ari[:6], "select": cap[6:9] + ari[6:9], "evals": [("capitals", cap[9:]), ("chemical_symbols", chem[:6])],
            "unlabeled": {"A": cap[9:] + ari[9:], "B": chem[6:]}}


def summary_table(summary: dict, in_domain: str) -> list[str]:
    """Per regime and column: in-domain accuracy / ECE, out-of-domain mean accuracy / ECE, and the
    share of out-of-domain sets where the column's ECE is below carried-over temperature scaling."""
    lines = ["| regime | column | in-domain acc | in-domain ECE | OOD mean acc | OOD mean ECE | OOD sets below TS |",
             "|---|---|---|---|---|---|---|"]
    for regime, m in summary.items():
        domains = m["domains"]
        ood = [d for d in domains if d != in_domain and domains[d]["kind"] == "multiple_choice"]
        for col in m["columns"]:
            cells = [domains[d]["columns"][col] for d in ood]
            below = sum(c["ece"] < domains[d]["columns"]["temperature_scaled"]["ece"] for c, d in zip(cells, ood, strict=True))
            ind = domains.get(in_domain, {}).get("columns", {}).get(col, {})
            lines.append(
                f"| {regime} | {col} | {ind.get('accuracy', float('nan')):.3f} | {ind.get('ece', float('nan')):.3f} | "
                f"{sum(c['accuracy'] for c in cells) / len(cells):.3f} | {sum(c['ece'] for c in cells) / len(cells):.3f} | "
                f"{below}/{len(cells)} |")
    return lines


def main() -> None:
    from harness.flat_config import with_flat

    from llm_calib.calm.run import resolve_run
    from llm_calib.config.calibration import CalibrationConfig
    from llm_calib.evaluation.compare import run_comparison, write_comparison_report
    from llm_calib.models import load as load_model
    from llm_calib.models import tiny_random_model
    from llm_calib.objectives.registry import objective_from_dict

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--quick", action="store_true", help="tiny random model, built-in data (a smoke test)")
    p.add_argument("--regimes", default="A,B")
    p.add_argument("--methods", default="calm,confidence_penalty")
    p.add_argument("--config", type=Path, default=None, help="YAML/JSON CalibrationConfig (its objective: the settings of that method)")
    p.add_argument("--n-train", type=int, default=400)
    p.add_argument("--n-select", type=int, default=150)
    p.add_argument("--n-unlabeled", type=int, default=300, help="regime A: unlabelled ARC dev questions")
    p.add_argument("--n-unlabeled-per-set", type=int, default=60, help="regime B: unlabelled prompts per OOD set")
    p.add_argument("--n-eval", type=int, default=100, help="test questions per set")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    start = time.time()
    config = CalibrationConfig.from_file(args.config) if args.config else CalibrationConfig()
    if args.quick:
        data = quick_data()
        config = with_flat(config, steps=4, batch_size=2, heldout_batch_size=2, eval_every=2)
        tok = tiny_random_model()[1]

        def fresh():
            return tiny_random_model()[0]
    else:
        data = real_data(args)
        tok = load_model("smollm2-135m-instruct")[1]

        def fresh():
            return load_model("smollm2-135m-instruct")[0]
    out = args.out or (Path("/tmp/calm_regimes_quick") if args.quick else ROOT / "benchmarks" / "results" / "calm_regimes")
    summary = {}
    given = {config.objective.name: config.objective}  # the config's objective keeps its settings
    methods = [given.get(name) or objective_from_dict(name) for name in args.methods.split(",")]
    for regime in args.regimes.split(","):
        run = resolve_run(config, data["train"], data["select"], data["unlabeled"][regime])
        cmp = run_comparison(fresh, tok, ("arc", data["train"]), ("arc_easy_dev", data["select"]), data["evals"], run,
                             methods, out / regime, unlabeled=(f"regime_{regime}", data["unlabeled"][regime]),
                             checkpoints=False, progress=False, bootstrap=0 if args.quick else 1000, log=print)
        write_comparison_report(cmp, out / regime)
        summary[regime] = json.loads((out / regime / "metrics.json").read_text())
    lines = [
        "# CALM: regimes A (unlabelled inputs from the training domain) and B (from the target domains)",
        "",
        f"- Command: `python benchmarks/calm_regimes.py {' '.join(f'--{k.replace(chr(95), chr(45))} {v}' for k, v in vars(args).items() if k not in ('out', 'data_dir', 'quick') and v is not None)}{' --quick' if args.quick else ''}`",
        machine_line(machine_info(), f"torch {torch.__version__}; date {time.strftime('%Y-%m-%d %H:%M')}; "
                     f"{time.time() - start:.0f} s wall"),
        f"- Config: `{json.dumps(config.to_dict())}`",
        f"- Data: train {len(data['train'])}, selection {len(data['select'])}, unlabelled A {len(data['unlabeled']['A'])}, "
        f"B {len(data['unlabeled']['B'])}; test sets {', '.join(f'{n} {len(r)}' for n, r in data['evals'])}. One seed.",
        "",
        *summary_table(summary, next(n for n, _ in data["evals"])),
        "",
        "Per-regime reports (tables per domain, reliability diagrams): "
        + ", ".join(f"[`{r}/report.md`]({out.name}/{r}/report.md)" for r in summary),
    ]
    (out.parent / f"{out.name}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.parent / (out.name + '.md')}")


if __name__ == "__main__":
    main()
