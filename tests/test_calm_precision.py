"""Real-model settings of CALM on the tiny model: bf16, gradient checkpointing, 4-bit, attention
kernels without 4-D masks (one sequence per option), and decoders the trunk cache does not know."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from _configs import configured

from llm_calib.calm import training
from llm_calib.calm.encoding import encode_records
from llm_calib.calm.lora import OUTPUT_LOG_SCALE, FunctionalLM, attach_lora
from llm_calib.calm.run import resolve_run, task_format
from llm_calib.config.calibration import LoraSettings
from llm_calib.data import load
from llm_calib.models import enable_checkpointing, tiny_random_model
from llm_calib.prompts.resolution import resolve_prompt_settings

TRAIN = "builtin:arithmetic,capitals:n=4"
HELDOUT = "builtin:arithmetic,capitals:n=4,seed=1"


BASE = {"objective": {"name": "calm", "lam_lr": 1e-1, "adjustment": "vector",
                      "solver": {"name": "bome", "inner_steps": 1, "barrier": "value"}},
        "training": {"steps": 3, "batch_size": 4, "heldout_batch_size": 4, "lr": 1e-2},
        "selection": {"eval_every": 1, "guard_accuracy": 0.0}, "lora": {"rank": 2, "layers": [1]}}


def _config(**kw):
    return configured(BASE, **kw)


def _run(model, tok, cfg, steps=3):
    trainer = training.build_trainer(model, tok, load(TRAIN).records, load(HELDOUT).records, resolve_run(cfg, load(TRAIN).records, load(HELDOUT).records))
    state = training.init_state(trainer)
    records = [training.train_step(trainer, state) for _ in range(steps)]
    return trainer, state, records, training.evaluate(trainer, state.theta)


def _tensors(tree):
    for v in tree.values():
        if isinstance(v, dict):
            yield from _tensors(v)
        elif isinstance(v, torch.Tensor):
            yield v


def test_bf16_calibrate_keeps_float32_masters_and_tracks_float32():
    """A bfloat16 base: finite losses; θ (LoRA, output log-scale), λ and every optimiser state in
    float32; within bf16 rounding of the float32 run on the same seed.

    Tolerances (bf16 keeps 8 significant bits, ~4e-3 relative per rounding): training losses g
    within 5 % relative, held-out NLL / entropy / confidence within 2 % relative, LoRA θ within
    5e-3 absolute. λ itself is not compared entry by entry: its Adam step normalises BOME's
    direction, a difference of two nearly equal gradients, so rounding flips its sign at
    near-zero coordinates (the same happens in float32 when a batch is reordered, see
    tests/test_calm_distributed.py)."""
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, tok = tiny_random_model(seed=0, init_std=0.1)
        runs[dtype] = _run(model.to(dtype), tok, _config())
    trainer, state, records, after = runs[torch.bfloat16]
    _, ref_state, ref_records, ref_after = runs[torch.float32]
    assert trainer.lm.dtype == torch.bfloat16
    assert all(math.isfinite(r["g"]) and math.isfinite(r["unlabeled_entropy"]) for r in records)
    assert {v.dtype for v in trainer.lm.theta().values()} == {torch.float32}  # from the start
    assert {v.dtype for v in state.theta.values()} == {torch.float32}
    assert state.theta[OUTPUT_LOG_SCALE].dtype == torch.float32
    assert {v.dtype for v in state.objective_state.lam.values()} == {torch.float32}
    opt_states = list(_tensors(state.objective_state.solver_state)) + [t for s in state.objective_state.lam_optimizer.state.values()
                                                       for t in s.values() if t.dim() > 0]
    assert opt_states and {t.dtype for t in opt_states if t.is_floating_point()} == {torch.float32}
    for r, ref in zip(records, ref_records, strict=True):
        assert abs(r["g"] - ref["g"]) <= 0.05 * abs(ref["g"]), (r["g"], ref["g"])
    for key in ("nll", "entropy", "confidence"):
        assert abs(after[key] - ref_after[key]) <= 0.02 * abs(ref_after[key]), (key, after[key], ref_after[key])
    for k, v in ref_state.theta.items():
        if k != OUTPUT_LOG_SCALE:
            assert float((state.theta[k] - v).abs().max()) < 5e-3, k
    moved = [k for k in ref_state.theta if "lora_B" in k]
    assert all(float(state.theta[k].abs().max()) > 1e-3 for k in moved)  # it trained


def _g_and_grads(lm_layers, checkpointing, seed=0):
    """g and dg/dθ at a perturbed θ (so that θ differs from the module's own parameters)."""
    model, tok = tiny_random_model(seed=0, init_std=0.1)
    if checkpointing:
        enable_checkpointing(model)
    cfg = _config(lora=dict(rank=2, layers=lm_layers))
    trainer = training.build_trainer(model, tok, load(TRAIN).records, load(HELDOUT).records, resolve_run(cfg, load(TRAIN).records, load(HELDOUT).records))
    theta0 = trainer.lm.theta()
    gen = torch.Generator().manual_seed(seed)
    theta = {k: (v + 0.2 * torch.randn(v.shape, generator=gen)).requires_grad_(True) for k, v in theta0.items()}
    lam = {k: v.clone() for k, v in trainer.adjustment.init(dtype=torch.float32).items()}
    batch = trainer.train_batch(0)
    calls = []
    # transformers checkpoints a layer's forward, so the recomputation shows at its submodules
    hooks = [layer.self_attn.register_forward_hook(lambda *_: calls.append(1)) for layer in trainer.lm.decoder.layers]
    with trainer.lm.train_mode():
        loss = trainer.losses.inner(theta, lam, batch)
        grads = torch.autograd.grad(loss, list(theta.values()))
    for h in hooks:
        h.remove()
    return trainer, float(loss.detach()), dict(zip(theta, grads, strict=True)), len(calls)


@pytest.mark.parametrize("layers", [[1], None], ids=["top-layer-trunk-cache", "all-layers-full-forward"])
def test_gradient_checkpointing_gives_the_same_gradients(layers):
    plain, g0, grads0, calls0 = _g_and_grads(layers, checkpointing=False)
    ckpt, g1, grads1, calls1 = _g_and_grads(layers, checkpointing=True)
    assert not plain.lm.checkpointing and ckpt.lm.checkpointing
    assert plain.lm.caches_trunk == ckpt.lm.caches_trunk == (layers == [1])
    # the trained layers really were recomputed in the backward pass (forward hooks fire again)
    trained = 1 if layers == [1] else 2
    assert calls1 == calls0 + trained, (calls0, calls1)
    assert g1 == pytest.approx(g0, rel=1e-6)
    for k, v in grads0.items():
        assert float(v.abs().max()) > 0, k
        torch.testing.assert_close(grads1[k], v, rtol=1e-5, atol=1e-5, msg=k)


def test_train_mode_applies_lora_dropout_only_in_steps():
    """eval() used to switch LoRA dropout off silently; now a step trains with it, evaluation
    never does, and dropout=0 computes in train mode exactly what it computes in eval mode."""
    for dropout in (0.0, 0.5):
        model, tok = tiny_random_model(seed=0, init_std=0.1)
        cfg = _config(lora=dict(rank=2, layers=[1], dropout=dropout))
        trainer = training.build_trainer(model, tok, load(TRAIN).records, load(HELDOUT).records, resolve_run(cfg, load(TRAIN).records, load(HELDOUT).records))
        theta = {k: v + 0.3 for k, v in trainer.lm.theta().items()}  # nonzero LoRA output
        lam = trainer.adjustment.init(dtype=torch.float32)
        batch = trainer.train_batch(0)
        evals = [float(trainer.losses.inner(theta, lam, batch)) for _ in range(2)]
        with trainer.lm.train_mode():
            steps = [float(trainer.losses.inner(theta, lam, batch)) for _ in range(2)]
        assert evals[0] == evals[1]
        assert not any(m.training for m in trainer.model.modules())  # restored
        if dropout == 0.0:
            assert steps == evals
        else:
            assert steps[0] != steps[1] and steps[0] != evals[0]


@pytest.mark.parametrize("layers", [[1], None], ids=["trunk-cache", "full-forward"])
@pytest.mark.parametrize("normalize", ["sum", "mean"])
def test_option_sequences_equal_the_packed_layout(layers, normalize, mc_records):
    """The layout for attention kernels without 4-D masks (flash attention) gives the packed
    layout's option scores (float32, 1e-5) and gradients."""
    model, tok = tiny_random_model(seed=0, init_std=0.1)
    cfg = _config(lora=dict(rank=2, layers=layers), prompt=dict(normalize=normalize))
    trainer = training.build_trainer(model, tok, mc_records[:5], mc_records[5:], resolve_run(cfg, mc_records[:5], mc_records[5:]))
    lm, losses = trainer.lm, trainer.losses
    assert lm.packed_masks
    gen = torch.Generator().manual_seed(1)
    theta = {k: (v + 0.1 * torch.randn(v.shape, generator=gen)).requires_grad_(True) for k, v in lm.theta().items()}
    out = {}
    for packed_masks in (True, False):
        lm.packed_masks = packed_masks
        enc = encode_records(tok, mc_records, task_format(mc_records, resolve_prompt_settings(cfg.prompt)))  # fresh trunk cache, computed in this layout
        batch = enc.batch(range(len(mc_records)), trainer.pad_id, lm)
        scores = losses.scores(theta, None, batch)
        grads = torch.autograd.grad(scores.logsumexp(-1).sum(), list(theta.values()))
        out[packed_masks] = (scores.detach(), grads, batch.trunk)
    torch.testing.assert_close(out[False][0], out[True][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(out[False][1], out[True][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if layers == [1]:  # the cached trunk, computed one sequence per option, is the same too
        torch.testing.assert_close(out[False][2], out[True][2], rtol=1e-5, atol=1e-5)


def _padding_only_attention():
    """Register ``padding_only``: SDPA behind the interface of flash attention, which takes a 2-D
    padding mask (or none) and refuses anything else, like flash_attention_2 on a GPU."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    def padding_only(module, query, key, value, attention_mask, **kwargs):
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(f"padding_only attention takes 2-D padding masks, got {attention_mask.dim()}-D")
        L = query.shape[-2]
        allowed = torch.ones(L, L, dtype=torch.bool, device=query.device).tril()[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        allowed = allowed | torch.eye(L, dtype=torch.bool, device=query.device)  # padding rows stay finite
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key, value, allowed, is_causal=False, **kwargs)

    AttentionInterface.register("padding_only", padding_only)
    ALL_MASK_ATTENTION_FUNCTIONS.register("padding_only", flash_attention_mask)
    return "padding_only"


def test_attention_without_4d_masks_is_detected_and_exact(tiny_model_dir, mc_records):
    """With an attention kernel that takes padding masks only, scoring and training switch to
    one sequence per option by themselves, and compute what the packed layout computes (1e-5)."""
    from llm_calib.engine.packing import accepts_packed_masks
    from llm_calib.models import load as load_model
    from llm_calib.prompts.templates import PromptFormat
    from llm_calib.scoring.option_likelihood import encode_questions, option_log_likelihoods

    impl = _padding_only_attention()
    flash_like, tok = load_model(str(tiny_model_dir))
    flash_like.set_attn_implementation(impl)
    sdpa, _ = load_model(str(tiny_model_dir), attn_implementation="sdpa")
    assert not accepts_packed_masks(flash_like) and accepts_packed_masks(sdpa)
    items = encode_questions(tok, mc_records, PromptFormat())
    for a, b in zip(option_log_likelihoods(flash_like, items, pad_id=tok.pad_token_id),
                    option_log_likelihoods(sdpa, items, pad_id=tok.pad_token_id), strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    # training: two CALM steps (trunk cache on, LoRA on layer 1) reach the same θ
    results = [_run(m, tok, _config(), steps=2) for m in (flash_like, sdpa)]
    assert not results[0][0].lm.packed_masks and results[0][0].lm.caches_trunk
    for k, v in results[1][1].theta.items():
        torch.testing.assert_close(results[0][1].theta[k], v, rtol=1e-5, atol=1e-5, msg=k)
    # the kernel really refuses the packed layout
    packed = results[0][0].train_batch(0).packed
    with pytest.raises(ValueError, match="takes 2-D padding masks"):
        flash_like.model(input_ids=packed.input_ids, attention_mask=packed.additive_mask(torch.float32),
                         position_ids=packed.position_ids)


def _tiny_gemma(tok):
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    cfg = GemmaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.1,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=1)
    return GemmaForCausalLM(cfg).eval()


def test_unknown_decoder_falls_back_to_the_full_forward(caplog, mc_records):
    """Gemma scales its embeddings inside the decoder's forward: running only its top layers on
    cached embeddings would be silently wrong, so the trunk cache is off, said in the log, and
    the scores are those of the model's own forward."""
    _, tok = tiny_random_model()
    model = _tiny_gemma(tok)
    # Gemma's norm multiplies by 1 + weight: an output scale through its weight would be wrong
    with pytest.raises(ValueError, match="output_scale needs a final norm whose output scales"):
        attach_lora(_tiny_gemma(tok), LoraSettings(rank=2, layers=(1,)), output_scale=True)
    with caplog.at_level(logging.INFO, logger="llm_calib.calm.lora"):
        lm = FunctionalLM(attach_lora(model, LoraSettings(rank=2, layers=(1,))))
    assert not lm.caches_trunk
    assert any("trunk cache off for GemmaModel" in r.getMessage() for r in caplog.records)
    cfg = _config(lora=dict(rank=2, layers=[1], output_scale=False))
    enc = encode_records(tok, mc_records, task_format(mc_records, resolve_prompt_settings(cfg.prompt)))
    batch = enc.batch(range(len(mc_records)), tok.pad_token_id, lm)
    assert batch.trunk is None
    hidden = lm.hidden_rows(None, batch.packed)
    p = batch.packed
    with torch.no_grad():
        ref = lm.decoder(input_ids=p.input_ids, attention_mask=p.additive_mask(torch.float32),
                         position_ids=p.position_ids, use_cache=False).last_hidden_state
    torch.testing.assert_close(hidden, ref.reshape(-1, ref.shape[-1])[p.rows], rtol=1e-5, atol=1e-5)
    # and a whole calibration run on it trains with finite losses
    trainer, _, records, _ = _run(_tiny_gemma(tok), tok, cfg, steps=2)
    assert not trainer.lm.caches_trunk
    assert all(math.isfinite(r["g"]) for r in records)


def _bnb_cpu_reason() -> str | None:
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed (pip install 'llm-calib[quant]')"
    try:
        import bitsandbytes as bnb

        layer = bnb.nn.Linear4bit(64, 64, compute_dtype=torch.bfloat16, quant_type="nf4")
        layer = layer.to("cpu")
        layer.weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_type="nf4").to("cpu")
        layer(torch.randn(2, 64, dtype=torch.bfloat16))
    except Exception as exc:  # any failure means: no CPU 4-bit backend here
        return f"this bitsandbytes build has no working CPU 4-bit backend ({type(exc).__name__}: {exc})"
    return None


def test_4bit_base_calibrates(tmp_path):
    reason = _bnb_cpu_reason()
    if reason:
        pytest.skip(reason)
    from llm_calib.models import load as load_model

    base, tok = tiny_random_model(seed=0, hidden_size=64, init_std=0.1)  # 4-bit blocks need width >= 64
    base.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, tok = load_model(str(tmp_path), load_in_4bit=True)
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    assert not any(p.requires_grad for p in model.parameters())
    trainer, state, records, after = _run(model, tok, _config(), steps=2)
    assert trainer.lm.dtype == torch.bfloat16  # the compute dtype, not the packed uint8 storage
    assert all(math.isfinite(r["g"]) for r in records)
    assert {v.dtype for v in state.theta.values()} == {torch.float32}
    assert all(float(state.theta[k].abs().max()) > 1e-4 for k in state.theta if "lora_B" in k)
    assert math.isfinite(after["nll"])


def test_4bit_gradients_are_those_of_the_dequantised_weights(tmp_path):
    """The LoRA gradients through the 4-bit base equal, to bf16 rounding (10 % in norm: the two
    compute in bf16 with different kernels; measured 3-7 %), those through a bf16 model holding
    the de-quantised weights: nothing is lost in the quantised matmuls' backward, also after an
    evaluation without gradients (which makes bitsandbytes repack CPU weights for a kernel
    without backward unless :func:`llm_calib.models.load` turns that off)."""
    reason = _bnb_cpu_reason()
    if reason:
        pytest.skip(reason)
    import bitsandbytes as bnb

    from llm_calib.models import load as load_model

    base, tok = tiny_random_model(seed=0, hidden_size=64, init_std=0.1)
    base.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    quantised, _ = load_model(str(tmp_path), load_in_4bit=True)
    reference, _ = load_model(str(tmp_path), dtype="bfloat16")
    q_modules = dict(quantised.named_modules())
    replaced = 0
    for name, module in reference.named_modules():
        q = q_modules.get(name)
        if type(q).__name__ == "Linear4bit":
            module.weight.data = bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state).to(torch.bfloat16)
            replaced += 1
    assert replaced == 14  # 7 projections x 2 layers
    out = {}
    for key, model in (("4bit", quantised), ("dequantised", reference)):
        trainer = training.build_trainer(model, tok, load(TRAIN).records, load(HELDOUT).records, resolve_run(_config(), load(TRAIN).records, load(HELDOUT).records))
        training.init_state(trainer)  # an evaluation without gradients first, as in every run
        theta = {k: (v + 0.05).requires_grad_(True) for k, v in trainer.lm.theta().items()}
        loss = trainer.losses.inner(theta, trainer.adjustment.init(dtype=torch.float32), trainer.train_batch(0))
        out[key] = (float(loss.detach()), torch.autograd.grad(loss, list(theta.values())))
    assert out["4bit"][0] == pytest.approx(out["dequantised"][0], rel=2e-2)
    for a, b in zip(out["4bit"][1], out["dequantised"][1], strict=True):
        assert float(b.norm()) > 0
        assert float((a - b).norm()) <= 0.1 * float(b.norm()), float((a - b).norm() / b.norm())
