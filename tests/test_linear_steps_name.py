"""AmIGO and StocBiO name the linear-solve step count (and its step size) alike: ``linear_steps``
and ``linear_step_size``; StocBiO's former names still work, with a DeprecationWarning."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import hypergrad as hg

g = lambda w, lam, b: 0.5 * ((2.0 * w["x"] - lam["c"]) ** 2).sum()  # noqa: E731
f = lambda w, lam, b: 0.5 * ((w["x"] - 1.0) ** 2).sum()  # noqa: E731
W = {"x": torch.zeros(3, dtype=torch.float64)}
LAM = {"c": torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)}


def test_amigo_and_stocbio_share_the_names() -> None:
    for cls in (hg.AmIGO, hg.StocBiO):
        names = {field.name for field in dataclasses.fields(cls)}
        assert {"linear_steps", "linear_step_size"} <= names, cls.__name__
        assert not names & {"neumann_steps", "neumann_step_size"}, cls.__name__


def test_stocbio_old_names_warn_and_mean_the_same() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names: no warning
        new = hg.StocBiO(0.2, inner_steps=2, linear_steps=4, linear_step_size=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = hg.StocBiO(0.2, inner_steps=2, neumann_steps=4, neumann_step_size=0.1)
    assert [(w.category, str(w.message)) for w in caught] == [
        (DeprecationWarning, "StocBiO(neumann_steps=...) is deprecated; use linear_steps=... (same meaning)"),
        (DeprecationWarning, "StocBiO(neumann_step_size=...) is deprecated; use linear_step_size=... (same meaning)"),
    ]
    assert all(w.filename == __file__ for w in caught)  # points at the caller
    assert old == new
    problem = hg.BilevelProblem(g, f)
    a, b = new.hypergrad(problem, W, LAM), old.hypergrad(problem, W, LAM)
    assert torch.equal(a.grad["c"], b.grad["c"]) and a.info.extra["oracle_calls"]["hvp"] == 4
    with pytest.warns(DeprecationWarning, match="use linear_steps"):
        assert old.neumann_steps == 4
    with pytest.warns(DeprecationWarning, match="use linear_step_size"):
        assert old.neumann_step_size == 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # replace() (the compiled path's eager fallback) passes the new names
        assert dataclasses.replace(new, compile=True).linear_steps == 4


def test_stocbio_old_and_new_name_together_is_an_error() -> None:
    with pytest.raises(TypeError, match="StocBiO: pass linear_steps only"):
        hg.StocBiO(0.2, linear_steps=3, neumann_steps=3)
    with pytest.raises(ValueError, match="linear_steps must be >= 0"):
        hg.StocBiO(0.2, linear_steps=-1)
