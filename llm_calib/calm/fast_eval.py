"""Fast evaluation of many top-layer LoRA models that share one frozen base (trunk caching).

When every model to evaluate adapts only the top ``k`` layers of the same base model, the hidden
states entering the first adapted layer are the base model's, whatever the adapters. They are
computed once per question, in the same full-model pass that gives the base model's own
predictions, and each adapted model then runs only its top layers:

* multiple choice: :func:`base_scores` (full model: option scores, and the trunk kept in the
  :class:`~llm_calib.calm.encoding.EncodedRecords`' ``trunk_cache``) and :func:`trunk_scores`
  (an adapted model's option scores from that trunk);
* open questions: :class:`TrunkGenerator`, KV-cached greedy decoding with the stopping rule and
  answer bookkeeping of :func:`~llm_calib.scoring.open_ended.generate_greedy`; its base pass keeps,
  per prompt batch, the trunk and the bottom layers' key/value cache, so an adapted model's answer
  runs its top layers over the prompt and decodes on. It can also record each answer token's
  probability on a grid of temperatures (for temperature scaling of open answers).

Both give the numbers of the plain scorers on the merged model (to float rounding); the tests
compare them with :func:`~llm_calib.scoring.option_likelihood.score_option_likelihood` and
:func:`~llm_calib.scoring.open_ended.score_open_ended`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from llm_calib.calm.encoding import EncodedRecords
from llm_calib.calm.lora import FunctionalLM
from llm_calib.models import lm_head_logits, split_decoder_head
from llm_calib.scoring.open_ended import eos_token_ids, finish_answer
from llm_calib.scoring.packing import option_scores_from_logits

__all__ = ["GenBatch", "GenOut", "TrunkGenerator", "base_scores", "capture_layer_input", "length_batches", "trunk_scores"]


def length_batches(lengths: Sequence[int], size: int) -> Iterator[list[int]]:
    """Indices in order of increasing length, in batches of ``size`` (little padding per batch).

    Example:
        >>> list(length_batches([5, 1, 3], 2))
        [[1, 2], [0]]
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    for start in range(0, len(order), size):
        yield order[start : start + size]


@contextlib.contextmanager
def capture_layer_input(decoder: Any, index: int) -> Iterator[dict[str, Tensor]]:
    """Record (as ``box["hidden"]``) the hidden states entering ``decoder.layers[index]`` during a
    forward pass: cheaper than ``output_hidden_states``, which keeps every layer's states."""
    box: dict[str, Tensor] = {}

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        box["hidden"] = args[0] if args else kwargs["hidden_states"]

    handle = decoder.layers[index].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield box
    finally:
        handle.remove()


def base_scores(model: Any, enc: EncodedRecords, trunk_layers: int, batch_size: int, pad_id: int,
                normalize: str = "sum", bar: Any = None) -> list[Tensor]:
    """Full-model option scores of every question (float64, one tensor per question) and, in the
    same forward pass, the hidden states entering layer ``trunk_layers`` (kept in ``enc.trunk_cache``).

    Args:
        model: the base causal LM.
        enc: multiple-choice records encoded with :func:`~llm_calib.calm.encoding.encode_records`.
        trunk_layers: index of the first adapted layer of the models to evaluate later (0: keep no trunk).
        batch_size: questions per forward pass (batched by length).
        pad_id: padding id.
        normalize: ``"sum"`` or ``"mean"`` option scores.
        bar: optional progress bar (``update(n)``).

    Example:
        >>> from llm_calib.calm.config import CalibrationConfig
        >>> from llm_calib.calm.encoding import encode_records
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> enc = encode_records(tok, builtin_multiple_choice(n_per_domain=2, domains=["capitals"]), CalibrationConfig())
        >>> scores = base_scores(model, enc, trunk_layers=1, batch_size=2, pad_id=tok.pad_token_id)
        >>> len(scores), len(enc.trunk_cache)
        (2, 2)
    """
    decoder, head = split_decoder_head(model)
    dtype = next(model.parameters()).dtype
    scores: list[Tensor | None] = [None] * len(enc.records)
    with torch.inference_mode():
        for idx in length_batches([enc.length(i) for i in range(len(enc))], batch_size):
            packed = enc.pack(idx, pad_id)
            with capture_layer_input(decoder, trunk_layers) as box:
                out = decoder(input_ids=packed.input_ids, attention_mask=packed.additive_mask(dtype),
                              position_ids=packed.position_ids, use_cache=False)
            if trunk_layers > 0:
                trunk = box["hidden"]
                for row, i in enumerate(idx):
                    enc.trunk_cache[i] = trunk[row, : enc.length(i)].clone()
            hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])[packed.rows]
            s = option_scores_from_logits(lm_head_logits(model, head, hidden), packed, normalize)
            for row, i in enumerate(idx):
                scores[i] = s[row, : len(enc.options[i])].double().cpu()
            if bar is not None:
                bar.update(len(idx))
    return [s for s in scores if s is not None]


