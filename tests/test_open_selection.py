"""Open questions: model selection on the generated answers (the metric the report shows), and the
post-hoc temperature of open answers (token confidence: fitted; semantic: the sampling temperature)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from llm_calib.calm import training
from llm_calib.calm.run import resolve_run
from llm_calib.calm.trainer import calibrate
from llm_calib.confidence.kinds import OpenConfidence, score_open
from llm_calib.confidence.temperature import (
    OPEN_TEMPERATURE_RANGE,
    AnswerTokenLogits,
    choose_sampling_temperature,
    correctness_log_loss,
    fit_open_temperature,
    fit_token_temperature,
)
from llm_calib.confidence.token import encode_open_prompts, score_open_ended
from llm_calib.config.calibration import CalibrationConfig, SelectionSettings
from llm_calib.data import builtin_open_questions
from llm_calib.engine.decode import generate_greedy
from llm_calib.models import tiny_random_model

QS = builtin_open_questions(6, ["capitals", "sums"])  # 12 questions


def _cfg(**selection):
    return CalibrationConfig(training={"steps": 4, "batch_size": 2, "heldout_batch_size": 2},
                             selection={"eval_every": 2, **selection})


def _evaluation(step, greedy_ece, greedy_acc, proxy_ece, proxy_acc=0.5):
    return {"step": step, "heldout_ece": greedy_ece, "heldout_accuracy": greedy_acc,
            "heldout_teacher_forced_ece": proxy_ece, "heldout_teacher_forced_accuracy": proxy_acc}


BEFORE = {"ece": 0.14, "accuracy": 0.50, "teacher_forced_ece": 0.14, "teacher_forced_accuracy": 0.5}
# the benchmark's failure: the proxy rises after every step while the greedy answers' ECE falls
HISTORY = [{"step": 1, "loss": 1.0}, _evaluation(10, 0.16, 0.50, 0.24), {"step": 11, "loss": 0.9},
           _evaluation(20, 0.09, 0.48, 0.28), _evaluation(30, 0.05, 0.40, 0.30)]


def test_a_later_step_with_lower_greedy_ece_within_the_guard_is_selected() -> None:
    """Step 20 lowers the held-out greedy ECE (0.14 -> 0.09) at accuracy 0.48 >= 0.95 x 0.50: selected; step 30
    is lower still but below the accuracy floor; the teacher-forced proxy would have kept the initial model."""
    cfg = SelectionSettings()
    assert training.replay_selection(HISTORY, BEFORE, cfg) == {"step": 20, "ece": 0.09, "stopped_at": None}
    proxy = training.replay_selection(HISTORY, BEFORE, cfg, metric="teacher_forced_ece", accuracy="teacher_forced_accuracy")
    assert proxy["step"] == 0
    # below the floor at step 20 too (guard 0.97: floor 0.485): nothing is selectable; two in a row stop the run
    strict = SelectionSettings(guard_accuracy=0.97)
    assert training.replay_selection(HISTORY, BEFORE, strict) == {"step": 0, "ece": 0.14, "stopped_at": 30}


def test_the_training_loop_selects_as_the_replay_does() -> None:
    """select() on the same evaluations (the loop's rule) keeps the same step and θ as replay_selection."""
    model, tok = tiny_random_model(seed=0)
    trainer = training.build_trainer(model, tok, QS[:6], QS[6:], resolve_run(_cfg(), QS[:6], QS[6:]))
    state = training.init_state(trainer, evaluate_before=False)
    state.before = dict(BEFORE)
    state.best = {"ece": BEFORE["ece"], "step": 0}
    thetas = {}
    for rec in HISTORY:
        if "heldout_ece" not in rec:
            continue
        state.step = rec["step"]
        state.theta = {k: torch.full_like(v, float(rec["step"])) for k, v in state.theta.items()}
        thetas[rec["step"]] = state.theta
        training.select(trainer, state, {"accuracy": rec["heldout_accuracy"], "ece": rec["heldout_ece"]})
    assert state.best["step"] == 20 and not state.stopped_early
    assert all(torch.equal(state.best_theta[k], thetas[20][k]) for k in thetas[20])


def test_selection_scores_the_generated_answers_and_records_the_proxy() -> None:
    """Under ``generated`` the held-out ECE and accuracy are those of the greedy answers (what evaluate reports),
    the teacher-forced proxy is recorded beside them, and training is the same as under ``teacher_forced``."""
    results = {}
    for metric in ("generated", "teacher_forced"):
        model, tok = tiny_random_model(seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results[metric] = calibrate(model, tok, QS[:6], QS[6:], _cfg(open_metric=metric), progress=False)
    gen, proxy = results["generated"], results["teacher_forced"]
    base, tok = tiny_random_model(seed=0)
    greedy = score_open(base, tok, QS[6:]).summary(ci=False)
    assert gen.metrics["before"]["ece"] == pytest.approx(greedy["ece"], abs=1e-9)
    assert gen.metrics["before"]["accuracy"] == greedy["accuracy"]
    evaluations = [r for r in gen.history if "heldout_ece" in r]
    assert len(evaluations) == 2 and all("heldout_teacher_forced_ece" in r for r in evaluations)
    after = score_open(gen.model, tok, QS[6:]).summary(ci=False)  # the deployed (selected) model
    assert gen.metrics["after"]["ece"] == pytest.approx(after["ece"], abs=1e-9)
    assert gen.selection == {"metric": "ECE of the greedy answers (token confidence)", "evaluations": 4,
                             "questions": 6, "answers": 24}
    # the proxy run selects on the proxy, and its training trajectory is the same step by step
    assert proxy.metrics["before"]["ece"] == proxy.metrics["before"]["teacher_forced_ece"]
    assert proxy.metrics["before"]["teacher_forced_ece"] == gen.metrics["before"]["teacher_forced_ece"]
    for a, b in zip(gen.history, proxy.history, strict=True):
        assert a.get("loss") == b.get("loss") and a.get("heldout_teacher_forced_ece") == b.get("heldout_teacher_forced_ece")


def test_semantic_selection_reads_the_sem_ece_and_its_sample_budget_is_bounded() -> None:
    conf = OpenConfidence("semantic", samples=3, seed=1)
    model, tok = tiny_random_model(seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = calibrate(model, tok, QS[:6], QS[6:], _cfg(), progress=False, confidence=conf)
    base, _ = tiny_random_model(seed=0)
    sem = score_open(base, tok, QS[6:], conf, batch_size=16).summary(ci=False)
    assert result.metrics["before"]["ece"] == pytest.approx(sem["ece"], abs=1e-12)
    assert result.selection["metric"] == "Sem-ECE of 3 sampled answers (semantic confidence)"
    assert result.selection["answers"] == 4 * 6 * 3 and result.selection["samples_per_question"] == 3
    model, tok = tiny_random_model(seed=0)
    with pytest.raises(ValueError, match=r"would sample 72 answers \(4 evaluations x 6 held-out questions x 3 "
                                         r"samples\), over selection.sample_budget 50"):
        calibrate(model, tok, QS[:6], QS[6:], _cfg(sample_budget=50), progress=False, confidence=conf)


# ------------------------------------------------------------------------------------ temperature


@pytest.fixture(scope="module")
def answered():
    model, tok = tiny_random_model(seed=0)
    prompts = encode_open_prompts(tok, QS)
    outs = generate_greedy(model, tok, prompts, max_new_tokens=4, temperatures=[0.3, 1.0, 2.5])
    return model, tok, prompts, outs


def test_teacher_forced_probabilities_are_the_decoders(answered) -> None:
    """AnswerTokenLogits gives each answer token's probability at any T as the greedy decoder recorded it."""
    model, tok, prompts, outs = answered
    view = AnswerTokenLogits(model, prompts, [o.token_ids for o in outs], tok.pad_token_id, batch_size=5)
    for probs, out in zip(view.probs([0.3, 1.0, 2.5]), outs, strict=True):
        assert probs.shape == out.temp_probs.shape
        # float32: the cached one-token steps and the teacher-forced pass sum in other orders (2.5e-6 apart on a
        # probability of 0.53 under transformers 5.17)
        np.testing.assert_allclose(probs, out.temp_probs, rtol=1e-5, atol=2e-6)
        np.testing.assert_allclose(probs[:, 1], out.token_probs, rtol=1e-5, atol=2e-6)
    # an empty answer (generation stopped at once) reads the position after the prompt: its top token
    with torch.no_grad():
        first = torch.softmax(model(input_ids=torch.tensor([prompts[0]])).logits[0, -1] / 2.5, -1).max()
    empty = AnswerTokenLogits(model, prompts[:1], [()], tok.pad_token_id).probs([2.5])[0]
    assert empty.shape == (1, 1) and empty[0, 0] == pytest.approx(float(first), abs=2e-6)


def test_the_fit_equals_a_brute_force_grid_search(answered) -> None:
    """The temperature fitted to token confidence equals the argmin of the log-loss of correctness over 20 000
    temperatures spread over the whole range (within 1e-3 in T)."""
    model, tok, prompts, outs = answered
    view = AnswerTokenLogits(model, prompts, [o.token_ids for o in outs], tok.pad_token_id)
    correct = np.array([i % 3 == 0 for i in range(len(outs))])  # a made-up correctness: an interior optimum
    fit = fit_token_temperature(correct, view.probs)
    grid = np.exp(np.linspace(np.log(OPEN_TEMPERATURE_RANGE[0]), np.log(OPEN_TEMPERATURE_RANGE[1]), 20_000))
    losses = np.concatenate([correctness_log_loss(correct, view.probs(part)) for part in np.array_split(grid, 20)])
    brute = float(grid[np.argmin(losses)])
    assert OPEN_TEMPERATURE_RANGE[0] < brute < OPEN_TEMPERATURE_RANGE[1]
    assert abs(fit.temperature - brute) < 1e-3
    assert fit.log_loss_after <= losses.min() + 1e-12 and fit.log_loss_after < fit.log_loss_before


def test_token_scoring_at_a_temperature_keeps_the_answers(answered) -> None:
    model, tok, _, outs = answered
    at_1, at_t = score_open_ended(model, tok, QS, max_new_tokens=4), score_open_ended(model, tok, QS, max_new_tokens=4,
                                                                                       temperature=2.5)
    assert at_t.answers == at_1.answers and at_t.info["temperature"] == 2.5
    for probs, out in zip(at_t.token_probs, outs, strict=True):
        np.testing.assert_allclose(probs, out.temp_probs[:, 2], atol=2e-6)


def test_open_temperature_fit_by_kind() -> None:
    model, tok = tiny_random_model(seed=0)
    token = fit_open_temperature(model, tok, QS, max_new_tokens=4)
    assert token.criterion == "correctness_nll" and token.after <= token.before
    sem = fit_open_temperature(model, tok, QS, OpenConfidence("semantic", samples=3), max_new_tokens=4,
                               sampling_temperatures=(0.5, 2.0))
    assert sem.criterion == "sem_ece" and set(sem.tried) == {"0.5", "1", "2"}
    floor = 0.95 * sem.tried["1"]["accuracy"]
    kept = {t: v["sem_ece"] for t, v in sem.tried.items() if v["accuracy"] >= floor}
    assert sem.after == min(kept.values()) and sem.before == sem.tried["1"]["sem_ece"]
    with pytest.raises(ValueError, match="no temperature applies to verbalized confidence"):
        fit_open_temperature(model, tok, QS, OpenConfidence("verbalized"))


def test_the_sampling_temperature_keeps_the_accuracy() -> None:
    """A hot sampling temperature makes every sample differ: Sem-ECE near 0 at near-zero accuracy. It is not
    chosen; among the temperatures keeping 95% of the reference accuracy the lowest Sem-ECE is."""
    metrics = {0.5: (0.20, 0.40), 0.7: (0.12, 0.39), 1.0: (0.15, 0.40), 1.4: (0.10, 0.37), 2.0: (0.01, 0.05)}
    best, values = choose_sampling_temperature(lambda t: metrics[t])
    assert best == 0.7 and values == metrics
    assert choose_sampling_temperature(lambda t: metrics[t], guard_accuracy=0.9)[0] == 1.4
    assert choose_sampling_temperature(lambda t: metrics[t], guard_accuracy=0.0)[0] == 2.0
    assert choose_sampling_temperature(lambda t: metrics[t], (2.0,), reference=0.7)[0] == 0.7


def test_the_open_temperature_fit_applies_the_guard(monkeypatch) -> None:
    """``fit_open_temperature`` under semantic confidence: the hot temperature whose Sem-ECE is lowest because its
    modal answer is almost never right is not chosen; the floor is 95% of the accuracy at the confidence's own
    sampling temperature (here 0.7), and ``guard_accuracy=0`` gives the unguarded choice."""
    import llm_calib.confidence.kinds as kinds

    at = {0.5: (0.20, 0.40), 0.7: (0.15, 0.40), 1.0: (0.12, 0.30), 1.4: (0.13, 0.39), 2.0: (0.01, 0.05)}

    class Scored:
        def __init__(self, t: float) -> None:
            self.t = t

        def summary(self, ci: bool = True) -> dict[str, float]:
            return {"ece": at[self.t][0], "accuracy": at[self.t][1]}

    monkeypatch.setattr(kinds, "score_open", lambda model, tok, recs, conf, **kw: Scored(conf.temperature))
    conf = OpenConfidence("semantic", samples=3, temperature=0.7)
    fit = fit_open_temperature(None, None, QS, conf)
    assert fit.temperature == 1.4 and fit.before == 0.15 and fit.after == 0.13  # 1.0 is below 0.95 * 0.40
    assert fit.tried["2"] == {"sem_ece": 0.01, "accuracy": 0.05}
    assert fit_open_temperature(None, None, QS, conf, guard_accuracy=0.0).temperature == 2.0
