"""What a single global temperature can do in and out of domain on the regimes benchmark's data.

CALM's deployed model, like temperature scaling, is chosen on in-domain data. This scan scores the
base model once and, for every temperature T on a grid, reports in-domain (ARC-Easy test) and
out-of-domain (mean over the OOD sets) conf-ECE and mean confidence. It shows where the
NLL-fitted temperature (what temperature scaling picks), the ECE-optimal in-domain temperature and
each per-domain oracle temperature lie, i.e. whether *any* uniformly softened model that is
calibrated in domain can be calibrated out of domain.

Run::

    python benchmarks/temperature_frontier.py --out benchmarks/results/temperature_frontier.md
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from calm_regimes import OOD, real_data
from harness.report import machine_info, machine_line

ROOT = Path(__file__).resolve().parents[1]
GRID = np.exp(np.linspace(np.log(0.5), np.log(40.0), 120))


def ece_at(scored, temperature: float) -> tuple[float, float, float]:
    from llm_calib.metrics.calibration import summarize

    probs = [(s / temperature).softmax(-1).numpy() for s in scored.logits]
    m = summarize(probs, list(scored.labels), ci=False)
    return m["ece"], m["mean_confidence"], m["accuracy"]


def main() -> None:
    from harness.evaluation import score_records

    from llm_calib.metrics.temperature import fit_temperature
    from llm_calib.models import load as load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--n-train", type=int, default=400)
    p.add_argument("--n-select", type=int, default=150)
    p.add_argument("--n-unlabeled", type=int, default=300)
    p.add_argument("--n-unlabeled-per-set", type=int, default=60)
    p.add_argument("--n-eval", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--normalize", default="sum", choices=("sum", "mean"), help="option-score aggregation")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "temperature_frontier.md")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    data = real_data(args)
    model, tok = load_model("smollm2-135m-instruct")
    select = score_records(model, tok, data["select"], normalize=args.normalize)
    sets = {name: score_records(model, tok, recs, normalize=args.normalize) for name, recs in data["evals"]}
    in_domain = data["evals"][0][0]
    ood = [n for n in sets if n in OOD]
    t_nll = fit_temperature(select.logits, select.labels)
    sel_ece = [ece_at(select, t)[0] for t in GRID]
    t_ece = float(GRID[int(np.argmin(sel_ece))])

    def row(label: str, t: float) -> str:
        e_in, c_in, a_in = ece_at(sets[in_domain], t)
        per = [ece_at(sets[n], t) for n in ood]
        e_ood = float(np.mean([x[0] for x in per]))
        c_ood = float(np.mean([x[1] for x in per]))
        a_ood = float(np.mean([x[2] for x in per]))
        return (f"| {label} | {t:.2f} | {ece_at(select, t)[0]:.3f} | {a_in:.3f} / {c_in:.3f} / {e_in:.3f} | "
                f"{a_ood:.3f} / {c_ood:.3f} / {e_ood:.3f} |")

    ts_ood = float(np.mean([ece_at(sets[n], t_nll)[0] for n in ood]))
    lines = [
        "# One global temperature: in domain against out of domain (SmolLM2-135M-Instruct)",
        "",
        f"- Command: `python benchmarks/temperature_frontier.py --normalize {args.normalize}` ({time.perf_counter() - t0:.0f} s)",
        machine_line(machine_info(args.threads), f"torch {torch.__version__}; date {time.strftime('%Y-%m-%d %H:%M')}"),
        f"- Data as `benchmarks/calm_regimes.py`: selection = {len(data['select'])} ARC-Easy dev questions; "
        f"in domain = {in_domain} test ({len(data['evals'][0][1])}); OOD = {', '.join(ood)} "
        f"({args.n_eval} each). Cloze prompts, option log-likelihoods aggregated by `{args.normalize}`.",
        "",
        "| temperature | T | selection ECE | in-domain acc / conf / ECE | OOD mean acc / conf / ECE |",
        "|---|---|---|---|---|",
        row("1 (uncalibrated)", 1.0),
        row("NLL fit on selection (temperature scaling)", t_nll),
        row("ECE-optimal on selection", t_ece),
    ]
    target = 0.8 * ts_ood
    grid_rows = []
    for t in GRID:
        e_in = ece_at(sets[in_domain], t)[0]
        e_ood = float(np.mean([ece_at(sets[n], t)[0] for n in ood]))
        grid_rows.append((float(t), e_in, e_ood))
    both = [g for g in grid_rows if g[2] <= target and g[1] <= ece_at(sets[in_domain], t_nll)[0] + 0.01]
    for n in ood:
        e = [ece_at(sets[n], t)[0] for t in GRID]
        lines.append(row(f"oracle for {n} (ECE-optimal on its test set)", float(GRID[int(np.argmin(e))])))
    best_ood = min(grid_rows, key=lambda g: g[2])
    lines.append(row("oracle for the OOD mean", best_ood[0]))
    lines += [
        "",
        f"- Carried-over temperature scaling: OOD mean ECE {ts_ood:.3f}; the CALM issue's regime-A target is "
        f"≤ 0.8 × that = {target:.3f}, with in-domain ECE ≤ {ece_at(sets[in_domain], t_nll)[0] + 0.01:.3f}.",
        f"- Temperatures on the grid ({GRID[0]:.2f}-{GRID[-1]:.1f}, {len(GRID)} points) meeting both: "
        + (f"T = {both[0][0]:.2f} to {both[-1][0]:.2f}" if both else "none"),
        "",
        "## Scan (every 8th grid point)",
        "",
        "| T | in-domain ECE | OOD mean ECE |",
        "|---|---|---|",
        *[f"| {t:.2f} | {a:.3f} | {b:.3f} |" for t, a, b in grid_rows[::8]],
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