def trunk_scores(lm: FunctionalLM, enc: EncodedRecords, batch_size: int, pad_id: int, normalize: str = "sum",
                 bar: Any = None) -> list[Tensor]:
    """Option scores of a top-layer LoRA model from the cached trunk: only layers
    ``lm.trunk_layers ..`` run (missing trunk entries are computed on the fly).

    Raises:
        ValueError: ``lm`` does not cache a trunk (LoRA must sit on the top layers only).
    """
    if not lm.caches_trunk:
        raise ValueError("the model does not cache a trunk (LoRA must sit on the top layers only)")
    scores: list[Tensor | None] = [None] * len(enc.records)
    with torch.inference_mode():
        for idx in length_batches([enc.length(i) for i in range(len(enc))], batch_size):
            batch = enc.batch(idx, pad_id, lm)
            s = option_scores_from_logits(lm.head_logits(None, batch.packed, batch.trunk), batch.packed, normalize)
            for row, i in enumerate(idx):
                scores[i] = s[row, : len(enc.options[i])].double().cpu()
            if bar is not None:
                bar.update(len(idx))
    return [s for s in scores if s is not None]


@dataclass
class GenBatch:
    """One batch of left-padded prompts, with the trunk state saved by the base pass.

    Attributes:
        idx: prompt indices of the rows.
        ids, attn: left-padded token ids and attention mask ``(B, P)``.
        trunk: hidden states entering the first adapted layer ``(B, P, hidden)``.
        kv: keys and values of the frozen bottom layers.
    """

    idx: list[int]
    ids: Tensor
    attn: Tensor
    trunk: Tensor | None = None
    kv: list[tuple[Tensor, Tensor]] | None = None


@dataclass
class GenOut:
    """A greedy answer: text, kept token ids and probabilities, and (with a temperature grid) the
    kept positions' greedy-token probabilities at every grid temperature, ``(kept, len(grid))``."""

    text: str
    token_ids: tuple[int, ...]
    token_probs: tuple[float, ...]
    temp_probs: np.ndarray | None = None


