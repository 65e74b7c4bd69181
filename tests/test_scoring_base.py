"""ScoredSet bookkeeping: probabilities, splitting, temperature, concatenation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llm_calib.metrics.temperature import apply_temperature
from llm_calib.scoring import ScoredSet


def _set() -> ScoredSet:
    return ScoredSet(
        [torch.tensor([0.0, 2.0]), torch.tensor([3.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 5.0])],
        [1, 1, 2],
        ["a", "b", "a"],
        ["x", "y", "z"],
        "toy",
    )


def test_predictions_confidence_accuracy():
    s = _set()
    assert s.predictions.tolist() == [1, 0, 2]
    assert s.correct.tolist() == [True, False, True]
    assert s.accuracy == pytest.approx(2 / 3)
    assert s.confidences[0] == pytest.approx(1 / (1 + np.exp(-2.0)))


def test_by_domain_keeps_order_and_rows():
    parts = _set().by_domain()
    assert list(parts) == ["a", "b"]
    assert parts["a"].ids == ["x", "z"] and parts["a"].labels == [1, 2]


def test_scaled_matches_apply_temperature():
    s = _set()
    scaled = s.scaled(2.5)
    for p, q in zip(scaled.probs_numpy, apply_temperature(s.logits, 2.5), strict=True):
        np.testing.assert_allclose(p, q.numpy(), atol=1e-6)
    assert scaled.predictions.tolist() == s.predictions.tolist()
    with pytest.raises(ValueError, match="temperature"):
        s.scaled(0.0)


def test_concat_and_length_checks():
    s = _set()
    both = ScoredSet.concat([s, s])
    assert len(both) == 6 and both.ids[3:] == s.ids
    with pytest.raises(ValueError, match="same length"):
        ScoredSet([torch.zeros(2)], [0, 1], ["a"], ["x"])
    with pytest.raises(ValueError, match="at least one"):
        ScoredSet.concat([])
