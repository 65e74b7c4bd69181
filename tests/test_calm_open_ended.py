"""CALM on open-ended questions: losses by hand, trunk caching, finite differences, training runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _configs import configured
from _directional import directional_derivatives

from llm_calib.adjustment import LogitAdjustment
from llm_calib.calm.encoding import EncodingCache, encode_records
from llm_calib.calm.lora import FunctionalLM, attach_lora
from llm_calib.calm.losses import CalmLosses
from llm_calib.calm.run import resolve_run, task_format
from llm_calib.calm.trainer import (
    CalibrationResult,
    TrainingDiverged,
    calibrate,
)
from llm_calib.confidence.token import encode_open_prompts
from llm_calib.config.calibration import CalibrationConfig, LoraSettings
from llm_calib.data import builtin_multiple_choice, one_record_per_alias
from llm_calib.data.records import OpenQA
from llm_calib.engine.decode import generate_greedy
from llm_calib.engine.generation import finish_answer
from llm_calib.engine.packing import pack_continuations
from llm_calib.files.checkpoint import latest_checkpoint, load_checkpoint
from llm_calib.formats import OpenEnded
from llm_calib.models import tiny_random_model
from llm_calib.prompts.resolution import resolve_prompt_settings
from llm_calib.prompts.templates import PromptFormat, short_answer_format
from llm_calib.scoring.base import encode_continuation
from llm_calib.training_interface import Batch


def open_records(n: int, seed: int = 0) -> list[OpenQA]:
    """Open questions made from the built-in multiple-choice set (the gold option is the answer)."""
    qs = builtin_multiple_choice(n_per_domain=n, domains=["arithmetic", "capitals"], seed=seed)
    return [OpenQA(q.question, (q.options[q.gold], "alias"), q.domain, f"open-{q.id}") for q in qs]


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
    records = open_records(3)
    enc = encode_records(tok, records, task_format(records, resolve_prompt_settings(CalibrationConfig().prompt)))
    return lm, theta, adjustment, losses, enc, tok


def _random_lam(adjustment: LogitAdjustment, seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    V = adjustment.vocab_size
    return {"log_a": 0.2 * torch.randn(V, generator=gen, dtype=torch.float64),
            "b": 0.5 * torch.randn(V, generator=gen, dtype=torch.float64)}


def _full_forward_logits(lm, theta, prompt, answer) -> torch.Tensor:
    """Logits of an unpadded full-sequence ``model(...)`` forward at the answer-predicting positions."""
    saved = lm.theta()
    lm.load_theta(theta)
    try:
        with torch.no_grad():
            logits = lm.model(input_ids=torch.tensor([list(prompt) + list(answer)])).logits[0].double()
    finally:
        lm.load_theta(saved)
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(answer)]


def test_encoding_uses_the_open_ended_scorer_prompt_and_the_first_alias(setup):
    *_, enc, tok = setup
    rec = enc.records[0]
    assert enc.prompts[0] == tuple(encode_open_prompts(tok, [rec], PromptFormat())[0])
    assert tok.decode(enc.options[0][0]) == " " + rec.answers[0]
    batch = enc.batch([0, 1], 0)
    assert isinstance(batch.format, OpenEnded) and batch.labels.tolist() == [0, 0]


EXAMPLES = (("Capital of Italy?", "Rome"), ("What is 1 + 1?", "2"))


def test_short_answer_encoding_ends_the_target_with_the_stop_token_of_the_examples(setup):
    """With ``open_examples`` the prompt is the few-shot prompt and the target is the answer's own
    tokens followed by the newline token that follows each example's answer in that prompt, a
    token at which greedy answering stops (so training teaches the model to stop there)."""
    *_, tok = setup
    records = open_records(2)
    cfg = CalibrationConfig(prompt=dict(open_examples=EXAMPLES))
    enc = encode_records(tok, records, task_format(records, resolve_prompt_settings(cfg.prompt)))
    assert [list(p) for p in enc.prompts] == encode_open_prompts(tok, records, short_answer_format(EXAMPLES))
    prompt = list(enc.prompts[0])
    rome = encode_continuation(tok, " Rome")
    after = next(prompt[i + len(rome)] for i in range(len(prompt)) if prompt[i : i + len(rome)] == rome)
    for rec, (target,) in zip(records, enc.options, strict=True):
        answer = encode_continuation(tok, " " + rec.answers[0])
        assert list(target) == [*answer, after]  # the answer's tokens, then the examples' stop token
        done = finish_answer(tok, list(target), [0.5] * len(target), {tok.eos_token_id})
        assert (done.stop, done.text, done.token_ids) == ("newline", rec.answers[0], tuple(answer))
    # the chat prompt keeps the bare answer (no stop token), and the cache tells the two apart
    chat = encode_records(tok, records, task_format(records, resolve_prompt_settings(CalibrationConfig().prompt)))
    assert [list(o[0]) for o in chat.options] == [encode_continuation(tok, " " + r.answers[0]) for r in records]
    assert enc.batch([0, 1], 0).answer_stop and not chat.batch([0, 1], 0).answer_stop
    cache = EncodingCache()
    def run(config):
        return resolve_run(config, records, records)

    assert cache(tok, records, run(cfg)) is cache(tok, records, run(CalibrationConfig(training=dict(lr=0.1), prompt=dict(open_examples=EXAMPLES))))
    assert cache(tok, records, run(cfg)) is not cache(tok, records, run(CalibrationConfig()))


def test_adjusted_loss_equals_a_hand_computation(setup):
    lm, theta, adjustment, losses, enc, _ = setup
    idx = [0, 3, 4]  # answers of different lengths, so padding and per-question means matter
    assert len({len(enc.options[i][0]) for i in idx}) > 1
    lam = _random_lam(adjustment)
    per_question = []
    for i in idx:
        answer = enc.options[i][0]
        logits = _full_forward_logits(lm, theta, enc.prompts[i], answer)
        logp = torch.log_softmax(logits * lam["log_a"].exp() + lam["b"], -1)
        per_question.append(-logp[torch.arange(len(answer)), torch.tensor(answer)].mean())
    expected = float(torch.stack(per_question).mean())
    for trunk_lm in (None, lm):
        g = losses.inner(theta, lam, enc.batch(idx, 0, trunk_lm))
        assert float(g) == pytest.approx(expected, abs=1e-5)
    assert abs(float(losses.inner(theta, adjustment.init(torch.float64), enc.batch(idx, 0))) - expected) > 1e-3


def test_lambda_at_init_gives_plain_token_cross_entropy(setup):
    lm, theta, adjustment, losses, enc, _ = setup
    idx = [1, 2, 5]
    lam0 = adjustment.init(torch.float64)
    expected = torch.stack([
        torch.nn.functional.cross_entropy(
            _full_forward_logits(lm, theta, enc.prompts[i], enc.options[i][0]), torch.tensor(enc.options[i][0])
        )
        for i in idx
    ]).mean()
    batch = enc.batch(idx, 0, lm)
    assert float(losses.inner(theta, lam0, batch)) == pytest.approx(float(expected), abs=1e-10)
    assert float(losses.one_level(theta, batch)) == pytest.approx(float(expected), abs=1e-10)


def test_baselines_are_token_level_and_match_a_hand_computation(setup):
    lm, theta, _adjustment, losses, enc, _ = setup
    idx = [0, 4]
    smoothing, penalty = [], []
    for i in idx:
        answer = torch.tensor(enc.options[i][0])
        logp = torch.log_softmax(_full_forward_logits(lm, theta, enc.prompts[i], answer.tolist()), -1)
        nll = -logp[torch.arange(len(answer)), answer]
        uniform = -logp.mean(-1)  # label smoothing spreads ε over the whole vocabulary
        ent = -(logp.exp() * logp).sum(-1)
        smoothing.append((0.8 * nll + 0.2 * uniform).mean())
        penalty.append((nll - 0.7 * ent).mean())
    batch = enc.batch(idx, 0, lm)
    assert float(losses.one_level(theta, batch, smoothing=0.2)) == pytest.approx(float(torch.stack(smoothing).mean()), abs=1e-10)
    assert float(losses.one_level(theta, batch, entropy_weight=0.7)) == pytest.approx(float(torch.stack(penalty).mean()), abs=1e-10)


def test_outer_is_the_entropy_at_the_first_answer_position_of_the_prompt_alone(setup):
    lm, theta, adjustment, losses, enc, _ = setup
    idx = [0, 3, 5]
    entropies = []
    saved = lm.theta()
    lm.load_theta(theta)
    for i in idx:  # the prompt alone: f reads no label
        with torch.no_grad():
            logp = torch.log_softmax(lm.model(input_ids=torch.tensor([list(enc.prompts[i])])).logits[0, -1].double(), -1)
        entropies.append(-(logp.exp() * logp).sum())
    lm.load_theta(saved)
    f = losses.outer(theta, _random_lam(adjustment), enc.batch(idx, 0, lm))  # λ plays no part in f
    assert float(f) == pytest.approx(-float(torch.stack(entropies).mean()), abs=1e-10)


def test_trunk_cache_equals_full_forward(setup):
    lm, theta, adjustment, losses, enc, _ = setup
    assert lm.caches_trunk and lm.trunk_layers == 1
    idx = [5, 0, 2, 4]
    cached, full = enc.batch(idx, 0, lm), enc.batch(idx, 0, None)
    assert cached.trunk is not None and full.trunk is None
    head = losses.lm.head_logits  # the logits the losses read (no λ)
    assert torch.allclose(head(theta, cached.packed, cached.trunk), head(theta, full.packed, full.trunk), atol=1e-5, rtol=0)
    lam = _random_lam(adjustment)
    for fn in (lambda b: losses.inner(theta, lam, b), lambda b: losses.outer(theta, lam, b)):
        assert float(fn(cached)) == pytest.approx(float(fn(full)), abs=1e-5)


def test_outer_gradient_matches_finite_differences(setup):
    import hypergrad as hg

    lm, theta, adjustment, losses, enc, _ = setup
    batch = enc.batch([1, 3, 5], 0, lm)
    lam0 = adjustment.init(torch.float64)
    _, grad, _ = hg.autodiff.loss_and_grads(lambda w, l: losses.outer(w, l, batch), theta, lam0, wrt_lam=False)
    # RMSNorm and rotary embeddings run in float32 even in a float64 model, and f is about -log V,
    # so float32 round-off in f - f' is ~1e-7 * 5 / h: h = 1e-3 keeps it and the O(h^2) truncation
    # below 1e-4 relative (measured: 1e-4 is off by 2e-3 from round-off, 1e-2 by 1e-2 from truncation).
    analytic, fd = directional_derivatives(lambda w: losses.outer(w, lam0, batch), theta, grad, h=1e-3)
    assert abs(analytic) > 1e-4
    assert analytic == pytest.approx(fd, rel=2e-3, abs=1e-6)


def test_monitor_proxy_equals_the_greedy_scorer_where_greedy_follows_the_reference(setup):
    lm, theta, _adjustment, losses, enc, tok = setup
    saved = lm.theta()
    lm.load_theta(theta)
    try:
        prompt = list(enc.prompts[0])
        greedy = generate_greedy(lm.model, tok, [prompt], max_new_tokens=3, stop_at_newline=False)[0]
        assert len(greedy.token_ids) >= 2
        good = list(greedy.token_ids)
        bad = [*good[:-1], (good[-1] + 1) % lm.head.out_features]
        stats = losses.monitor(Batch(pack_continuations([(prompt, good), (prompt, bad)], 0), torch.zeros(2), ["g", "b"],
                                     OpenEnded()))
        stops = losses.monitor(Batch(pack_continuations([(prompt, good), (prompt, bad)], 0), torch.zeros(2),
                                     ["g", "b"], OpenEnded(answer_stop=True)))
    finally:
        lm.load_theta(saved)
    assert stats["correct"].tolist() == [1.0, 0.0]
    # the proxy confidence is the scorer's mean token probability of the greedy answer
    expected = sum(greedy.token_probs) / len(greedy.token_probs)
    assert float(stats["confidence"][0]) == pytest.approx(expected, abs=1e-6)
    assert float(stats["confidence"][1]) == pytest.approx(expected, abs=1e-6)  # same argmax path
    assert float(stats["nll"][1]) > float(stats["nll"][0])
    # answer_stop: the last reference token is the stop token; it still decides correctness (greedy
    # must stop with it) but its probability is left out of the confidence, as the scorer does
    assert float(stops["correct"][0]) == 1.0 and float(stops["correct"][1]) == 0.0
    short = sum(greedy.token_probs[:-1]) / (len(greedy.token_probs) - 1)
    assert float(stops["confidence"][0]) == pytest.approx(short, abs=1e-6)
    assert float(stops["confidence"][1]) == pytest.approx(short, abs=1e-6)
    assert abs(short - expected) > 1e-4
    torch.testing.assert_close(stops["nll"], stats["nll"])


# ---- training runs -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data():
    return open_records(4), open_records(2, seed=1)


BASE = {"objective": {"name": "calm", "lam_lr": 0.1},
        "training": {"steps": 2, "batch_size": 4, "heldout_batch_size": 4, "lr": 5e-2},
        "selection": {"eval_every": 1, "guard_accuracy": 0.0}, "checkpoint_every": 1,
        "lora": LoraSettings(rank=2, layers=(1,))}


def _cfg(**kw) -> CalibrationConfig:
    return configured(BASE, **kw)


@pytest.mark.parametrize(
    ("method", "solver"),
    [("calm", "bome"), ("calm", "f2sa"), ("lora_ce", "bome"), ("label_smoothing", "bome"),
     ("confidence_penalty", "bome")],
)
def test_calibrate_each_method_on_open_questions(method, solver, data, tmp_path):
    train, heldout = data
    model, tok = tiny_random_model(seed=0, init_std=0.1)
    result = calibrate(model, tok, train, heldout, _cfg(objective=dict(name=method, solver=dict(name=solver))), checkpoint_dir=tmp_path,
                       progress=False)
    assert [h["step"] for h in result.history] == [1, 2]
    for h in result.history:
        assert all(torch.isfinite(torch.tensor(float(v))) for v in h.values()), h
        assert {"heldout_accuracy", "heldout_ece", "heldout_nll", "heldout_entropy", "heldout_confidence"} <= set(h)
    for phase in ("before", "after"):
        m = result.metrics[phase]
        assert 0.0 <= m["accuracy"] <= 1.0 and 0.0 < m["confidence"] <= 1.0 and m["nll"] > 0
    tensors, _ = load_checkpoint(latest_checkpoint(tmp_path))  # the last θ, whichever step was selected
    moved = [k for k in tensors if k.startswith("theta/") and "lora_B" in k]
    assert moved and max(float(tensors[k].abs().max()) for k in moved) > 1e-4
    if method == "calm":
        assert float(tensors["lam/b"].abs().max()) > 1e-4
    if (method, solver) == ("calm", "bome"):
        assert {"q", "phi"} <= set(result.history[0])


def test_calibrate_with_the_short_answer_prompt_trains_on_every_alias(data, tmp_path, monkeypatch):
    """A run with ``open_examples`` on one record per alias: the trainer encodes the few-shot
    prompt with stop-terminated answers, and its held-out metrics are those of the monitor on them."""
    import llm_calib.calm.training as training_module

    train, heldout = data
    seen = []
    original = training_module.encode_records
    monkeypatch.setattr(training_module, "encode_records", lambda *a, **k: seen.append(original(*a, **k)) or seen[-1])
    model, tok = tiny_random_model(seed=0, init_std=0.1)
    cfg = _cfg(objective=dict(name="lora_ce"), prompt=dict(open_examples=EXAMPLES))
    expanded = one_record_per_alias(train)
    assert len(expanded) == 2 * len(train)
    result = calibrate(model, tok, expanded, heldout, cfg, checkpoint_dir=tmp_path, progress=False)
    assert [h["step"] for h in result.history] == [1, 2]
    assert seen and all(e.answer_stop and e.batch([0], 0).answer_stop for e in seen)
    fewshot = encode_open_prompts(tok, [*expanded, *heldout], short_answer_format(EXAMPLES))
    assert sorted(list(p) for e in seen for p in e.prompts) == sorted(fewshot)
    assert all(0.0 < result.metrics[p]["confidence"] <= 1.0 for p in ("before", "after"))


def test_mixing_record_kinds_raises_naming_the_record(data):
    train, heldout = data
    mc = builtin_multiple_choice(n_per_domain=2, domains=["capitals"])
    model, tok = tiny_random_model(seed=0, init_std=0.1)
    with pytest.raises(ValueError, match=rf"train: record '{mc[0].id}' is MultipleChoice.*one kind"):
        calibrate(model, tok, [*train[:2], *mc], heldout, _cfg(), progress=False)
    with pytest.raises(ValueError, match=rf"heldout: record '{heldout[0].id}' is OpenQA"):
        calibrate(model, tok, mc, heldout, _cfg(), progress=False)
    with pytest.raises(ValueError, match=r"record 'x' is a SimpleNamespace"):
        encode_records(tok, [*train[:1], SimpleNamespace(id="x", question="q?")], task_format([*train[:1], SimpleNamespace(id='x', question='q?')], resolve_prompt_settings(_cfg().prompt)))
    with pytest.raises(ValueError, match=r"record at position 1 is a dict"):
        encode_records(tok, [*train[:1], {"question": "q?"}], task_format([*train[:1], {'question': 'q?'}], resolve_prompt_settings(_cfg().prompt)))
    unanswerable = OpenQA("What happens after death?", (), "selfaware", "sa-1", answerable=False)
    with pytest.raises(ValueError, match="'sa-1' has no reference answer"):
        calibrate(model, tok, train, [*heldout, unanswerable], _cfg(), progress=False)


def _teacher_forced_logprobs(model, enc) -> torch.Tensor:
    packed = pack_continuations([(p, o[0]) for p, o in zip(enc.prompts, enc.options, strict=True)], 0)
    with torch.no_grad():
        logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits
    logp = torch.log_softmax(logits.double(), -1).reshape(-1, logits.shape[-1])[packed.rows]
    return logp[torch.arange(len(packed.target_ids)), packed.target_ids]


def test_save_load_gives_identical_teacher_forced_scores(data, tmp_path):
    train, heldout = data
    model, tok = tiny_random_model(seed=0, init_std=0.1)
    result = calibrate(model, tok, train, heldout, _cfg(objective=dict(name="lora_ce"), training=dict(steps=3, lr=0.1), checkpoint_every=0),
                       progress=False)
    assert result.metrics["after"]["selected_step"] > 0  # the adapter differs from the base model
    loaded = CalibrationResult.load(result.save(tmp_path / "res"), tiny_random_model(seed=0, init_std=0.1)[0])
    enc = encode_records(tok, heldout, task_format(heldout, resolve_prompt_settings(result.config.prompt)))
    original, again = _teacher_forced_logprobs(result.model, enc), _teacher_forced_logprobs(loaded.model, enc)
    base = _teacher_forced_logprobs(tiny_random_model(seed=0, init_std=0.1)[0], enc)
    assert torch.allclose(original, again, atol=1e-6, rtol=0)
    assert not torch.allclose(original, base, atol=1e-4, rtol=0)
    # the trainer's held-out NLL is the mean over questions of the mean token NLL of the reference
    per_question = torch.zeros(len(heldout), dtype=torch.float64).index_add(
        0, torch.repeat_interleave(torch.arange(len(heldout)), torch.tensor([len(o[0]) for o in enc.options])), -again
    ) / torch.tensor([len(o[0]) for o in enc.options])
    assert float(per_question.mean()) == pytest.approx(result.metrics["after"]["nll"], abs=1e-5)
    assert loaded.history == result.history and loaded.config == result.config


def test_resume_equals_an_uninterrupted_run(data, tmp_path):
    train, heldout = data
    cfg = _cfg(objective=dict(name="calm"), training=dict(steps=4), checkpoint_every=2)
    full = calibrate(*tiny_random_model(seed=0, init_std=0.1), train, heldout, cfg, checkpoint_dir=tmp_path / "a",
                     progress=False)
    calibrate(*tiny_random_model(seed=0, init_std=0.1), train, heldout, _cfg(objective=dict(name="calm"), training=dict(steps=2), checkpoint_every=2),
              checkpoint_dir=tmp_path / "b", progress=False)
    resumed = calibrate(*tiny_random_model(seed=0, init_std=0.1), train, heldout, cfg, checkpoint_dir=tmp_path / "b",
                        resume=True, progress=False)
    assert resumed.history == full.history
    t_full, _ = load_checkpoint(latest_checkpoint(tmp_path / "a"))
    t_res, _ = load_checkpoint(latest_checkpoint(tmp_path / "b"))
    assert set(t_full) == set(t_res)
    for k in t_full:
        assert torch.equal(t_full[k], t_res[k]), k


def test_overflowing_learning_rate_raises_training_diverged(data):
    # lr = 1e39 is beyond float32's range: the first update overflows on any CPU (lr = 1e30 did
    # not overflow with MKL's AVX2 kernels)
    train, heldout = data
    with pytest.raises(TrainingDiverged, match=r"^step 1: .*batch ids \['open-"):
        calibrate(*tiny_random_model(seed=0, init_std=0.1), train, heldout, _cfg(objective=dict(name="lora_ce"), training=dict(lr=1e39, steps=4)),
                  progress=False)