def _cache_kw(module: Any) -> str:
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def _left_padded_causal_mask(attn: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive ``(B, 1, L, L)`` mask: causal, padded keys hidden, a padded query sees itself."""
    keys = attn.bool()
    L = keys.shape[1]
    allowed = torch.ones(L, L, dtype=torch.bool).tril()[None] & keys[:, None, :]
    allowed |= torch.eye(L, dtype=torch.bool)[None]
    return torch.zeros((keys.shape[0], 1, L, L), dtype=dtype).masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


class TrunkGenerator:
    """Greedy answers to a fixed list of prompts, batch by batch, as
    :func:`~llm_calib.scoring.open_ended.generate_greedy` decodes them (same stopping rule at EOS
    or newline, same answer and probability bookkeeping), with the KV cache of transformers'
    :class:`~transformers.DynamicCache`; rows that have stopped leave the batch.

    :meth:`base` answers with the full base model and (``keep_trunk``) keeps each batch's trunk
    state; :meth:`trained` then answers with a model adapted only from layer ``trunk_layers`` up,
    starting from that state. With ``temperatures`` (a grid of T) the base pass also records each
    answer token's greedy-token probability at every T (answers do not change with T).

    Args:
        tokenizer: the tokenizer.
        prompts: token ids of each prompt (e.g. :func:`~llm_calib.scoring.open_ended.encode_open_prompts`).
        batch_size: prompts per batch (batched by length).
        max_new_tokens: generation budget per prompt.
        trunk_layers: the first adapted layer of the models :meth:`trained` will see.
        temperatures: the temperature grid of the base pass (optional).

    Example:
        >>> from llm_calib.data import OpenQA
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.scoring.open_ended import encode_open_prompts
        >>> model, tok = tiny_random_model()
        >>> prompts = encode_open_prompts(tok, [OpenQA("Capital of France?", ("Paris",), "geo", "q0")])
        >>> gen = TrunkGenerator(tok, prompts, batch_size=1, max_new_tokens=3, trunk_layers=1)
        >>> outs = gen.base(model, keep_trunk=True)
        >>> len(outs), len(outs[0].token_probs) >= 1
        (1, True)
    """

    def __init__(self, tokenizer: Any, prompts: Sequence[Sequence[int]], batch_size: int, max_new_tokens: int,
                 trunk_layers: int, temperatures: Sequence[float] | None = None) -> None:
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.max_new_tokens = max_new_tokens
        self.trunk_layers = trunk_layers
        self.temperatures = None if temperatures is None else torch.tensor(np.asarray(temperatures), dtype=torch.float32)
        self.n = len(prompts)
        self.newline: dict[int, bool] = {}
        self.batches = []
        for idx in length_batches([len(p) for p in prompts], batch_size):
            B, L = len(idx), max(len(prompts[i]) for i in idx)
            ids = torch.full((B, L), self.pad_id, dtype=torch.long)
            attn = torch.zeros((B, L), dtype=torch.long)
            for b, i in enumerate(idx):
                p = list(prompts[i])
                ids[b, L - len(p) :] = torch.tensor(p)
                attn[b, L - len(p) :] = 1
            self.batches.append(GenBatch(idx, ids, attn))

    def _is_newline(self, tok: int) -> bool:
        if tok not in self.newline:
            self.newline[tok] = "\n" in self.tokenizer.decode([tok])
        return self.newline[tok]

    def base(self, model: Any, *, keep_trunk: bool, temperatures: bool = True, bar: Any = None) -> list[GenOut]:
        """Greedy answers of the full model; with ``keep_trunk`` each batch keeps its trunk state;
        with ``temperatures`` (and a grid given) the grid probabilities are recorded too."""
        from transformers import DynamicCache

        decoder, _ = split_decoder_head(model)
        kw = _cache_kw(decoder)
        k = self.trunk_layers
        outs: list[GenOut | None] = [None] * self.n
        with torch.inference_mode():
            for gb in self.batches:
                cache = DynamicCache(config=model.config)
                pos = (gb.attn.cumsum(-1) - 1).clamp(min=0)
                with capture_layer_input(decoder, k) as box:
                    out = decoder(input_ids=gb.ids, attention_mask=gb.attn, position_ids=pos, use_cache=True, **{kw: cache})
                if keep_trunk and k > 0:
                    gb.trunk = box["hidden"].clone()
                    gb.kv = [(key, value) for _, (key, value, *_) in zip(range(k), cache, strict=False)]
                self._decode(model, gb, cache, out.last_hidden_state[:, -1], temperatures, outs)
                if bar is not None:
                    bar.update(len(gb.idx))
        return [o for o in outs if o is not None]

    def trained(self, model: Any, bar: Any = None) -> list[GenOut]:
        """Greedy answers of a model whose layers below ``trunk_layers`` are the base model's: the
        bottom layers' prompt cache and the trunk come from :meth:`base`, only the top layers run
        over the prompt, then decoding continues through the whole model.

        Raises:
            RuntimeError: :meth:`base` did not keep the trunk.
        """
        from transformers import DynamicCache

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        decoder, _ = split_decoder_head(base)
        k = self.trunk_layers
        dtype = next(base.parameters()).dtype
        outs: list[GenOut | None] = [None] * self.n
        with torch.inference_mode():
            for gb in self.batches:
                if gb.trunk is None or gb.kv is None:
                    raise RuntimeError("run base(keep_trunk=True) first")
                cache = DynamicCache(config=base.config)
                for j, (key, value) in enumerate(gb.kv):
                    cache.update(key, value, j)
                pos = (gb.attn.cumsum(-1) - 1).clamp(min=0)
                hidden = gb.trunk
                mask = _left_padded_causal_mask(gb.attn, dtype)
                pe = decoder.rotary_emb(hidden, position_ids=pos)
                for j in range(k, len(decoder.layers)):
                    layer = decoder.layers[j]
                    hidden = layer(hidden, attention_mask=mask, position_ids=pos, use_cache=True,
                                   position_embeddings=pe, **{_cache_kw(layer): cache})
                    if isinstance(hidden, tuple):
                        hidden = hidden[0]
                hidden = decoder.norm(hidden)
                self._decode(base, gb, cache, hidden[:, -1], False, outs)
                if bar is not None:
                    bar.update(len(gb.idx))
        return [o for o in outs if o is not None]

    def _decode(self, model: Any, gb: GenBatch, cache: Any, last_hidden: Tensor, temperatures: bool,
                outs: list[GenOut | None]) -> None:
        decoder, head = split_decoder_head(model)
        kw = _cache_kw(decoder)
        eos = eos_token_ids(model, self.tokenizer)
        temps = self.temperatures if temperatures else None
        B = len(gb.idx)
        active = list(range(B))
        gen: list[list[int]] = [[] for _ in range(B)]
        probs: list[list[float]] = [[] for _ in range(B)]
        tprobs: list[list[np.ndarray]] = [[] for _ in range(B)]
        attn = gb.attn
        logits = lm_head_logits(model, head, last_hidden)
        for step in range(self.max_new_tokens):
            z = logits.float()
            top_p, top = torch.softmax(z, dim=-1).max(dim=-1)
            pt = None
            if temps is not None:  # probability of the greedy (argmax) token at every grid temperature
                zmax = z.max(-1, keepdim=True).values
                pt = torch.exp(zmax / temps - torch.logsumexp(z[:, :, None] / temps, dim=1)).numpy()
            done_rows = []
            for r, b in enumerate(active):
                tok = int(top[r])
                gen[b].append(tok)
                probs[b].append(float(top_p[r]))
                if pt is not None:
                    tprobs[b].append(pt[r])
                if tok in eos or self._is_newline(tok):
                    done_rows.append(r)
            keep = [r for r in range(len(active)) if r not in set(done_rows)]
            if not keep or step == self.max_new_tokens - 1:
                break
            if done_rows:
                sel = torch.tensor(keep)
                cache.batch_select_indices(sel)
                attn, top = attn[sel], top[sel]
                active = [active[r] for r in keep]
            attn = torch.cat([attn, torch.ones((len(active), 1), dtype=attn.dtype)], dim=1)
            pos = attn.sum(-1, keepdim=True) - 1
            out = decoder(input_ids=top[:, None], attention_mask=attn, position_ids=pos, use_cache=True, **{kw: cache})
            logits = lm_head_logits(model, head, out.last_hidden_state[:, -1])
        for b, i in enumerate(gb.idx):
            ans = finish_answer(self.tokenizer, gen[b], probs[b], eos, True)
            temp_probs = None
            if temps is not None:
                kept = finish_answer(self.tokenizer, gen[b], [float(p) for p in range(len(gen[b]))], eos, True).token_probs
                temp_probs = np.stack([tprobs[b][int(p)] for p in kept])
            outs[i] = GenOut(ans.text, ans.token_ids, ans.token_probs, temp_probs)
