"""A one-level objective registered here (no llm_calib file edited, the built-in table of
:data:`llm_calib.registry.OBJECTIVES` included) is reachable from ``llm-calib calibrate`` by name: ``--objective NAME`` trains it alone,
``--methods lora_ce,NAME`` next to a built-in one, and its setting has its own flag
(``--NAME-SETTING``) in ``--help``.

The objective: the Brier score of the options, ``Σ_k (p_k - [k = y])²``, minimised over θ.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from llm_calib import CalibrationConfig, cli
from llm_calib.objectives.one_level import OneLevelObjective
from llm_calib.objectives.registry import objective_names, register_objective, unregister_objective

NAME = "brier_cli_test"


@dataclass
class BrierLoss(OneLevelObjective):
    """The Brier score over the options of multiple-choice questions, times ``weight``.

    Attributes:
        weight: factor of the score (the flag's help text comes from this line).
    """

    weight: float = 1.0

    def loss_fn(self, context, inner, parts):
        def loss(theta):
            p = torch.softmax(context.losses.scores(theta, None, inner), -1)
            onehot = torch.nn.functional.one_hot(inner.labels, p.shape[-1]).to(p.dtype)
            return self.weight * ((p - onehot) ** 2).sum(-1).mean()

        return loss


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_objective(NAME)(BrierLoss)
    yield
    unregister_objective(NAME)


def _argv(model_dir, out, *extra):
    return ["calibrate", "--model", str(model_dir), "--train", "builtin:arithmetic,capitals:n=4",
            "--heldout", "builtin:arithmetic,capitals:n=4,seed=1", "--eval", "builtin:capitals:n=4,seed=2",
            "--out", str(out), "--steps", "2", "--batch-size", "2", "--heldout-batch-size", "2",
            "--lora-rank", "2", "--lora-layers", "1", "--eval-every", "1", "--guard-accuracy", "0",
            "--bootstrap", "0", "--no-progress", *extra]


def test_objective_flag_trains_the_registered_objective_alone(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    assert NAME in objective_names()
    assert cli.main(_argv(tiny_model_dir, out, "--objective", NAME, "--brier-cli-test-weight", "0.5")) == 0
    assert sorted(p.name for p in out.iterdir() if (p / "config.json").exists()) == [NAME]
    assert CalibrationConfig.from_file(out / NAME / "config.json").objective == BrierLoss(weight=0.5)
    history = json.loads((out / NAME / "history.json").read_text())
    assert [r["step"] for r in history] == [1, 2] and all(r["loss"] > 0 for r in history)


def test_methods_trains_it_next_to_a_builtin_objective(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    assert cli.main(_argv(tiny_model_dir, out, "--methods", f"lora_ce,{NAME}")) == 0
    assert sorted(p.name for p in out.iterdir() if (p / "config.json").exists()) == sorted(["lora_ce", NAME])
    assert CalibrationConfig.from_file(out / NAME / "config.json").objective == BrierLoss()
    report = json.loads((out / "metrics.json").read_text())
    assert NAME in json.dumps(report["domains"])  # a column of the comparison


def test_help_lists_it_and_its_setting(capsys):
    with pytest.raises(SystemExit):
        cli.main(["calibrate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert NAME in text.split("--objective", 1)[1].split("--", 1)[0]  # one of --objective's choices
    assert "--brier-cli-test-weight FLOAT factor of the score" in text
