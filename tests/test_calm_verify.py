"""CALM's hypergradients: exact (implicit) against finite differences, and first-order against exact.

Everything runs in float64 on the tiny model with LoRA on one projection of its top layer, so θ
has 48 entries and the lower level can be solved to 1e-8. Llama's RMSNorm computes in float32
whatever the model's dtype; these tests about exactness patch it to keep float64.
"""

from __future__ import annotations

import pytest
import torch
from _benchmarks import BENCHMARKS  # noqa: F401  (puts benchmarks/ on sys.path for harness)
from harness.loss_check import compare_losses, relative_difference

import hypergrad as hg
from llm_calib.adjustment import LogitAdjustment
from llm_calib.calm.encoding import encode_records
from llm_calib.calm.lora import FunctionalLM, attach_lora
from llm_calib.calm.losses import CalmLosses
from llm_calib.calm.run import resolve_run, task_format
from llm_calib.calm.verify import (
    check_hypergradients,
    compare_directions,
    exact_hypergradient,
    proximal_problem,
    solve_lower_level,
)
from llm_calib.config.calibration import CalibrationConfig, LoraSettings
from llm_calib.data import builtin_multiple_choice
from llm_calib.models import tiny_random_model
from llm_calib.prompts.resolution import resolve_prompt_settings


def _rms_norm_float64(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture(scope="module")
def calm_problem():
    from transformers.models.llama import modeling_llama

    patch = pytest.MonkeyPatch()
    patch.setattr(modeling_llama.LlamaRMSNorm, "forward", _rms_norm_float64)
    torch.manual_seed(0)
    model, tok = tiny_random_model(init_std=0.3)
    model = model.double()
    qs = builtin_multiple_choice(n_per_domain=8, domains=["capitals", "arithmetic"])
    config = CalibrationConfig()
    lm = FunctionalLM(attach_lora(model, LoraSettings(rank=1, layers=(1,), target_modules=("v_proj",))))
    adjustment = LogitAdjustment("option_length", lm.head.out_features)
    losses = CalmLosses(lm, adjustment, "sum")
    inner_batch = encode_records(tok, qs[:8], task_format(qs[:8], resolve_prompt_settings(config.prompt))).batch(range(8), 0, lm)
    outer_batch = encode_records(tok, qs[8:], task_format(qs[8:], resolve_prompt_settings(config.prompt))).batch(range(8), 0, lm)
    anchor = {k: v + 0.3 * torch.randn_like(v) for k, v in lm.theta().items()}
    problem = proximal_problem(hg.BilevelProblem(inner=losses.inner, outer=losses.outer), anchor, mu=1.0)
    lam = {"log_a": torch.tensor([0.2], dtype=torch.float64), "length": torch.tensor([-0.1], dtype=torch.float64)}
    theta_star, residual = solve_lower_level(problem, anchor, lam, inner_batch, max_iter=300, tol=1e-10)
    yield problem, losses, theta_star, residual, lam, inner_batch, outer_batch
    patch.undo()


def _F(problem, losses, theta_start, lam, inner_batch, outer_batch) -> float:
    theta, _ = solve_lower_level(problem, theta_start, lam, inner_batch, max_iter=300, tol=1e-11)
    return float(losses.outer(theta, lam, outer_batch))


def test_lower_level_is_solved(calm_problem) -> None:
    _, _, _, residual, *_ = calm_problem
    assert residual < 1e-6


def test_exact_hypergradient_matches_finite_differences_of_F(calm_problem) -> None:
    problem, losses, theta_star, _, lam, inner_batch, outer_batch = calm_problem
    dense = exact_hypergradient(problem, theta_star, lam, inner_batch, outer_batch, hg.linear.Dense())
    cg = exact_hypergradient(problem, theta_star, lam, inner_batch, outer_batch, hg.linear.CG(tol=1e-12, maxiter=500))
    assert cg.info.converged
    for key in lam:
        torch.testing.assert_close(cg.grad[key], dense.grad[key], rtol=1e-7, atol=1e-10)
        eps = 1e-2  # the lower-level solves are good to ~1e-7: a smaller step measures their noise
        plus = {k: v + eps * (k == key) for k, v in lam.items()}
        minus = {k: v - eps * (k == key) for k, v in lam.items()}
        fd = (_F(problem, losses, theta_star, plus, inner_batch, outer_batch)
              - _F(problem, losses, theta_star, minus, inner_batch, outer_batch)) / (2 * eps)
        assert fd == pytest.approx(float(dense.grad[key]), rel=1e-3), key
    assert float(hg.tree.tree_norm(dense.grad)) > 1e-3  # a non-trivial point


def test_f2sa_estimate_agrees_with_exact(calm_problem) -> None:
    problem, _losses, theta_star, _, lam, inner_batch, outer_batch = calm_problem
    lr = 0.02  # below 1 / (largest Hessian eigenvalue, about 51 here)
    f2sa = hg.Penalty(sigma=1e-3, inner_optimizer=hg.inner.SGD(lr=lr), inner_steps=40)
    check = check_hypergradients(
        problem, theta_star, lam, inner_batch, outer_batch, {"f2sa": f2sa},
        lower_steps=0, lower_optimizer=hg.inner.SGD(lr=lr), solver=hg.linear.Dense(), calls=15,
    )
    result = check.by_method()["f2sa"]
    assert result.cosine >= 0.99
    assert 0.5 < result.relative_norm < 1.5
    assert result.descent < 0


def test_compare_directions_of_opposite_vectors() -> None:
    c = compare_directions("m", {"a": torch.tensor([1.0, 2.0])}, {"a": torch.tensor([-2.0, -4.0])})
    assert c.cosine == pytest.approx(-1.0)
    assert c.relative_norm == pytest.approx(2.0)
    assert c.descent == pytest.approx(5**0.5)


def test_compare_losses_is_zero_for_one_path_and_sees_a_different_one() -> None:
    import copy

    from llm_calib.calm.training import build_trainer

    model, tok = tiny_random_model(seed=0, num_layers=2)
    qs = builtin_multiple_choice(n_per_domain=4, domains=["capitals", "arithmetic"])
    cfg = CalibrationConfig(training=dict(batch_size=4, heldout_batch_size=4), lora=LoraSettings(rank=2, layers=(1,)))
    a = build_trainer(copy.deepcopy(model), tok, qs, qs, resolve_run(cfg, qs, qs))
    theta = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(0)) for k, v in a.lm.theta().items()}
    lam = {k: v + 0.1 for k, v in a.adjustment.init().items()}
    same = compare_losses(a, theta, a, theta, lam, step=1)
    assert same["scores_max_abs_diff"] == 0 and same["g"]["abs_diff"] == 0 and same["f"]["grad_theta_rel"] == 0
    b = a.with_losses(CalmLosses(a.lm, a.adjustment, "mean"))  # another option normalisation: another g
    other = compare_losses(a, theta, b, theta, lam, step=1)
    assert other["g"]["abs_diff"] > 1e-3 and other["g"]["grad_theta_rel"] > 1e-3 and other["g"]["grad_lam_rel"] > 1e-3
    assert other["scores_max_abs_diff"] > 1e-3 and other["g"]["a"] == pytest.approx(same["g"]["a"])
    assert relative_difference({"x": torch.tensor([3.0, 4.0])}, {"x": torch.tensor([0.0, 0.0])}) == 5e30
    with pytest.raises(ValueError, match="different keys"):
        relative_difference({"x": torch.zeros(1)}, {"y": torch.zeros(1)})
