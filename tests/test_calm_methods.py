"""The solver factory: the implicit solver from the config (hypergrad.AlternatingImplicit, tested
against a closed form in tests/test_alternating.py), and an implicit run resumed."""

from __future__ import annotations

import warnings

import pytest
import torch

import hypergrad as hg
from llm_calib.calm.run import resolve_run
from llm_calib.calm.trainer import calibrate
from llm_calib.config.calibration import CalibrationConfig, LoraSettings
from llm_calib.data import builtin_multiple_choice
from llm_calib.models import tiny_random_model
from llm_calib.objectives.calm import Calm, ImplicitSolver
from llm_calib.objectives.lora_ce import LoraCE


def test_the_implicit_solver_builds_its_method_from_the_runs_theta_optimizer() -> None:
    from llm_calib.calm.run import theta_optimizer

    cfg = CalibrationConfig(objective=Calm(solver=ImplicitSolver(inner_steps=3, maxiter=7, damping=0.5)), training=dict(lr=2e-3))
    solver = cfg.objective.solver.build(theta_optimizer(cfg.lora, cfg.training.lr))
    assert cfg.objective.second_order and ImplicitSolver.second_order  # under torchrun its units stay gathered
    assert isinstance(solver, hg.AlternatingImplicit)
    assert solver.inner_steps == 3 and solver.inner_optimizer.lr == 2e-3
    assert solver.implicit.warm_start
    assert (solver.implicit.solver.maxiter, solver.implicit.solver.damping) == (7, 0.5)
    # the implicit step: a capped CG solve is reported per step (cg_converged), not warned about
    with warnings.catch_warnings():
        warnings.simplefilter("error", hg.ConvergenceWarning)
        with solver.solve_context():
            warnings.warn("CG stopped at maxiter", hg.ConvergenceWarning, stacklevel=1)


def test_an_implicit_run_resumed_from_a_checkpoint_equals_the_uninterrupted_run(tmp_path) -> None:
    qs = builtin_multiple_choice(n_per_domain=6, domains=["capitals"])

    def run(steps: int, ckpt, resume: bool):
        cfg = CalibrationConfig(objective=Calm(solver=ImplicitSolver(), adjustment="option_length"), training=dict(steps=steps, batch_size=2, heldout_batch_size=2), selection=dict(eval_every=2, guard_accuracy=0.0), checkpoint_every=2,
                                lora=LoraSettings(rank=2, layers=(1,)))
        return calibrate(tiny_random_model()[0], tiny_random_model()[1], qs[:4], qs[4:], cfg,
                         checkpoint_dir=ckpt, resume=resume, progress=False)

    full = run(4, tmp_path / "full", False)
    run(2, tmp_path / "split", False)
    resumed = run(4, tmp_path / "split", True)
    assert [h["step"] for h in resumed.history] == [h["step"] for h in full.history]
    for a, b in zip(full.history, resumed.history, strict=True):
        assert a.get("g") == pytest.approx(b.get("g"), rel=1e-6)
    for k in full.lam:
        torch.testing.assert_close(resumed.lam[k], full.lam[k])


@pytest.mark.parametrize(("layout", "kind"), [("options", "option_temperature"), ("letter", "answer_tokens"),
                                              ("open", "vector")])
def test_auto_adjustment_acts_where_the_prediction_is_made(layout, kind) -> None:
    from llm_calib.adjustment import ADJUSTMENT_KINDS
    from llm_calib.formats import Letter, OpenEnded, OptionLikelihood

    fmt = {"options": OptionLikelihood, "letter": Letter, "open": OpenEnded}[layout]
    assert fmt.layout == layout and fmt.auto_adjustment == kind  # the format says where its prediction is made
    assert Calm(adjustment="auto").logit_adjustment(16, [3, 5], fmt.auto_adjustment).kind == kind
    assert Calm(adjustment="option_length").logit_adjustment(16, [3, 5], fmt.auto_adjustment).kind == "option_length"
    assert all(f.auto_adjustment in ADJUSTMENT_KINDS for f in (OptionLikelihood, Letter, OpenEnded))
    assert LoraCE().logit_adjustment(16, [3, 5], fmt.auto_adjustment) is None  # a one-level objective trains no λ


def test_auto_adjustment_trains_an_option_temperature_on_option_scores() -> None:
    from llm_calib.calm.training import build_trainer

    qs = builtin_multiple_choice(n_per_domain=4, domains=["capitals"])
    trainer = build_trainer(tiny_random_model()[0], tiny_random_model()[1], qs[:2], qs[2:],
                            resolve_run(CalibrationConfig(objective=Calm(adjustment="auto"), training=dict(steps=1, batch_size=2, heldout_batch_size=2)), qs[:2], qs[2:]))
    assert trainer.adjustment.kind == "option_temperature"
