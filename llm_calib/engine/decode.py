"""The one greedy decoder: a KV-cached loop that stops at EOS or a newline (or at a record's stop
sequences, lm-eval's ``until``), with per-token
probabilities, an optional grid of temperatures, and trunk caching as an option.

* :func:`greedy_loop` is the decoding loop itself: the step-by-step argmax, the stopping rule,
  the per-token probabilities (and, with a temperature grid, the greedy token's probability at
  every grid temperature), and dropping stopped rows from the batch (optional). It asks a *step*
  function for the next logits, so it serves any way of running the model.
* :func:`generate_greedy` runs it over any causal LM (``model(...)`` with the model's own cache).
* :class:`TrunkGenerator` runs it over the decoder and head of a fixed list of prompts; its base
  pass can keep each batch's trunk (the hidden states entering layer ``trunk_layers`` and the
  bottom layers' keys and values), so a model adapted only from that layer up answers by running
  its top layers over the prompt and decoding on.

:func:`finish_answer` turns the generated ids into a :class:`GreedyAnswer` (the stop token is
dropped, text before a newline inside it is kept).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from llm_calib.engine.generation import (
    GreedyAnswer,
    StopRule,
    cached_step,
    eos_token_ids,
    finish_answer,
    left_pad,
)
from llm_calib.engine.options import capture_layer_input
from llm_calib.engine.packing import causal_additive_mask, length_batches
from llm_calib.engine.prefix import cache_keyword
from llm_calib.models import lm_head_logits, split_decoder_head

__all__ = [
    "GenBatch",
    "GenOut",
    "TrunkGenerator",
    "generate_greedy",
    "greedy_loop",
]


@dataclass
class GenOut:
    """A greedy answer: text, kept token ids and probabilities, and (with a temperature grid) the
    kept positions' greedy-token probabilities at every grid temperature, ``(kept, len(grid))``.

    Example:
        >>> GenOut("Paris", (7,), (0.5,)).temp_probs is None
        True
    """

    text: str
    token_ids: tuple[int, ...]
    token_probs: tuple[float, ...]
    temp_probs: np.ndarray | None = None


Step = Callable[[Tensor, "Tensor | None"], Tensor]
"""``step(tokens, keep) -> logits``: feed the chosen tokens ``(B',)`` of the rows still in the
batch and return their next logits ``(B', V)``; ``keep`` (row indices, or None) names the rows
that stay in the batch, when stopped rows leave it before this step."""


def greedy_loop(
    step: Step,
    logits: Tensor,
    tokenizer: Any,
    eos: set[int],
    *,
    max_new_tokens: int,
    stop_at_newline: bool = True,
    temperatures: Tensor | None = None,
    drop_finished: bool = False,
    newline: dict[int, bool] | None = None,
    until: Sequence[Sequence[str] | None] | None = None,
) -> list[tuple[GreedyAnswer, np.ndarray | None]]:
    """Greedy decoding from the first next-token logits of a batch: THE loop of the engine.

    Each step takes the argmax token of every row still running and its probability (softmax of
    the float32 logits); a row stops at an EOS token, at a token whose text holds a newline
    (``stop_at_newline``) or after ``max_new_tokens`` tokens. With ``temperatures`` (a 1-D grid)
    it also records the greedy token's probability at every grid temperature. Stopped rows keep
    being fed (their tokens ignored) unless ``drop_finished``, which removes them from the batch
    (``step`` then gets the kept row indices).

    Args:
        step: the model: ``step(tokens, keep) -> logits`` (see :data:`Step`).
        logits: next-token logits after the prompts, ``(B, V)``.
        tokenizer: the tokenizer (for the newline test).
        eos: end-of-sequence ids (:func:`eos_token_ids`).
        max_new_tokens: generation budget per row.
        stop_at_newline: stop at the first token containing a newline.
        temperatures: optional temperature grid ``(G,)``.
        drop_finished: remove stopped rows from the batch.
        newline: a cache ``token -> contains a newline`` shared between calls (optional).
        until: per row, stop sequences (lm-eval's ``until``) or None: a row with stop sequences
            stops at EOS or once its generated text holds one of them (not at a newline unless
            it is one), and its answer is the text before the first (:func:`finish_answer`).

    Returns:
        Per row, its :class:`GreedyAnswer` (bookkeeping by :func:`finish_answer`) and, with
        ``temperatures``, the kept positions' grid probabilities ``(kept, G)`` (else None).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> eos = {tok.eos_token_id}
        >>> first = torch.zeros(2, tok.vocab_size); first[0, eos.pop()] = 9.0; first[1, 50] = 9.0
        >>> outs = greedy_loop(lambda tokens, keep: first[1:2].clone(), first, tok, {tok.eos_token_id},
        ...                    max_new_tokens=3, drop_finished=True)
        >>> [(len(a.token_ids), a.stop) for a, _ in outs], outs[1][0].token_ids == (50, 50, 50)
        ([(0, 'eos'), (3, 'length')], True)
    """
    stops = list(until) if until is not None else [None] * logits.shape[0]
    if len(stops) != logits.shape[0]:
        raise ValueError(f"until: {len(stops)} rows of stop sequences for a batch of {logits.shape[0]}")
    rows = _DecodedRows(tokenizer, eos, stop_at_newline, {} if newline is None else newline, stops)
    active = list(range(len(stops)))
    for t in range(max_new_tokens):
        z = logits.float()
        top_p, top = torch.softmax(z, dim=-1).max(dim=-1)
        rows.record(active, top, top_p, _greedy_grid_probs(z, temperatures))
        if all(rows.done) or t == max_new_tokens - 1:
            break
        keep = None
        if drop_finished and any(rows.done[b] for b in active):
            kept = [r for r, b in enumerate(active) if not rows.done[b]]
            keep = torch.tensor(kept)
            top = top[keep.to(top.device)]
            active = [active[r] for r in kept]
        logits = step(top, keep)
    return rows.finish(with_grid=temperatures is not None)


def _greedy_grid_probs(z: Tensor, temperatures: Tensor | None) -> np.ndarray | None:
    """Per row, the probability of the greedy (argmax) token of float32 logits ``z`` at every grid temperature."""
    if temperatures is None:
        return None
    temps = temperatures.to(z.device)
    zmax = z.max(-1, keepdim=True).values
    return torch.exp(zmax / temps - torch.logsumexp(z[:, :, None] / temps, dim=1)).cpu().numpy()


class _DecodedRows:
    """:func:`greedy_loop`'s per-row record: the tokens, their probabilities (and grid probabilities),
    whether each row has stopped (by the engine's :class:`~llm_calib.engine.generation.StopRule`)."""

    def __init__(self, tokenizer: Any, eos: set[int], stop_at_newline: bool, newline: dict[int, bool],
                 stops: list[Sequence[str] | None]) -> None:
        self.tokenizer, self.eos, self.stop_at_newline, self.stops = tokenizer, eos, stop_at_newline, stops
        self.rule = StopRule(tokenizer, eos, stop_at_newline, newline)
        B = len(stops)
        self.done = [False] * B
        self.gen: list[list[int]] = [[] for _ in range(B)]
        self.probs: list[list[float]] = [[] for _ in range(B)]
        self.tprobs: list[list[np.ndarray]] = [[] for _ in range(B)]

    def record(self, active: list[int], top: Tensor, top_p: Tensor, pt: np.ndarray | None) -> None:
        """Append each running row's greedy token (``active[r]`` is the row of batch position ``r``)."""
        for r, b in enumerate(active):
            if self.done[b]:
                continue
            tok = int(top[r])
            self.gen[b].append(tok)
            self.probs[b].append(float(top_p[r]))
            if pt is not None:
                self.tprobs[b].append(pt[r])
            self.done[b] = self.rule.stops(self.gen[b], self.stops[b])

    def finish(self, *, with_grid: bool) -> list[tuple[GreedyAnswer, np.ndarray | None]]:
        """Each row's :class:`GreedyAnswer` and (``with_grid``) its kept positions' grid probabilities."""
        outs = []
        for b, stops in enumerate(self.stops):
            ans = finish_answer(self.tokenizer, self.gen[b], self.probs[b], self.eos, self.stop_at_newline, stops)
            temp_probs = None
            if with_grid:  # which positions finish_answer keeps: run it on the positions themselves
                kept = finish_answer(self.tokenizer, self.gen[b], [float(p) for p in range(len(self.gen[b]))],
                                     self.eos, self.stop_at_newline, stops)
                temp_probs = np.stack([self.tprobs[b][int(p)] for p in kept.token_probs])
            outs.append((ans, temp_probs))
        return outs


def generate_greedy(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 32,
    stop_at_newline: bool = True,
    until: Sequence[Sequence[str] | None] | None = None,
    temperatures: Sequence[float] | None = None,
) -> list[GreedyAnswer]:
    """Greedy decoding of a batch of tokenised prompts, with per-token probabilities.

    :func:`greedy_loop` over ``model(...)`` with the model's KV cache and left padding, so it
    works for any causal LM. A row stops at an EOS token, at a token whose text contains a newline
    (if ``stop_at_newline``), or after ``max_new_tokens`` tokens. The stop token is not part of the
    answer, except that text before a newline inside the same token is kept (with its probability).
    If the answer has no tokens, ``token_probs`` holds the probability of the stop token.

    Args:
        model: a Hugging Face causal LM.
        tokenizer: its tokenizer.
        prompts: token ids of each prompt.
        max_new_tokens: generation budget per prompt (>= 1).
        stop_at_newline: stop at the first newline.
        until: per prompt, stop sequences (e.g. a record's lm-eval ``until``) or None; a prompt
            with them stops at EOS or at the first of them instead (see :func:`greedy_loop`).
        temperatures: a grid of temperatures (each > 0): every answer also records its tokens'
            probabilities at each of them (``GreedyAnswer.temp_probs``), e.g. to fit a temperature
            to the answers' token confidence.

    Returns:
        One :class:`GreedyAnswer` per prompt.

    Raises:
        ValueError: ``max_new_tokens < 1``, an empty prompt or a temperature that is not > 0.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> out = generate_greedy(model, tok, [tok("What is 2 + 3?")["input_ids"]], max_new_tokens=4,
        ...                       temperatures=[0.5, 1.0, 2.0])
        >>> len(out[0].token_probs) >= 1, out[0].temp_probs.shape[1]
        (True, 3)
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    grid = None
    if temperatures is not None:
        grid = torch.tensor([float(t) for t in temperatures], dtype=torch.float32)
        if grid.ndim != 1 or not len(grid) or not bool(torch.isfinite(grid).all() and (grid > 0).all()):
            raise ValueError(f"temperatures must be a non-empty list of finite numbers > 0, got {list(temperatures)!r}")
    if not prompts:
        return []
    device = next(model.parameters()).device
    ids, attn = left_pad(prompts, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    eos = eos_token_ids(model, tokenizer)
    cached = cached_step(model)
    state = {"attn": attn.to(device), "past": None}

    def forward(step_ids: Tensor) -> Tensor:
        logits, state["past"] = cached(step_ids, state["attn"], state["past"])
        return logits

    def step(tokens: Tensor, keep: Tensor | None) -> Tensor:
        attn = state["attn"]
        state["attn"] = torch.cat([attn, torch.ones((attn.shape[0], 1), dtype=attn.dtype, device=device)], dim=1)
        return forward(tokens[:, None])

    with torch.inference_mode():
        outs = greedy_loop(step, forward(ids.to(device)), tokenizer, eos, max_new_tokens=max_new_tokens,
                           stop_at_newline=stop_at_newline, until=until, temperatures=grid)
    return [ans if probs is None else replace(ans, temp_probs=probs) for ans, probs in outs]


@dataclass
class GenBatch:
    """One batch of left-padded prompts, with the trunk state saved by the base pass.

    Attributes:
        idx: prompt indices of the rows.
        ids, attn: left-padded token ids and attention mask ``(B, P)``.
        trunk: hidden states entering the first adapted layer ``(B, P, hidden)``.
        kv: keys and values of the frozen bottom layers.

    Example:
        >>> GenBatch([0], torch.tensor([[5, 6]]), torch.tensor([[1, 1]])).trunk is None
        True
    """

    idx: list[int]
    ids: Tensor
    attn: Tensor
    trunk: Tensor | None = None
    kv: list[tuple[Tensor, Tensor]] | None = None


class TrunkGenerator:
    """Greedy answers to a fixed list of prompts, batch by batch, by :func:`greedy_loop` over the
    decoder and head with transformers' :class:`~transformers.DynamicCache` (the stopping rule and
    answer bookkeeping of :func:`generate_greedy`); rows that have stopped leave the batch.

    :meth:`base` answers with the full base model and (``keep_trunk``) keeps each batch's trunk
    state; :meth:`trained` then answers with a model adapted only from layer ``trunk_layers`` up,
    starting from that state. With ``temperatures`` (a grid of T) the base pass also records each
    answer token's greedy-token probability at every T (answers do not change with T).

    Args:
        tokenizer: the tokenizer.
        prompts: token ids of each prompt (e.g. :func:`~llm_calib.confidence.token.encode_open_prompts`).
        batch_size: prompts per batch (batched by length).
        max_new_tokens: generation budget per prompt.
        trunk_layers: the first adapted layer of the models :meth:`trained` will see (0: none).
        temperatures: the temperature grid of the base pass (optional).
        until: per prompt, stop sequences or None (see :func:`greedy_loop`); None: none.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> prompts = [tok("Capital of France? The answer is:")["input_ids"]]
        >>> gen = TrunkGenerator(tok, prompts, batch_size=1, max_new_tokens=3, trunk_layers=1)
        >>> outs = gen.base(model, keep_trunk=True)
        >>> len(outs), len(outs[0].token_probs) >= 1
        (1, True)
    """

    def __init__(self, tokenizer: Any, prompts: Sequence[Sequence[int]], batch_size: int, max_new_tokens: int,
                 trunk_layers: int, temperatures: Sequence[float] | None = None,
                 until: Sequence[Sequence[str] | None] | None = None) -> None:
        self.tokenizer = tokenizer
        self.until = list(until) if until is not None else [None] * len(prompts)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.max_new_tokens = max_new_tokens
        self.trunk_layers = trunk_layers
        self.temperatures = None if temperatures is None else torch.tensor(np.asarray(temperatures), dtype=torch.float32)
        self.n = len(prompts)
        self.newline: dict[int, bool] = {}
        self.batches = []
        for idx in length_batches([len(p) for p in prompts], batch_size):
            self.batches.append(GenBatch(idx, *left_pad([prompts[i] for i in idx], self.pad_id)))

    def base(self, model: Any, *, keep_trunk: bool, temperatures: bool = True, bar: Any = None) -> list[GenOut]:
        """Greedy answers of the full model; with ``keep_trunk`` each batch keeps its trunk state;
        with ``temperatures`` (and a grid given) the grid probabilities are recorded too."""
        from transformers import DynamicCache

        decoder, _ = split_decoder_head(model)
        kw = cache_keyword(decoder)
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
                mask = causal_additive_mask(gb.attn, dtype)
                pe = decoder.rotary_emb(hidden, position_ids=pos)
                for j in range(k, len(decoder.layers)):
                    layer = decoder.layers[j]
                    hidden = layer(hidden, attention_mask=mask, position_ids=pos, use_cache=True,
                                   position_embeddings=pe, **{cache_keyword(layer): cache})
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
        kw = cache_keyword(decoder)
        attn = [gb.attn]

        def step(tokens: Tensor, keep: Tensor | None) -> Tensor:
            if keep is not None:
                cache.batch_select_indices(keep)
                attn[0] = attn[0][keep]
            a = attn[0] = torch.cat([attn[0], torch.ones((len(tokens), 1), dtype=attn[0].dtype)], dim=1)
            out = decoder(input_ids=tokens[:, None], attention_mask=a, position_ids=a.sum(-1, keepdim=True) - 1,
                          use_cache=True, **{kw: cache})
            return lm_head_logits(model, head, out.last_hidden_state[:, -1])

        answers = greedy_loop(step, lm_head_logits(model, head, last_hidden), self.tokenizer,
                              eos_token_ids(model, self.tokenizer), max_new_tokens=self.max_new_tokens,
                              temperatures=self.temperatures if temperatures else None, drop_finished=True,
                              newline=self.newline, until=[self.until[i] for i in gb.idx])
        for i, (ans, temp_probs) in zip(gb.idx, answers, strict=True):
            outs[i] = GenOut(ans.text, ans.token_ids, ans.token_probs, temp_probs)
