"""CALM losses on a tiny model: hand computations, finite differences, trunk caching, BOME's barrier."""

from __future__ import annotations

import pytest
import torch
from _directional import directional_derivatives

import hypergrad as hg
from llm_calib.adjustment import LogitAdjustment
from llm_calib.calm.encoding import encode_records
from llm_calib.calm.lora import FunctionalLM, attach_lora
from llm_calib.calm.losses import CalmLosses
from llm_calib.calm.run import task_format
from llm_calib.config.calibration import CalibrationConfig, LoraSettings
from llm_calib.data import builtin_multiple_choice
from llm_calib.formats.categorical import cross_entropy, entropy
from llm_calib.models import tiny_random_model
from llm_calib.prompts.resolution import resolve_prompt_settings


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model, tok = tiny_random_model(num_layers=3)
    model = model.double()
    peft_model = attach_lora(model, LoraSettings(rank=2, layers=(1, 2)))
    lm = FunctionalLM(peft_model)
    theta = {k: 0.05 * torch.randn_like(v) for k, v in lm.theta().items()}
    adjustment = LogitAdjustment("vector", lm.head.out_features)
    losses = CalmLosses(lm, adjustment)
    qs = builtin_multiple_choice(n_per_domain=2)
    enc = encode_records(tok, qs, task_format(qs, resolve_prompt_settings(CalibrationConfig().prompt)))
    return lm, theta, adjustment, losses, enc, qs


def test_cross_entropy_and_entropy_by_hand():
    scores = torch.tensor([[1.0, 2.0, float("-inf")], [0.0, 0.0, 0.0]], dtype=torch.float64)
    p0 = torch.tensor([1.0, 2.0], dtype=torch.float64).softmax(0)
    ce = cross_entropy(scores, torch.tensor([1, 2]))
    assert ce[0].item() == pytest.approx(-float(p0[1].log()), abs=1e-12)
    assert ce[1].item() == pytest.approx(float(torch.log(torch.tensor(3.0, dtype=torch.float64))), abs=1e-12)
    h = entropy(scores)
    assert h[0].item() == pytest.approx(-float((p0 * p0.log()).sum()), abs=1e-12)
    smoothed = cross_entropy(scores, torch.tensor([1, 2]), smoothing=0.2)
    # smoothing spreads 0.2 over the 2 valid options of question 0 only
    expected = 0.8 * -float(p0[1].log()) + 0.2 * -float(p0.log().mean())
    assert smoothed[0].item() == pytest.approx(expected, abs=1e-12)


