"""Input validation of the problem and the pytree helpers."""

from __future__ import annotations

import pytest
import torch

import hypergrad as hg
from hypergrad.tree import check_like, tree_flatten, tree_unflatten

g_ok = lambda w, lam, b: (w["x"] * lam["c"]).sum()  # noqa: E731


def test_non_callable_losses_are_rejected():
    with pytest.raises(TypeError, match="inner"):
        hg.BilevelProblem(inner=3, outer=g_ok)
    with pytest.raises(TypeError, match="outer"):
        hg.BilevelProblem(inner=g_ok, outer="f")


def test_non_scalar_loss_is_rejected_naming_it():
    bad = hg.BilevelProblem(inner=lambda w, lam, b: w["x"] * 2, outer=g_ok)
    with pytest.raises(ValueError, match="inner loss"):
        hg.Implicit().hypergrad(bad, {"x": torch.ones(3)}, {"c": torch.ones(3)})


def test_integer_loss_is_rejected():
    bad = hg.BilevelProblem(inner=g_ok, outer=lambda w, lam, b: torch.tensor(3))
    with pytest.raises(TypeError, match="outer loss"):
        hg.Implicit().hypergrad(bad, {"x": torch.ones(3)}, {"c": torch.ones(3)})


@pytest.mark.parametrize(
    ("w", "lam", "exc", "name"),
    [
        ([torch.ones(2)], {"c": torch.ones(2)}, TypeError, "w must be a dict"),
        ({"x": torch.ones(2, dtype=torch.int64)}, {"c": torch.ones(2)}, TypeError, r"w\['x'\] must have a floating"),
        ({"x": torch.ones(2)}, {}, ValueError, "lam must contain"),
        ({"x": torch.ones(2)}, {"c": [1.0, 2.0]}, TypeError, r"lam\['c'\] must be a torch.Tensor"),
        ({1: torch.ones(2)}, {"c": torch.ones(2)}, TypeError, "keys must be str"),
    ],
)
def test_bad_pytrees_raise_naming_the_argument(w, lam, exc, name):
    with pytest.raises(exc, match=name):
        hg.Implicit().hypergrad(hg.BilevelProblem(g_ok, g_ok), w, lam)


def test_check_like_names_missing_keys_and_shapes():
    with pytest.raises(ValueError, match="missing"):
        check_like({"a": torch.ones(2)}, {"a": torch.ones(2), "b": torch.ones(1)}, "state", "w")
    with pytest.raises(ValueError, match=r"state\['a'\] has shape \(3,\)"):
        check_like({"a": torch.ones(3)}, {"a": torch.ones(2)}, "state", "w")


def test_flatten_roundtrip():
    tree = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([7.0])}
    flat = tree_flatten(tree)
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 7]
    back = tree_unflatten(flat, tree)
    assert all(torch.equal(back[k], tree[k]) for k in tree)


def test_nan_in_inner_loss_raises():
    nan = hg.BilevelProblem(inner=lambda w, lam, b: (w["x"] * lam["c"]).sum() * float("nan"), outer=g_ok)
    with pytest.raises(hg.NonFiniteError):
        hg.Implicit().hypergrad(nan, {"x": torch.ones(2)}, {"c": torch.ones(2)})
