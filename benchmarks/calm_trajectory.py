"""Per-step trajectory of one calibration run on the regimes benchmark's data.

Trains one method (a JSON object of :class:`CalibrationConfig` fields over
``benchmarks/calm_regimes.yaml``) on the data of ``benchmarks/calm_regimes.py`` and prints one JSON
line per step: the training losses, the unlabelled-batch entropy, the output scale, λ and the
held-out metrics at evaluation steps, then the selected step. It is the evidence behind the
"Limits measured on a small model" section of the CALM docs.

Run::

    python benchmarks/calm_trajectory.py '{"method": "confidence_penalty", "lr": 0.005, "output_scale_lr": 0.1, "penalty_beta": 5.0, "steps": 40, "eval_every": 10}' B
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from calm_regimes import one_setting, one_setting_parser

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("step", "loss", "ce", "g", "unlabeled_entropy", "output_log_scale", "phi", "heldout_accuracy", "heldout_ece",
        "heldout_confidence")


def main() -> None:
    from llm_calib.calm.trainer import calibrate
    from llm_calib.models import load as load_model

    args = one_setting_parser(__doc__.splitlines()[0]).parse_args()
    data, cfg = one_setting(args)
    model, tok = load_model("smollm2-135m-instruct")
    t0 = time.perf_counter()
    res = calibrate(model, tok, data["train"], data["select"], cfg, unlabeled=data["unlabeled"][args.regime],
                    progress=False)
    for h in res.history:
        print(json.dumps({k: round(h[k], 4) if isinstance(h[k], float) else h[k] for k in KEYS if k in h}))
    print(json.dumps({"seconds": round(time.perf_counter() - t0), "after": res.metrics["after"]}))


if __name__ == "__main__":
    main()
