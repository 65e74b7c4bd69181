"""Temperature scaling: recovery of a known temperature, agreement with a grid search, ragged
input, and the output conventions of apply_temperature."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from llm_calib.metrics.calibration import nll
from llm_calib.metrics.temperature import (
    T_MAX,
    T_MIN,
    apply_temperature,
    fit_temperature,
    temperature_nll,
)


def tempered_data(n: int, k: int, t_true: float, seed: int, scale: float = 3.0):
    """Scores z and labels drawn from softmax(z / t_true)."""
    g = torch.Generator().manual_seed(seed)
    z = scale * torch.randn(n, k, generator=g, dtype=torch.float64)
    y = torch.multinomial(torch.softmax(z / t_true, dim=1), 1, generator=g).squeeze(1)
    return z, y


@pytest.mark.parametrize("t_true", [0.5, 2.5, 6.0])
def test_recovers_a_known_temperature(t_true):
    z, y = tempered_data(20000, 5, t_true, seed=1)
    assert fit_temperature(z, y) == pytest.approx(t_true, rel=0.05)


def test_matches_brute_force_grid_minimum():
    z, y = tempered_data(3000, 4, 1.7, seed=2, scale=2.0)
    fitted = fit_temperature(z, y)
    grid = np.exp(np.linspace(math.log(0.2), math.log(20.0), 2001))  # steps of 0.23 %
    zn, yn = z.numpy(), y.numpy()
    losses = []
    for t in grid:  # plain numpy NLL of softmax(z / t), independent of the module
        s = zn / t
        s = s - s.max(axis=1, keepdims=True)
        losses.append(float(np.mean(np.log(np.exp(s).sum(axis=1)) - s[np.arange(len(yn)), yn])))
    best = grid[int(np.argmin(losses))]
    assert fitted == pytest.approx(best, rel=0.005)
    assert temperature_nll(z, y, fitted) <= min(losses) + 1e-9
    assert temperature_nll(z, y, best) == pytest.approx(min(losses), rel=1e-9)
    # the objective is the metrics' NLL of the tempered probabilities
    assert temperature_nll(z, y, fitted) == pytest.approx(
        nll(apply_temperature(z, fitted), y), rel=1e-9
    )


def test_ragged_input_equals_padded_2d_input():
    g = torch.Generator().manual_seed(3)
    counts = [2, 5, 3, 4, 5, 2] * 50
    rows = [2.5 * torch.randn(c, generator=g) for c in counts]
    labels = torch.tensor([i % c for i, c in enumerate(counts)])
    padded = torch.full((len(rows), 5), float("-inf"))
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    t_ragged = fit_temperature(rows, labels)
    assert t_ragged == pytest.approx(fit_temperature(padded, labels), rel=1e-9)
    assert t_ragged == pytest.approx(
        fit_temperature([r.numpy() for r in rows], labels.tolist()), rel=1e-6
    )
    probs = apply_temperature(rows, 1.8)
    dense = apply_temperature(padded, 1.8)
    assert isinstance(probs, list) and [len(p) for p in probs] == counts
    for i, p in enumerate(probs):
        assert isinstance(p, torch.Tensor) and p.dtype == torch.float32
        assert torch.allclose(p, dense[i, : counts[i]])
        assert torch.all(dense[i, counts[i] :] == 0)  # -inf padding gets probability exactly 0


def test_padding_with_zeros_would_be_wrong():
    """A padded slot must not take probability mass: compare with the 2-option softmax."""
    p = apply_temperature([torch.tensor([-3.0, -4.0]), torch.tensor([1.0, 0.0, -1.0])], 1.0)[0]
    assert torch.allclose(p, torch.softmax(torch.tensor([-3.0, -4.0]), 0))


def test_temperature_one_is_the_plain_softmax_and_types_follow_the_input():
    z = torch.tensor([[2.0, 1.0, 0.0], [0.5, 0.5, -1.0]])
    assert torch.allclose(apply_temperature(z, 1.0), torch.softmax(z, dim=1))
    assert apply_temperature(z, 1.0).dtype == torch.float32
    assert apply_temperature(z.double(), 1.0).dtype == torch.float64
    as_np = apply_temperature(z.numpy(), 1.0)
    assert isinstance(as_np, np.ndarray) and np.allclose(as_np, torch.softmax(z, 1).numpy())
    as_list = apply_temperature(z.tolist(), 2.0)
    assert isinstance(as_list, np.ndarray) and np.allclose(as_list, torch.softmax(z / 2, 1).numpy())
    ragged_np = apply_temperature([np.array([0.0, 0.0]), np.array([1.0, 1.0, 1.0])], 3.0)
    assert [r.tolist() for r in ragged_np] == [[0.5, 0.5], pytest.approx([1 / 3] * 3)]
    # higher temperature flattens, lower sharpens
    assert (
        apply_temperature(z, 10.0)[0].max()
        < apply_temperature(z, 1.0)[0].max()
        < apply_temperature(z, 0.1)[0].max()
    )


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "2"])
def test_temperature_must_be_positive(bad):
    with pytest.raises(ValueError, match="temperature"):
        apply_temperature(torch.zeros(1, 2), bad)
    with pytest.raises(ValueError, match="temperature"):
        temperature_nll(torch.zeros(1, 2), [0], bad)


@pytest.mark.parametrize(
    ("logits", "labels", "match"),
    [
        (torch.zeros(3), [0, 0, 0], "2-D"),
        (torch.zeros(2, 3), [0], "labels must be 1-D with 2 entries"),
        (torch.zeros(2, 3), [0, 3], r"labels\[1\] = 3"),
        (torch.tensor([[0.0, float("-inf")]]), [1], r"labels\[0\] = 1 is not an option"),
        ([torch.zeros(2), torch.zeros(3)], [2, 0], r"labels\[0\] = 2"),
        (torch.tensor([[0.0, float("nan")]]), [0], "NaN"),
        (torch.tensor([[float("-inf"), float("-inf")]]), [0], "without any finite"),
        (torch.zeros(2, 3), [0.0, 1.0], "integer"),
        (torch.zeros(0, 3), [], "empty"),
    ],
)
def test_invalid_logits_and_labels(logits, labels, match):
    with pytest.raises(ValueError, match=match):
        fit_temperature(logits, labels)


def test_degenerate_data_stays_within_bounds():
    # every answer right with a margin: the NLL keeps falling as T -> 0
    z = torch.tensor([[5.0, 0.0], [0.0, 5.0]] * 10)
    y = torch.tensor([0, 1] * 10)
    assert T_MIN <= fit_temperature(z, y) < 0.2
    # every answer wrong: the NLL keeps falling as T grows
    assert 5.0 < fit_temperature(z, 1 - y) <= T_MAX
    with pytest.raises(ValueError, match="max_iter"):
        fit_temperature(z, y, max_iter=0)
