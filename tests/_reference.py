"""Independent reference computations for end-to-end tests of the evaluation pipeline.

The pipeline packs many options into one forward pass and computes metrics with vectorised
numpy; these references run one plain forward pass per option and compute each metric with a
loop over questions, in float64. Agreement checks the pipeline, not its reuse of itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from llm_calib.data.records import MultipleChoice
from llm_calib.metrics.temperature import T_MAX, T_MIN
from llm_calib.prompts.templates import PromptFormat
from llm_calib.scoring.option_likelihood import encode_questions

NLL_FLOOR = 1e-12  # llm_calib.metrics.calibration.NLL_EPS, the documented floor of p(gold) in the NLL

# Packed and per-option forward passes differ by float32 rounding: |Δ log p| < 1e-5 per option
# (tests/test_scoring_option_likelihood.py). Metrics of such probabilities agree to ~1e-5; ECE and
# accuracy are discontinuous and are only compared where no confidence lies near a bin edge and no
# two option scores are near a tie (``summary``).
TOL = 1e-5


def option_log_likelihoods(
    model: Any, tokenizer: Any, records: Sequence[MultipleChoice], prompt: PromptFormat
) -> list[np.ndarray]:
    """Summed log-probability of each option: one forward pass of ``prompt + option`` per option."""
    out = []
    for enc in encode_questions(tokenizer, records, prompt):
        scores = []
        for option in enc.options:
            ids = torch.tensor([[*enc.prompt, *option]])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
            start = len(enc.prompt) - 1  # position predicting the first option token
            scores.append(sum(float(logp[start + j, t]) for j, t in enumerate(option)))
        out.append(np.asarray(scores))
    return out


def softmax(scores: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    z = np.asarray(scores, dtype=np.float64) / temperature
    e = np.exp(z - z.max())
    return e / e.sum()


def summary(
    scores: Sequence[np.ndarray], labels: Sequence[int], temperature: float = 1.0, n_bins: int = 10
) -> dict[str, float]:
    """accuracy, ECE (bins [k/B, (k+1)/B), the last closed), NLL and Brier of ``softmax(scores / T)``,
    one question at a time. The ECE is NaN (not comparable) when a confidence lies within TOL of an
    inner bin edge; a near-tie of the two best option scores is an error (accuracy not comparable)."""
    n = len(scores)
    conf, correct, nll, brier = [], [], 0.0, 0.0
    for z, y in zip(scores, labels, strict=True):
        order = sorted(range(len(z)), key=lambda j: -z[j])
        assert len(z) < 2 or z[order[0]] - z[order[1]] > TOL, "near-tie: accuracy is not comparable"
        p = softmax(z, temperature)
        top = order[0]
        conf.append(float(p[top]))
        correct.append(1.0 if top == y else 0.0)
        nll -= math.log(max(float(p[y]), NLL_FLOOR))
        brier += sum((float(p[j]) - (1.0 if j == y else 0.0)) ** 2 for j in range(len(p)))
    gap = 0.0
    for b in range(n_bins):
        members = [i for i, c in enumerate(conf) if b / n_bins <= c < (b + 1) / n_bins or (b == n_bins - 1 and c == 1.0)]
        if members:
            acc = sum(correct[i] for i in members) / len(members)
            avg = sum(conf[i] for i in members) / len(members)
            gap += len(members) * abs(acc - avg)
    near_edge = any(abs(c - k / n_bins) <= TOL for c in conf for k in range(1, n_bins))
    return {"n": n, "accuracy": sum(correct) / n, "ece": math.nan if near_edge else gap / n,
            "nll": nll / n, "brier": brier / n}


def assert_matches(got: dict[str, float], expected: dict[str, float], keys: Sequence[str], what: Any = "") -> None:
    """``got[key]`` equals ``expected[key]`` within TOL; a NaN (incomparable) expected ECE is skipped."""
    for key in keys:
        if key == "ece" and math.isnan(expected[key]):
            continue
        assert abs(got[key] - expected[key]) <= TOL, (what, key, got[key], expected[key])


def nll_at(scores: Sequence[np.ndarray], labels: Sequence[int], temperature: float) -> float:
    """Mean NLL of the gold options after dividing the scores by ``temperature``."""
    return -sum(math.log(softmax(s, temperature)[y]) for s, y in zip(scores, labels, strict=True)) / len(labels)


def assert_minimises_nll(scores: Sequence[np.ndarray], labels: Sequence[int], temperature: float) -> None:
    """``temperature`` minimises the NLL over [T_MIN, T_MAX]: 1% either side (inside) is worse."""
    best = nll_at(scores, labels, temperature)
    assert T_MIN <= temperature <= T_MAX
    for factor in (0.99, 1.01):
        if T_MIN <= temperature * factor <= T_MAX:
            assert nll_at(scores, labels, temperature * factor) > best, (temperature, factor)
