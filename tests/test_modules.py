"""nn.Module bridges: parameter selection, functional calls, write-back."""

from __future__ import annotations

import pytest
import torch

import hypergrad as hg


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def test_selection_modes():
    net = _net()
    assert sorted(hg.module_params(net)) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert sorted(hg.module_params(net, trainable=["*.bias"])) == ["0.bias", "2.bias"]
    assert sorted(hg.module_params(net, trainable=lambda n, p: p.dim() == 2)) == ["0.weight", "2.weight"]
    net[0].weight.requires_grad_(False)
    assert "0.weight" not in hg.module_params(net)
    with pytest.raises(ValueError, match="selects no parameter"):
        hg.module_params(net, trainable="nothing.*")


def test_params_are_detached_copies():
    net = _net()
    w = hg.module_params(net)
    w["2.bias"].add_(1.0)
    assert not torch.equal(w["2.bias"], net[2].bias)
    assert not w["2.bias"].requires_grad


def test_functional_call_with_subset_matches_module_and_is_differentiable():
    net = _net()
    x = torch.randn(5, 3)
    call = hg.functional(net)
    w = hg.module_params(net, trainable="2.*")
    assert torch.allclose(call(w, x), net(x))
    w2 = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    call(w2, x).sum().backward()
    assert w2["2.weight"].grad is not None and w2["2.weight"].grad.abs().sum() > 0
    with pytest.raises(ValueError, match="not parameters"):
        call({"9.weight": torch.zeros(1)}, x)


def test_load_params_writes_back_and_validates():
    net = _net()
    hg.load_params(net, {"2.bias": torch.tensor([1.0, -1.0])})
    assert net[2].bias.tolist() == [1.0, -1.0]
    with pytest.raises(ValueError, match="shape"):
        hg.load_params(net, {"2.bias": torch.zeros(3)})
    with pytest.raises(ValueError, match="not a parameter"):
        hg.load_params(net, {"nope": torch.zeros(3)})
