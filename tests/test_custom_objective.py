"""A new objective defined, registered and trained here, without touching llm_calib's files.

The focal loss ``-(1 - p_y)^γ log p_y`` (Mukhoti et al. 2020) is a one-level objective:
a subclass of :class:`~llm_calib.objectives.one_level.OneLevelObjective` registered by name with
:func:`~llm_calib.objectives.registry.register_objective`; ``CalibrationConfig(objective=...)``,
config files (``objective: {name: ..., gamma: ...}``), :func:`llm_calib.calibrate` and
``llm-calib calibrate --objective`` / ``--methods`` (with a flag per setting) then reach it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from llm_calib import CalibrationConfig, SelectionSettings, TrainingSettings, calibrate, cli
from llm_calib.calm import training
from llm_calib.calm.run import resolve_run
from llm_calib.data import builtin_multiple_choice
from llm_calib.models import tiny_random_model
from llm_calib.objectives.one_level import OneLevelObjective
from llm_calib.objectives.registry import objective_names, register_objective, unregister_objective

NAME = "focal_test"


@dataclass
class FocalLoss(OneLevelObjective):
    """Focal loss over the options of multiple-choice questions."""

    gamma: float = 2.0

    def loss_fn(self, context, inner, parts):
        def loss(theta):
            logp = torch.log_softmax(context.losses.scores(theta, None, inner), -1)
            logp_gold = logp.gather(-1, inner.labels[:, None]).squeeze(-1)
            parts["p_gold"] = logp_gold.exp().mean()
            return (-(1 - logp_gold.exp()) ** self.gamma * logp_gold).mean()

        return loss

    def record(self, parts):
        return {"p_gold": float(parts["p_gold"].detach())}


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_objective(NAME)(FocalLoss)
    yield
    unregister_objective(NAME)


def _config(**kw):
    return CalibrationConfig(objective=FocalLoss(), training=TrainingSettings(steps=2, batch_size=2, heldout_batch_size=2),
                             selection=SelectionSettings(eval_every=1, guard_accuracy=0.0),
                             lora={"rank": 2, "layers": [1]}, **kw)


QUESTIONS = builtin_multiple_choice(n_per_domain=4, domains=["capitals", "arithmetic"])


def test_the_step_minimises_the_registered_loss_and_records_its_terms():
    model, tok = tiny_random_model(seed=0, init_std=0.1)
    trainer = training.build_trainer(model, tok, QUESTIONS[:4], QUESTIONS[4:], resolve_run(_config(), QUESTIONS[:4], QUESTIONS[4:]))
    assert isinstance(trainer.objective, FocalLoss) and trainer.adjustment is None  # one-level: no λ to train
    state = training.init_state(trainer, evaluate_before=False)
    batch = trainer.train_batch(0)
    with torch.no_grad():  # the focal loss by hand, at the initial θ
        p = torch.softmax(trainer.losses.scores(state.theta, None, batch).double(), -1)
        p_gold = p[torch.arange(len(batch.labels)), batch.labels]
        expected = float((-(1 - p_gold) ** 2.0 * torch.log(p_gold)).mean())
    theta0 = {k: v.clone() for k, v in state.theta.items()}
    record = training.train_step(trainer, state)
    assert record["loss"] == pytest.approx(expected, rel=1e-4)
    assert record["p_gold"] == pytest.approx(float(p_gold.mean()), rel=1e-4)
    assert not any(k.startswith("lambda_") for k in record)  # one-level: λ is not trained
    assert any(not torch.equal(theta0[k], state.theta[k]) for k in theta0)


def test_calibrate_trains_it_for_two_steps():
    model, tok = tiny_random_model(seed=0, init_std=0.1)
    result = calibrate(model, tok, QUESTIONS[:4], QUESTIONS[4:], _config(), progress=False)
    assert [r["step"] for r in result.history] == [1, 2]
    assert all({"loss", "p_gold", "heldout_ece"} <= set(r) for r in result.history)
    assert result.config.objective.name == NAME
    assert CalibrationConfig.from_dict(result.config.to_dict()) == result.config  # a tagged, round-tripping entry
    assert result.config.to_dict()["objective"] == {"name": NAME, "gamma": 2.0}


def test_the_command_line_reaches_it_by_name(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    argv = ["calibrate", "--model", str(tiny_model_dir), "--train", "builtin:arithmetic,capitals:n=4",
            "--heldout", "builtin:arithmetic,capitals:n=4,seed=1", "--eval", "builtin:capitals:n=4,seed=2",
            "--out", str(out), "--methods", NAME, "--steps", "2", "--batch-size", "2", "--heldout-batch-size", "2",
            "--lora-rank", "2", "--lora-layers", "1", "--bootstrap", "0", "--no-progress", "--focal-test-gamma", "1.5"]
    assert cli.main(argv) == 0
    assert (out / NAME / "adapter").is_dir()
    assert CalibrationConfig.from_file(out / NAME / "config.json").objective == FocalLoss(gamma=1.5)


def test_names_are_checked_against_the_registry():
    assert NAME in objective_names()
    with pytest.raises(ValueError, match=r"objective.name must be one of .*focal_test"):
        CalibrationConfig(objective="focal")
    assert CalibrationConfig.from_dict({"objective": {"name": NAME, "gamma": 0.5}}).objective == FocalLoss(gamma=0.5)
    with pytest.raises(ValueError, match=r"unknown objective key\(s\) \['beta'\] for objective.name: focal_test"):
        CalibrationConfig.from_dict({"objective": {"name": NAME, "beta": 0.5}})
    with pytest.raises(ValueError, match="already registered"):
        register_objective(NAME)(type("Other", (OneLevelObjective,), {}))
    with pytest.raises(ValueError, match="built-in objective 'calm' cannot be unregistered"):
        unregister_objective("calm")
