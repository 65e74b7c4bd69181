"""LogitAdjustment: every kind's parameters, map, bounds and errors against written-out formulas."""

import pytest
import torch

from llm_calib.adjustment import ADJUSTMENT_KINDS, OPTION_KINDS, TOKEN_KINDS, LogitAdjustment

V = 6


def _random_lam(adj: LogitAdjustment, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in adj.init(torch.float64).items()}


def test_kinds_partition() -> None:
    assert set(TOKEN_KINDS) == {"vector", "temperature", "answer_tokens"}
    assert set(OPTION_KINDS) == {"option_temperature", "option_length"}
    assert ADJUSTMENT_KINDS == TOKEN_KINDS + OPTION_KINDS


@pytest.mark.parametrize(("kind", "shapes"), [
    ("vector", {"log_a": (V,), "b": (V,)}),
    ("temperature", {"log_a": (1,)}),
    ("answer_tokens", {"log_a": (2,), "b": (2,)}),
    ("option_temperature", {"log_a": (1,)}),
    ("option_length", {"log_a": (1,), "length": (1,)}),
])
def test_init_is_zero_with_the_kind_s_shapes(kind: str, shapes: dict) -> None:
    adj = LogitAdjustment(kind, V, (4, 1) if kind == "answer_tokens" else None)
    lam = adj.init(torch.float64)
    assert {k: tuple(v.shape) for k, v in lam.items()} == shapes
    assert all(float(v.abs().max()) == 0.0 for v in lam.values())
    assert adj.acts_on_options == (kind in OPTION_KINDS)


@pytest.mark.parametrize("kind", TOKEN_KINDS)
def test_token_kinds_match_their_formula(kind: str) -> None:
    adj = LogitAdjustment.for_tokens([4, 1, 4], V) if kind == "answer_tokens" else LogitAdjustment(kind, V)
    z = torch.randn(3, 5, V, dtype=torch.float64)
    assert torch.equal(adj.apply(z, adj.init(torch.float64)), z)
    lam = _random_lam(adj)
    a = lam["log_a"].exp()
    if kind == "vector":
        want = z * a + lam["b"]
    elif kind == "temperature":
        want = z * a
    else:
        want = z.clone()
        for j, t in enumerate((1, 4)):  # sorted unique ids
            want[..., t] = z[..., t] * a[j] + lam["b"][j]
    torch.testing.assert_close(adj.apply(z, lam), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", OPTION_KINDS)
def test_option_kinds_match_their_formula_and_keep_padding(kind: str) -> None:
    adj = LogitAdjustment(kind, V)
    s = torch.tensor([[-2.0, -5.0, float("-inf")], [-1.0, -3.0, -4.0]], dtype=torch.float64)
    length = torch.tensor([[1.0, 3.0, 0.0], [2.0, 2.0, 5.0]], dtype=torch.float64)
    lam = _random_lam(adj, seed=1)
    out = adj.apply_options(s, length, lam)
    want = s * lam["log_a"].exp() + (lam["length"] * length if kind == "option_length" else 0.0)
    finite = torch.isfinite(s)
    torch.testing.assert_close(out[finite], want[finite], rtol=0, atol=1e-12)
    assert torch.isneginf(out[~finite]).all()
    lam = {k: v.requires_grad_() for k, v in lam.items()}
    adj.apply_options(s, length, lam)[finite].sum().backward()
    assert all(torch.isfinite(v.grad).all() for v in lam.values())


def test_clamp_projects_onto_the_bounds() -> None:
    adj = LogitAdjustment("vector", V, max_log_scale=0.5, max_bias=0.25)
    lam = {"log_a": torch.full((V,), 3.0), "b": torch.full((V,), -2.0)}
    adj.clamp_(lam)
    assert float(lam["log_a"].max()) == 0.5 and float(lam["b"].min()) == -0.25
    opt = LogitAdjustment("option_length", V, max_bias=0.25)
    lam = {"log_a": torch.tensor([-9.0]), "length": torch.tensor([9.0])}
    opt.clamp_(lam)
    assert lam["log_a"].item() == -3.0 and lam["length"].item() == 0.25


def test_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="adjustment kind must be one of"):
        LogitAdjustment("bias", V)
    with pytest.raises(ValueError, match="non-empty token_ids"):
        LogitAdjustment("answer_tokens", V)
    with pytest.raises(ValueError, match="outside"):
        LogitAdjustment("answer_tokens", V, (V,))
    with pytest.raises(ValueError, match="vocab_size"):
        LogitAdjustment("vector", 0)
    with pytest.raises(ValueError, match="max_log_scale"):
        LogitAdjustment("vector", V, max_log_scale=0.0)
    with pytest.raises(ValueError, match="use apply_options"):
        LogitAdjustment("option_temperature", V).apply(torch.zeros(1, V), {"log_a": torch.zeros(1)})
    with pytest.raises(ValueError, match="use apply"):
        LogitAdjustment("vector", V).apply_options(torch.zeros(1, 2), torch.ones(1, 2), {})
    with pytest.raises(ValueError, match="expected vocab_size"):
        LogitAdjustment("vector", V).apply(torch.zeros(1, V + 1), LogitAdjustment("vector", V).init())
