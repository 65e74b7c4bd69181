"""LoRA attachment and the functional view: the output scale is an exact in-model temperature."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from llm_calib.calm.encoding import encode_records
from llm_calib.calm.lora import OUTPUT_LOG_SCALE, FunctionalLM, attach_lora
from llm_calib.calm.run import resolve_run, task_format
from llm_calib.config.calibration import CalibrationConfig, LoraSettings
from llm_calib.data import builtin_multiple_choice
from llm_calib.models import tiny_random_model
from llm_calib.prompts.resolution import resolve_prompt_settings


@pytest.fixture(scope="module")
def scaled():
    torch.manual_seed(0)
    model, tok = tiny_random_model(num_layers=3)
    model = model.double()
    lm = FunctionalLM(attach_lora(model, LoraSettings(rank=2, layers=(1, 2)), output_scale=True))
    theta = {k: (0.05 * torch.randn_like(v) if "lora_" in k else v) for k, v in lm.theta().items()}
    enc = encode_records(tok, builtin_multiple_choice(n_per_domain=2), task_format(builtin_multiple_choice(n_per_domain=2), resolve_prompt_settings(CalibrationConfig().prompt)))
    return lm, theta, enc


def test_only_lora_and_the_final_norm_copy_are_added(scaled):
    lm, theta, _ = scaled
    names = [n for n, _ in lm.model.named_parameters() if "modules_to_save" in n]
    assert names == ["base_model.model.model.norm.modules_to_save.default.weight"]  # not the layer norms
    assert set(theta) == {OUTPUT_LOG_SCALE} | {k for k in theta if "lora_" in k}
    assert theta[OUTPUT_LOG_SCALE].shape == () and float(theta[OUTPUT_LOG_SCALE]) == 0.0
    assert lm.caches_trunk  # the scale sits above the top layers: the bottom is still cached


@pytest.mark.parametrize("cached", [True, False], ids=["trunk-cached", "full-forward"])
def test_output_log_scale_multiplies_every_logit(scaled, cached):
    lm, theta, enc = scaled
    batch = enc.batch(range(4), 0, lm if cached else None)
    plain = lm.head_logits(theta, batch.packed, batch.trunk)
    doubled = lm.head_logits({**theta, OUTPUT_LOG_SCALE: torch.tensor(math.log(2.0), dtype=torch.float64)},
                             batch.packed, batch.trunk)
    torch.testing.assert_close(doubled, 2.0 * plain, atol=1e-10, rtol=1e-10)


def test_loaded_scale_is_what_the_deployed_model_computes(scaled):
    lm, theta, enc = scaled
    batch = enc.batch(range(4), 0, None)
    theta = {**theta, OUTPUT_LOG_SCALE: torch.tensor(-0.4, dtype=torch.float64)}
    functional = lm.head_logits(theta, batch.packed)
    lm.load_theta(theta)
    try:
        deployed = lm.head_logits(None, batch.packed)  # the peft model's own modules
        torch.testing.assert_close(deployed, functional, atol=1e-10, rtol=1e-10)
        assert float(lm.theta()[OUTPUT_LOG_SCALE]) == pytest.approx(-0.4, abs=1e-12)  # recovered from the weights
    finally:
        lm.load_theta({k: torch.zeros_like(v) if k == OUTPUT_LOG_SCALE else v for k, v in theta.items()})


def test_gradient_of_the_log_scale_matches_finite_differences(scaled):
    lm, theta, enc = scaled
    batch = enc.batch(range(4), 0, lm)

    def loss(s: torch.Tensor) -> torch.Tensor:
        logits = lm.head_logits({**theta, OUTPUT_LOG_SCALE: s}, batch.packed, batch.trunk)
        return torch.logsumexp(logits, -1).mean()

    s = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(loss(s), s)
    eps = 1e-5
    with torch.no_grad():
        fd = (loss(s + eps) - loss(s - eps)) / (2 * eps)
    assert float(grad) == pytest.approx(float(fd), rel=1e-6)
    assert abs(float(grad)) > 1e-3


def test_attaching_lora_raises_no_transformers_deprecation_warning():
    model, _ = tiny_random_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # peft reads is_gradient_checkpointing
        attach_lora(model, LoraSettings(rank=2))


def test_without_output_scale_theta_is_lora_only():
    model, _ = tiny_random_model()
    lm = FunctionalLM(attach_lora(model, LoraSettings(rank=2)))
    assert all("lora_" in k for k in lm.theta())
    with pytest.raises(ValueError, match=OUTPUT_LOG_SCALE):
        lm.load_theta({OUTPUT_LOG_SCALE: torch.zeros(())})


def test_trunk_of_the_bottom_layers_alone_equals_the_full_forward(scaled):
    lm, _, enc = scaled
    packed = enc.batch(range(6), 0, None).packed
    assert type(lm.decoder).__name__ == "LlamaModel"  # the bottom-layers-only path is the one tested
    with torch.no_grad():
        full = lm.decoder(input_ids=packed.input_ids, attention_mask=packed.additive_mask(lm.dtype),
                          position_ids=packed.position_ids, use_cache=False, output_hidden_states=True)
    torch.testing.assert_close(lm.trunk_hidden(packed), full.hidden_states[lm.trunk_layers], atol=1e-12, rtol=0)


def test_top_layers_adapts_only_the_top_layers_and_explicit_layers_win() -> None:
    model, _ = tiny_random_model()
    n = model.config.num_hidden_layers

    def adapted(settings: LoraSettings) -> list[int]:
        peft_model = attach_lora(tiny_random_model()[0], settings)
        return sorted({int(name.split(".layers.")[1].split(".")[0]) for name, p in peft_model.named_parameters()
                       if p.requires_grad and "lora_" in name})

    assert adapted(LoraSettings(top_layers=1)) == [n - 1]
    assert adapted(LoraSettings(top_layers=n + 5)) == list(range(n))  # fewer layers than asked: all of them
    assert adapted(LoraSettings(top_layers=None)) == list(range(n))
    assert adapted(LoraSettings(layers=(0,), top_layers=1)) == [0]
    with pytest.raises(ValueError, match=r"out of range for a model with \d+ layers"):
        attach_lora(model, LoraSettings(layers=(n,)))
    with pytest.raises(ValueError, match="top_layers must be an int >= 1"):
        LoraSettings(top_layers=0)


# ---------------------------------------------------------------------------------------------
# training.compile: the trained layers as compiled graphs, the same numbers


def _compiled_runs(objective: dict, layers: tuple[int, ...], backend: str | None, monkeypatch) -> tuple:
    """θ, λ and the per-step losses of 3 steps, eager and with training.compile (``backend``: the
    torch.compile backend; aot_eager captures the same graphs without inductor's code generation)."""
    from llm_calib.calm import training

    calls = {"n": 0}
    real = torch.compile

    def counting_compile(fn, **kwargs):
        compiled = real(fn, **({**kwargs, "backend": backend} if backend else kwargs))

        def run(*args, **kw):
            calls["n"] += 1
            return compiled(*args, **kw)

        return run

    qs = builtin_multiple_choice(n_per_domain=4, seed=0, domains=["capitals", "arithmetic"])
    out = []
    for compile_ in (False, True):
        model, tok = tiny_random_model(seed=0, init_std=0.1)
        cfg = CalibrationConfig.from_dict({"objective": objective, "lora": {"rank": 2, "layers": list(layers)},
                                           "training": {"batch_size": 4, "heldout_batch_size": 4, "lr": 1e-2,
                                                        "compile": compile_}})
        with monkeypatch.context() as m:
            m.setattr(torch, "compile", counting_compile)
            trainer = training.build_trainer(model, tok, qs[::2], qs[1::2], resolve_run(cfg, qs[::2], qs[1::2]))
            assert trainer.lm.compiled is compile_
            state = training.init_state(trainer, evaluate_before=False)
            records = [training.train_step(trainer, state) for _ in range(3)]
            metrics = training.evaluate(trainer)  # the no-grad pass compiled too
        out.append((state.theta, state.objective_state.lam, records, metrics))
    return (*out, calls["n"])


@pytest.mark.parametrize("objective", [{"name": "calm"}, {"name": "lora_ce"}], ids=["calm", "lora_ce"])
@pytest.mark.parametrize("layers", [(0, 1), (1,)], ids=["every-layer", "trunk-cached"])
def test_the_compiled_step_computes_the_eager_step(objective, layers, monkeypatch):
    (t0, l0, r0, m0), (t1, l1, r1, m1), calls = _compiled_runs(objective, layers, "aot_eager", monkeypatch)
    assert calls >= 3 * (7 if objective["name"] == "calm" else 1)  # every loss evaluation went through it
    for k in t0:
        torch.testing.assert_close(t1[k], t0[k], rtol=1e-5, atol=1e-6, msg=k)
    for k in l0:
        torch.testing.assert_close(l1[k], l0[k], rtol=1e-5, atol=1e-6, msg=k)
    for a, b in zip(r0, r1, strict=True):
        assert a.keys() == b.keys() and all(b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6) for k in a)
    assert m1 == pytest.approx(m0, rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_the_inductor_compiled_step_computes_the_eager_step(monkeypatch):
    """The real thing (inductor's generated kernels, about a minute of compiling on a CPU)."""
    from hypergrad.compiled import compiler_available

    if not compiler_available()[0]:
        pytest.skip("no C++ compiler for inductor")
    (t0, l0, r0, _), (t1, l1, r1, _), _ = _compiled_runs({"name": "calm"}, (1,), None, monkeypatch)
    for k in l0:
        torch.testing.assert_close(l1[k], l0[k], rtol=1e-4, atol=1e-5, msg=k)
    for k in t0:
        torch.testing.assert_close(t1[k], t0[k], rtol=1e-4, atol=1e-5, msg=k)
    for a, b in zip(r0, r1, strict=True):
        assert all(b[k] == pytest.approx(a[k], rel=1e-3, abs=1e-5) for k in a)


def test_compile_refuses_what_it_cannot_compile():
    from llm_calib.calm import training
    from llm_calib.models import enable_checkpointing

    qs = builtin_multiple_choice(n_per_domain=2, seed=0, domains=["capitals"])
    model, tok = tiny_random_model(seed=0)
    implicit = CalibrationConfig.from_dict({"objective": {"name": "calm", "solver": {"name": "implicit"}},
                                            "training": {"compile": True}})
    with pytest.raises(ValueError, match=r"training\.compile: the compiled step takes first derivatives"):
        training.build_trainer(model, tok, qs[:1], qs[1:], resolve_run(implicit, qs[:1], qs[1:]))
    model, tok = tiny_random_model(seed=0)
    enable_checkpointing(model)
    with pytest.raises(ValueError, match="does not combine with gradient checkpointing"):
        compiled = CalibrationConfig.from_dict({"training": {"compile": True}})
        training.build_trainer(model, tok, qs[:1], qs[1:], resolve_run(compiled, qs[:1], qs[1:]))
    with pytest.raises(ValueError, match=r"training\.compile must be true or false"):
        CalibrationConfig.from_dict({"training": {"compile": "yes"}})


def test_a_compiled_graph_reused_by_a_later_run_computes_with_that_runs_weights(monkeypatch):
    """One process, several runs (llm_calib.evaluation.compare does that): dynamo reuses the graph of the first
    run; the frozen weights and θ are its inputs, never constants of the first model."""
    from llm_calib.calm import training

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "aot_eager"}))
    qs = builtin_multiple_choice(n_per_domain=4, seed=0, domains=["capitals"])

    def run(seed: int, compile_: bool) -> tuple[float, float]:
        model, tok = tiny_random_model(seed=seed)
        cfg = CalibrationConfig.from_dict({"objective": {"name": "lora_ce"}, "lora": {"rank": 2, "layers": [1]},
                                           "training": {"batch_size": 2, "heldout_batch_size": 2, "compile": compile_}})
        trainer = training.build_trainer(model, tok, qs[:2], qs[2:], resolve_run(cfg, qs[:2], qs[2:]))
        state = training.init_state(trainer, evaluate_before=False)
        return training.train_step(trainer, state)["loss"], training.evaluate(trainer)["nll"]

    compiled = [run(seed, True) for seed in (0, 1, 2)]
    eager = [run(seed, False) for seed in (0, 1, 2)]
    assert len({c[0] for c in compiled}) == 3  # different models, different losses
    for c, e in zip(compiled, eager, strict=True):
        assert c == pytest.approx(e, rel=1e-5)
