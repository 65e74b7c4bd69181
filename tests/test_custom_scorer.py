"""A new multiple-choice scorer defined and registered here, without touching llm_calib's files.

The scorer scores each option's text (as option likelihood) after a prompt that lists the
options (as the letter scorer's): a subclass of
:class:`~llm_calib.formats.multiple_choice.OptionLikelihood` whose default and configured prompt
list the options, registered by name with :func:`~llm_calib.formats.register_format` after
llm_calib was imported. ``CalibrationConfig``, :func:`llm_calib.evaluation.evaluate.evaluate`,
``llm-calib evaluate --scorer`` and :func:`llm_calib.calibrate` then reach it by that name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch

from llm_calib import CalibrationConfig, SelectionSettings, TrainingSettings, calibrate, cli
from llm_calib.config.calibration import PromptSettings
from llm_calib.data import builtin_multiple_choice
from llm_calib.evaluation.evaluate import evaluate, sample_rows
from llm_calib.formats import (
    SCORER_NAMES,
    OptionLikelihood,
    multiple_choice_format,
    register_format,
    unregister_format,
)
from llm_calib.models import load as load_model
from llm_calib.models import tiny_random_model
from llm_calib.prompts.templates import PromptFormat
from llm_calib.scoring import score_option_likelihood

NAME = "listed_likelihood_test"
LISTED = PromptFormat(style="listed")
DATA = "builtin:capitals,arithmetic:n=4"


@dataclass(frozen=True)
class ListedLikelihood(OptionLikelihood):
    """Each option's text scored after a prompt that lists the options."""

    default_prompt = LISTED
    encoded: ClassVar[list[int]] = []  # the record counts the format encoded for training (the trainer reached this class)

    @classmethod
    def configured_prompt(cls, style, chat_template):
        return PromptFormat(style="listed", chat_template=chat_template)

    def encode(self, tokenizer, records):
        type(self).encoded.append(len(records))
        return super().encode(tokenizer, records)


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_format(NAME)(ListedLikelihood)
    yield
    unregister_format(NAME)


def test_the_name_is_a_scorer_wherever_scorers_are_checked():
    assert NAME in SCORER_NAMES and ListedLikelihood.name == NAME
    assert PromptSettings(scorer=NAME).scorer == NAME  # the config checks the registry as it is now
    assert isinstance(multiple_choice_format(NAME), ListedLikelihood)
    with pytest.raises(ValueError, match=rf"prompt.scorer must be one of \(.*'{NAME}'\), got 'nosuch'"):
        PromptSettings(scorer="nosuch")
    with pytest.raises(ValueError, match="already registered"):
        register_format(NAME)(type("Other", (OptionLikelihood,), {}))
    with pytest.raises(ValueError, match="built-in format 'letter' cannot be unregistered"):
        unregister_format("letter")


def test_evaluate_scores_with_it(tiny):
    model, tok = tiny
    result = evaluate(model, tok, [DATA], scorer=NAME, ci=False)
    assert result.config["scorer"] == NAME and result.config["prompt"]["style"] == "listed"
    rows = list(sample_rows(result))
    records = builtin_multiple_choice(4, domains=["capitals", "arithmetic"])
    direct = score_option_likelihood(model, tok, records, prompt=LISTED)
    cloze = score_option_likelihood(model, tok, records)
    assert [r["id"] for r in rows] == direct.ids
    for row, z in zip(rows, direct.logits, strict=True):
        assert "A." in row["prompt"]  # the options are listed
        np.testing.assert_allclose(row["probs"], torch.softmax(z.double(), 0).numpy(), rtol=1e-9)
    assert any(not torch.allclose(a, b) for a, b in zip(direct.logits, cloze.logits, strict=True))


def test_the_command_line_evaluates_with_it(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    argv = ["evaluate", "--model", str(tiny_model_dir), "--data", DATA, "--scorer", NAME, "--bootstrap", "0",
            "--quiet", "--log-samples", "--out", str(out)]
    assert cli.main(argv) == 0
    config = json.loads((out / "metrics.json").read_text())["config"]
    assert config["scorer"] == NAME and config["prompt"]["style"] == "listed"
    model, tok = load_model(str(tiny_model_dir))
    direct = score_option_likelihood(model, tok, builtin_multiple_choice(4, domains=["capitals", "arithmetic"]),
                                     prompt=LISTED)
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    for row, z in zip(rows, direct.logits, strict=True):
        np.testing.assert_allclose(row["probs"], torch.softmax(z.double(), 0).numpy(), rtol=1e-6)


def test_calibrate_trains_with_it_for_two_steps():
    model, tok = tiny_random_model(seed=0, init_std=0.1)
    questions = builtin_multiple_choice(n_per_domain=4, domains=["capitals", "arithmetic"])
    config = CalibrationConfig(prompt={"scorer": NAME}, training=TrainingSettings(steps=2, batch_size=2, heldout_batch_size=2),
                               selection=SelectionSettings(eval_every=1, guard_accuracy=0.0),
                               lora={"rank": 2, "layers": [1]})
    ListedLikelihood.encoded.clear()
    result = calibrate(model, tok, questions[:4], questions[4:], config, progress=False)
    assert [r["step"] for r in result.history] == [1, 2]
    assert ListedLikelihood.encoded  # the trainer encoded its records with the registered format
    assert result.base["scorer"] == NAME and result.base["prompt"]["style"] == "listed"
    assert CalibrationConfig.from_dict(result.config.to_dict()).prompt.scorer == NAME
