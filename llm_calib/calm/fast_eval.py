"""Fast evaluation of many top-layer LoRA models that share one frozen base (trunk caching).

When every model to evaluate adapts only the top ``k`` layers of the same base model, the hidden
states entering the first adapted layer are the base model's, whatever the adapters. They are
computed once per question, in the same full-model pass that gives the base model's own
predictions, and each adapted model then runs only its top layers:

* multiple choice: :func:`base_scores` (full model: option scores, and the trunk kept in the
  :class:`~llm_calib.calm.encoding.EncodedRecords`' ``trunk_cache``) and :func:`trunk_scores`
  (an adapted model's option scores from that trunk);
* both at once, over named record sets: :class:`SharedTrunkEval` (``base`` once, then ``adapted``
  per trained model), with :func:`fill_trunk_caches` for the training encodings;
* open questions: :class:`TrunkGenerator`, KV-cached greedy decoding with the stopping rule and
  answer bookkeeping of :func:`~llm_calib.scoring.open_ended.generate_greedy`; its base pass keeps,
  per prompt batch, the trunk and the bottom layers' key/value cache, so an adapted model's answer
  runs its top layers over the prompt and decodes on. It can also record each answer token's
  probability on a grid of temperatures (for temperature scaling of open answers, fitted with
  :func:`fit_open_temperature`; :func:`open_ended_set` turns answers into an
  :class:`~llm_calib.scoring.open_ended.OpenEndedSet`).

Both give the numbers of the plain scorers on the merged model (to float rounding); the tests
compare them with :func:`~llm_calib.scoring.option_likelihood.score_option_likelihood` and
:func:`~llm_calib.scoring.open_ended.score_open_ended`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from llm_calib.calm.config import CalibrationConfig, LoraSettings, open_prompt_format
from llm_calib.calm.encoding import TRUNK_CHUNK, EncodedRecords, encode_records
from llm_calib.calm.lora import FunctionalLM, attach_lora
from llm_calib.data.records import OpenQA, record_kind
from llm_calib.models import lm_head_logits, split_decoder_head
from llm_calib.scoring.base import ScoredSet
from llm_calib.scoring.open_ended import (
    OpenEndedSet,
    encode_open_prompts,
    eos_token_ids,
    finish_answer,
)
from llm_calib.scoring.packing import option_scores_from_logits

__all__ = [
    "GenBatch",
    "GenOut",
    "SharedTrunkEval",
    "TrunkGenerator",
    "base_scores",
    "capture_layer_input",
    "fill_trunk_caches",
    "fit_open_temperature",
    "length_batches",
    "open_ended_set",
    "trunk_scores",
]


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


def open_ended_set(records: Sequence[OpenQA], outs: Sequence[GenOut], temperature_index: int | None = None) -> OpenEndedSet:
    """The :class:`~llm_calib.scoring.open_ended.OpenEndedSet` of greedy answers to ``records``;
    with ``temperature_index``, the token probabilities at that temperature of the base pass's grid.

    Raises:
        ValueError: ``records`` and ``outs`` differ in length, or an answer has no grid probabilities.

    Example:
        >>> outs = [GenOut("Paris", (1,), (0.9,), np.array([[0.9, 0.6]]))]
        >>> s = open_ended_set([OpenQA("Capital of France?", ("Paris",), "geo", "q0")], outs, temperature_index=1)
        >>> s.correct.tolist(), s.token_probs
        ([True], [(0.6,)])
    """
    if len(records) != len(outs):
        raise ValueError(f"records and outs must have the same length, got {len(records)} and {len(outs)}")
    if temperature_index is None:
        token_probs = [o.token_probs for o in outs]
    else:
        if any(o.temp_probs is None for o in outs):
            raise ValueError("temperature_index needs answers from a base pass with a temperature grid")
        token_probs = [tuple(float(p) for p in o.temp_probs[:, temperature_index]) for o in outs]
    return OpenEndedSet([o.text for o in outs], [tuple(r.answers) for r in records], [r.domain for r in records],
                        [r.id for r in records], token_probs)


def fit_open_temperature(records: Sequence[OpenQA], outs: Sequence[GenOut], grid: Sequence[float]) -> tuple[float, int]:
    """Temperature scaling of open answers: the grid temperature minimising the log-loss of
    correctness of the mean-token-probability confidence (answers do not change with T; their
    confidences do).

    Args:
        records: the held-out questions.
        outs: their greedy answers from :meth:`TrunkGenerator.base` with the temperature grid ``grid``.
        grid: the temperatures of that grid, in its order.

    Returns:
        ``(T, index)``: the best temperature and its index in ``grid``.

    Raises:
        ValueError: an answer's grid probabilities do not match ``grid``.

    Example:
        >>> recs = [OpenQA("q?", ("a",), "d", "0"), OpenQA("q?", ("a",), "d", "1")]
        >>> outs = [GenOut("a", (1,), (0.9,), np.array([[0.99, 0.6]])), GenOut("b", (1,), (0.9,), np.array([[0.99, 0.6]]))]
        >>> fit_open_temperature(recs, outs, [1.0, 2.0])
        (2.0, 1)
    """
    grid = np.asarray(grid, dtype=np.float64)
    if any(o.temp_probs is None or o.temp_probs.shape[1] != len(grid) for o in outs):
        raise ValueError(f"every answer needs grid probabilities for the {len(grid)} grid temperatures")
    correct = open_ended_set(records, outs).correct.astype(np.float64)[:, None]
    conf = np.clip(np.stack([o.temp_probs.mean(0) for o in outs]), 1e-12, 1 - 1e-12)  # (N, G)
    loss = -(correct * np.log(conf) + (1 - correct) * np.log(1 - conf)).mean(0)
    g = int(np.argmin(loss))
    return float(grid[g]), g


def fill_trunk_caches(model: Any, encodings: Sequence[EncodedRecords], lora: LoraSettings, pad_id: int,
                      bar: Any = None) -> int:
    """Fill the trunk caches of ``encodings`` once, for every later run with LoRA on ``lora.layers``
    of ``model`` (the trunk depends on the frozen base only). ``model`` is not modified.

    Args:
        model: the base causal LM.
        encodings: encodings from :func:`~llm_calib.calm.encoding.encode_records`.
        lora: the adapted layers of the runs (must be the top layers for a trunk to exist).
        pad_id: padding id.
        bar: optional progress bar (``update(n)`` per :data:`~llm_calib.calm.encoding.TRUNK_CHUNK`).

    Returns:
        How many questions were computed (0 when every trunk was cached, or none can be).

    Example:
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> enc = encode_records(tok, builtin_multiple_choice(n_per_domain=3, domains=["capitals"]), CalibrationConfig())
        >>> fill_trunk_caches(model, [enc], LoraSettings(layers=(1,)), tok.pad_token_id), len(enc.trunk_cache)
        (3, 3)
    """
    import copy

    lm = FunctionalLM(attach_lora(copy.deepcopy(model), lora))
    if not lm.caches_trunk:
        return 0
    n = 0
    for enc in encodings:
        for start in range(0, len(enc), TRUNK_CHUNK):
            chunk = range(start, min(start + TRUNK_CHUNK, len(enc)))
            todo = sum(i not in enc.trunk_cache for i in chunk)
            enc.fill_trunk_cache(lm, pad_id, chunk)
            n += todo
            if bar is not None:
                bar.update(todo)
    return n


class SharedTrunkEval:
    """Score named record sets with a base model once (:meth:`base`) and then with many models
    adapted only from layer ``trunk_layers`` up (:meth:`adapted`), each running only its top layers.

    Multiple-choice sets give :class:`~llm_calib.scoring.base.ScoredSet` s (option likelihood,
    ``config``'s prompt style and normalisation), open-question sets
    :class:`~llm_calib.scoring.open_ended.OpenEndedSet` s (greedy answers, one
    :class:`TrunkGenerator` over all sets in order). The numbers are those of the plain scorers.

    Args:
        model: the base causal LM (not modified).
        tokenizer: its tokenizer.
        sets: set name -> records (all multiple choice or all open questions); a multiple-choice set
            may be given as an :class:`~llm_calib.calm.encoding.EncodedRecords`, whose trunk cache
            the base pass then fills (e.g. the held-out split that training reuses).
        trunk_layers: the first adapted layer (at least 1, below the number of layers).
        config: encoding settings (its ``prompt`` part: scorer, style, chat template, normalisation;
            open questions: the prompt of :func:`~llm_calib.calm.config.open_prompt_format`);
            default :class:`~llm_calib.calm.config.CalibrationConfig`.
        batch_size: questions (prompts) per forward pass.
        max_new_tokens: open questions: the generation budget.
        temperatures: open questions: a temperature grid recorded by :meth:`base` (for
            :func:`fit_open_temperature` and :meth:`scaled`).

    Raises:
        ValueError: no sets, an empty set, sets of both kinds, or ``trunk_layers`` out of range.

    Example:
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> ev = SharedTrunkEval(model, tok, {"caps": builtin_multiple_choice(n_per_domain=2, domains=["capitals"])}, 1)
        >>> base = ev.base()
        >>> adapted = ev.adapted(attach_lora(model, LoraSettings(layers=(1,))))
        >>> [float((a - b).abs().max()) < 1e-5 for a, b in zip(base["caps"].logits, adapted["caps"].logits)]
        [True, True]
    """

    def __init__(self, model: Any, tokenizer: Any, sets: Mapping[str, Sequence[Any] | EncodedRecords], trunk_layers: int,
                 *, config: CalibrationConfig | None = None, batch_size: int = 16, max_new_tokens: int = 10,
                 temperatures: Sequence[float] | None = None) -> None:
        if not sets or any(len(v) == 0 for v in sets.values()):
            raise ValueError("sets must name at least one non-empty record set")
        n_layers = int(model.config.num_hidden_layers)
        if not 0 < trunk_layers < n_layers:
            raise ValueError(f"trunk_layers must be in [1, {n_layers - 1}], got {trunk_layers}")
        self.model, self.tokenizer, self.trunk_layers = model, tokenizer, trunk_layers
        self.config = config or CalibrationConfig()
        self.batch_size = batch_size
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        records = {k: v.records if isinstance(v, EncodedRecords) else list(v) for k, v in sets.items()}
        kinds = {record_kind(v) for v in records.values()}
        if len(kinds) != 1:
            raise ValueError("sets must be all multiple choice or all open questions")
        self.kind = kinds.pop()
        self.records = records
        self.base_outputs: dict[str, list[GenOut]] = {}
        if self.kind == "open":
            flat = [r for recs in records.values() for r in recs]
            prompts = encode_open_prompts(tokenizer, flat, open_prompt_format(self.config))
            self.generator = TrunkGenerator(tokenizer, prompts, batch_size, max_new_tokens, trunk_layers, temperatures)
        else:
            self.encodings = {k: v if isinstance(v, EncodedRecords) else encode_records(tokenizer, v, self.config)
                              for k, v in sets.items()}

    def __len__(self) -> int:
        return sum(len(v) for v in self.records.values())

    def _split(self, outs: Sequence[GenOut]) -> dict[str, list[GenOut]]:
        out, start = {}, 0
        for name, recs in self.records.items():
            out[name] = list(outs[start : start + len(recs)])
            start += len(recs)
        return out

    def _mc(self, name: str, scores: list[Tensor]) -> ScoredSet:
        recs = self.records[name]
        return ScoredSet(scores, [r.gold for r in recs], [r.domain for r in recs], [r.id for r in recs],
                         "option_likelihood")

    def base(self, *, keep_trunk: bool = True, bar: Any = None) -> dict[str, ScoredSet | OpenEndedSet]:
        """The base model's scored sets; with ``keep_trunk`` the trunk is kept for :meth:`adapted`."""
        k = self.trunk_layers if keep_trunk else 0
        if self.kind == "open":
            outs = self.generator.base(self.model, keep_trunk=keep_trunk, temperatures=True, bar=bar)
            self.base_outputs = self._split(outs)
            return {n: open_ended_set(self.records[n], o) for n, o in self.base_outputs.items()}
        return {n: self._mc(n, base_scores(self.model, enc, k, self.batch_size, self.pad_id, self.config.prompt.normalize, bar))
                for n, enc in self.encodings.items()}

    def scaled(self, temperature_index: int) -> dict[str, OpenEndedSet]:
        """Open questions: the base answers with the token probabilities at grid temperature
        ``temperature_index`` (after :meth:`base`). Multiple choice: use ``ScoredSet.scaled``."""
        if not self.base_outputs:
            raise RuntimeError("scaled() needs the answers of base() on open questions")
        return {n: open_ended_set(self.records[n], o, temperature_index) for n, o in self.base_outputs.items()}

    def adapted(self, model: Any, *, normalize: str | None = None, bar: Any = None) -> dict[str, ScoredSet | OpenEndedSet]:
        """The scored sets of a model adapted from layer ``trunk_layers`` up (after :meth:`base`).

        Args:
            model: the base model with LoRA (peft) on the top layers only.
            normalize: multiple choice: option-score normalisation (default: the config's).
            bar: optional progress bar.

        Raises:
            ValueError: ``model``'s adapted layers do not start at ``trunk_layers``.
        """
        if self.kind == "open":
            return {n: open_ended_set(self.records[n], o)
                    for n, o in self._split(self.generator.trained(model, bar)).items()}
        lm = FunctionalLM(model)
        if lm.trunk_layers != self.trunk_layers:
            raise ValueError(f"the model's adapted layers start at {lm.trunk_layers}, expected {self.trunk_layers}")
        norm = normalize or self.config.prompt.normalize
        return {n: self._mc(n, trunk_scores(lm, enc, self.batch_size, self.pad_id, norm, bar))
                for n, enc in self.encodings.items()}