def test_entropy_gradient_is_finite_with_padded_options():
    """Batches mix 3-, 4- and 5-option questions (ARC): padded options must not poison the gradient."""
    scores = torch.tensor([[0.5, 0.1, float("-inf")], [0.2, 0.3, 0.4]], dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(entropy(scores).sum(), scores)
    assert torch.isfinite(grad).all()
    assert grad[0, 2] == 0.0
    # the unpadded part equals the gradient of the 2-option entropy alone
    two = scores.detach()[0, :2].clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(entropy(two[None]).sum(), two)
    torch.testing.assert_close(grad[0, :2], expected, atol=1e-12, rtol=0)


def test_adjusted_option_scores_match_a_hand_computation(setup):
    lm, theta, adjustment, losses, enc, _qs = setup
    batch = enc.batch([0], 0, None)
    lam = {"log_a": 0.1 * torch.randn(adjustment.vocab_size, dtype=torch.float64),
           "b": 0.1 * torch.randn(adjustment.vocab_size, dtype=torch.float64)}
    scores = losses.scores(theta, lam, batch)[0]
    # Hand computation: full forward of prompt + option, adjusted log-softmax at each option token.
    lm.load_theta(theta)
    prompt, options = enc.prompts[0], enc.options[0]
    for k, option in enumerate(options):
        ids = torch.tensor([list(prompt) + list(option)])
        with torch.no_grad():
            logits = lm.model(input_ids=ids).logits[0].double()
        adjusted = logits * lam["log_a"].exp() + lam["b"]
        logp = torch.log_softmax(adjusted, -1)
        expected = sum(float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(option))
        assert scores[k].item() == pytest.approx(expected, abs=1e-8)
    lm.load_theta({k: torch.zeros_like(v) for k, v in theta.items()})


def test_lambda_at_init_gives_plain_cross_entropy(setup):
    lm, theta, adjustment, losses, enc, _ = setup
    batch = enc.batch([0, 1, 2, 3], 0, lm)
    lam0 = {k: v.double() for k, v in adjustment.init().items()}
    g = losses.inner(theta, lam0, batch)
    plain = losses.one_level(theta, batch)
    assert g.item() == pytest.approx(plain.item(), abs=1e-12)


def test_trunk_cache_equals_full_forward(setup):
    lm, theta, _adjustment, losses, enc, _ = setup
    assert lm.trunk_layers == 1
    cached = losses.scores(theta, None, enc.batch([0, 2, 4, 6], 0, lm))
    full = losses.scores(theta, None, enc.batch([0, 2, 4, 6], 0, None))
    finite = torch.isfinite(full)
    assert torch.equal(finite, torch.isfinite(cached))
    assert torch.allclose(cached[finite], full[finite], atol=1e-10)


def test_outer_gradient_matches_finite_differences(setup):
    lm, theta, adjustment, losses, enc, _ = setup
    batch = enc.batch([1, 3, 5], 0, lm)
    lam0 = {k: v.double() for k, v in adjustment.init().items()}
    _, grad, _ = hg.autodiff.loss_and_grads(lambda w, l: losses.outer(w, l, batch), theta, lam0, wrt_lam=False)
    # The model computes RMSNorm and rotary embeddings in float32 even in a float64 model, so the
    # step must be large enough for float32 round-off to stay below the O(h^2) truncation error.
    analytic, fd = directional_derivatives(lambda w: losses.outer(w, lam0, batch), theta, grad, h=1e-4)
    assert analytic == pytest.approx(fd, rel=2e-3, abs=1e-6)


def test_bome_direction_satisfies_the_barrier_and_decreases_q(setup):
    lm, theta, adjustment, losses, enc, _ = setup
    inner_b, outer_b = enc.batch([0, 2, 4, 6], 0, lm), enc.batch([1, 3, 5, 7], 0, lm)
    lam = {k: v.double() for k, v in adjustment.init().items()}
    problem = hg.BilevelProblem(losses.inner, losses.outer)
    eta, w_lr = 0.5, 1e-3
    bome = hg.BOME(hg.inner.SGD(lr=0.5), w_lr=w_lr, inner_steps=3, eta=eta)
    r = bome.hypergrad(problem, theta, lam, inner_b, outer_b)
    # Recompute w_hat and q's gradient independently.
    w_hat = dict(theta)
    for _ in range(3):
        _, gw, _ = hg.autodiff.loss_and_grads(lambda w, l: losses.inner(w, l, inner_b), w_hat, lam, wrt_lam=False)
        w_hat = {k: w_hat[k] - 0.5 * gw[k] for k in w_hat}

    def q(w, l):
        return losses.inner(w, l, inner_b) - losses.inner(w_hat, l, inner_b)

    q0, gq_w, gq_l = hg.autodiff.loss_and_grads(q, theta, lam)
    assert float(q0) == pytest.approx(r.info.extra["q"], rel=1e-9)
    d_w = {k: (theta[k] - r.w[k]) / w_lr for k in theta}
    inner_product = sum(float((d_w[k] * gq_w[k]).sum()) for k in theta) + sum(float((r.grad[k] * gq_l[k]).sum()) for k in lam)
    assert inner_product >= eta * float(q0) - 1e-9
    step = 1e-3
    q1 = q({k: theta[k] - step * d_w[k] for k in theta}, {k: lam[k] - step * r.grad[k] for k in lam})
    assert float(q1) < float(q0)
