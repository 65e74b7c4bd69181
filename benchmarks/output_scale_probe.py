"""How a token-level temperature moves option-level confidence (evidence for calibration.md).

CALM's output scale multiplies the final norm's weight by ``exp(s)``: every next-token
distribution gets temperature ``exp(-s)``. Post-hoc temperature scaling instead divides the
*option* scores. This probe scores ARC-Easy dev questions with the final norm scaled by
``exp(s)`` for a few ``s`` and reports accuracy, mean confidence and conf-ECE, for summed and
mean-per-token option scores. No training; the model is restored after each setting.

Run::

    python benchmarks/output_scale_probe.py --data-dir ../shared/data --n 150
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from harness.report import machine_info, machine_line

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    from llm_calib.data import load
    from llm_calib.metrics.calibration import ece
    from llm_calib.models import load as load_model
    from llm_calib.scoring.option_likelihood import score_option_likelihood

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--n", type=int, default=150, help="ARC-Easy dev questions (the first n)")
    p.add_argument("--log-scales", default="0,-0.5,-1,-1.66", help="comma-separated s (temperature exp(-s))")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "output_scale_probe.md")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    start = time.time()
    model, tok = load_model("smollm2-135m-instruct")
    model.eval()
    records = load(f"arc_easy:{args.data_dir}:dev").records[: args.n]
    norm = model.model.norm
    w0 = norm.weight.detach().clone()
    rows = []
    for normalize in ("sum", "mean"):
        for s in (float(x) for x in args.log_scales.split(",")):
            with torch.no_grad():
                norm.weight.copy_(w0 * float(np.exp(s)))
            scored = score_option_likelihood(model, tok, records, normalize=normalize)
            probs = [torch.softmax(x.double(), 0).numpy() for x in scored.logits]
            conf = np.array([q.max() for q in probs])
            correct = np.array([float(q.argmax() == y) for q, y in zip(probs, scored.labels, strict=True)])
            rows.append((normalize, s, correct.mean(), conf.mean(), ece(conf, correct)))
            print(*rows[-1], flush=True)
    with torch.no_grad():
        norm.weight.copy_(w0)
    lines = [
        "# Output scale probe: token-level temperature vs option-level confidence",
        "",
        f"- Command: `python benchmarks/output_scale_probe.py --n {args.n} --log-scales {args.log_scales}`",
        machine_line(machine_info(), f"torch {torch.__version__}; date {time.strftime('%Y-%m-%d %H:%M')}; "
                     f"{time.time() - start:.0f} s"),
        f"- Data: the first {len(records)} ARC-Easy dev questions (the pool the calibration benchmark draws its held-out inputs from); "
        "SmolLM2-135M-Instruct, cloze prompt, softmax over option scores.",
        "",
        "| option score | log-scale s | token temperature | accuracy | mean confidence | conf-ECE |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {n} | {s:+.2f} | {np.exp(-s):.2f} | {a:.3f} | {c:.3f} | {e:.3f} |" for n, s, a, c, e in rows]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
