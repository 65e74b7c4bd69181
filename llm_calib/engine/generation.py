"""What every decoder of the engine shares: the prompts left-padded, the model's KV-cached forward
step, the stopping rule and the answer it leaves.

* :func:`left_pad`: a batch of tokenised prompts as left-padded ids and attention mask;
* :func:`cached_step`: ``forward(ids, attention, past) -> (last logits, past)`` over any causal LM
  with its own cache (position ids from the attention mask, only the last position's logits
  computed where the model allows it);
* :class:`StopRule`: whether a row stops after a new token: an end-of-sequence token
  (:func:`eos_token_ids`), a token whose text holds a newline, or, for a row with stop sequences
  (lm-eval's ``until``), once its text holds one of them;
* :func:`finish_answer`: the answer those tokens leave (a :class:`GreedyAnswer`: text, kept tokens,
  their probabilities, why it stopped).

The greedy decoders (:mod:`llm_calib.engine.decode`) and the sampler (:mod:`llm_calib.engine.sampling`)
are built on these, so a greedy and a sampled answer stop and are cut the same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from llm_calib.engine.prefix import cache_keyword

__all__ = ["GreedyAnswer", "StopRule", "cached_step", "eos_token_ids", "finish_answer", "left_pad"]


@dataclass(frozen=True)
class GreedyAnswer:
    """One greedy generation.

    Attributes:
        text: the answer text (stripped, cut at the first newline, or with stop sequences at the
            first of them).
        token_ids: ids of the answer tokens.
        token_probs: probability of each answer token under the model (temperature 1).
        stop: why generation ended: ``"newline"``, ``"until"`` (a stop sequence), ``"eos"`` or
            ``"length"``.
        temp_probs: with a temperature grid (:func:`generate_greedy`'s ``temperatures``), each
            answer token's probability at every grid temperature, ``(len(token_probs), G)``; else None.
            The greedy answer itself does not depend on the temperature (the argmax is the same).

    Example:
        >>> GreedyAnswer("Paris", (7,), (0.5,), "eos").text
        'Paris'
    """

    text: str
    token_ids: tuple[int, ...]
    token_probs: tuple[float, ...]
    stop: str
    temp_probs: np.ndarray | None = field(default=None, compare=False, repr=False)


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every end-of-sequence token id of a model: its generation config's, its config's and the
    tokenizer's (generation stops at any of them).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> tok.eos_token_id in eos_token_ids(model, tok)
        True
    """
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def finish_answer(
    tokenizer: Any, ids: Sequence[int], probs: Sequence[float], eos: set[int], stop_at_newline: bool = True,
    until: Sequence[str] | None = None,
) -> GreedyAnswer:
    """The :class:`GreedyAnswer` of generated token ids and their probabilities (the stopping
    rule of :func:`generate_greedy`, for decoding loops of one's own).

    A final EOS token is dropped; a final token containing a newline (with ``stop_at_newline``)
    is dropped too, except for text before the newline inside it, which stays with its
    probability. An empty answer takes the probability of the stop token as its confidence.

    With stop sequences ``until`` (lm-eval's ``generate_until``; a newline then ends the answer
    only when it is one of them), the answer is the generated text before the first occurrence of
    any of them, as lm-eval cuts it, and its tokens are the fewest whose text covers that answer.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> ids = tok.encode(" Paris", add_special_tokens=False)
        >>> ans = finish_answer(tok, [*ids, tok.eos_token_id], [0.9] * len(ids) + [0.5], {tok.eos_token_id})
        >>> ans.text, ans.stop, ans.token_probs == (0.9,) * len(ids)
        ('Paris', 'eos', True)
    """
    ids, probs = list(ids), list(probs)
    if until is not None:
        return _finish_until(tokenizer, ids, probs, eos, until)
    stop, keep, extra = "length", len(ids), ""
    if ids and ids[-1] in eos:
        stop, keep = "eos", len(ids) - 1
    elif ids and stop_at_newline and "\n" in tokenizer.decode([ids[-1]]):
        stop, keep = "newline", len(ids) - 1
        extra = tokenizer.decode([ids[-1]]).split("\n", 1)[0]
    ans_ids, ans_probs = ids[:keep], probs[:keep]
    text = tokenizer.decode(ans_ids, skip_special_tokens=True) + extra
    if extra.strip():  # text before the newline inside the stop token belongs to the answer
        ans_ids, ans_probs = ids, probs
    if not ans_probs:  # empty answer: its confidence is that of stopping right away
        ans_probs = probs[-1:]
    return GreedyAnswer(text.split("\n", 1)[0].strip(), tuple(ans_ids), tuple(ans_probs), stop)


def _finish_until(tokenizer: Any, ids: list[int], probs: list[float], eos: set[int], until: Sequence[str]) -> GreedyAnswer:
    """:func:`finish_answer` with stop sequences: the text before the earliest stop sequence."""
    stop = "length"
    if ids and ids[-1] in eos:
        stop, ids = "eos", ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cuts = [text.find(u) for u in until if u and u in text]
    if cuts:
        stop, text = "until", text[: min(cuts)]
    keep = next(k for k in range(len(ids) + 1)
                if k == len(ids) or len(tokenizer.decode(ids[:k], skip_special_tokens=True)) >= len(text))
    ans_probs = probs[:keep] or probs[keep : keep + 1]  # empty answer: the probability of stopping right away
    return GreedyAnswer(text.strip(), tuple(ids[:keep]), tuple(ans_probs), stop)


class StopRule:
    """Whether a decoding row stops after its newest token: at an end-of-sequence token, at a token
    whose text holds a newline (``stop_at_newline``), or, for a row with stop sequences, once the
    row's text holds one of them (a newline then stops it only when it is one).

    Args:
        tokenizer: decodes tokens.
        eos: the end-of-sequence ids (:func:`eos_token_ids`).
        stop_at_newline: stop at a token containing a newline (rows without stop sequences).
        newline: a cache ``token -> its text holds a newline``, shareable between calls.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> rule = StopRule(tok, {tok.eos_token_id})
        >>> rule.stops([tok.eos_token_id], None), rule.stops(tok.encode("a", add_special_tokens=False), None)
        (True, False)
    """

    def __init__(self, tokenizer: Any, eos: set[int], stop_at_newline: bool = True,
                 newline: dict[int, bool] | None = None) -> None:
        self.tokenizer, self.eos, self.stop_at_newline = tokenizer, eos, stop_at_newline
        self.newline: dict[int, bool] = {} if newline is None else newline

    def stops(self, tokens: Sequence[int], until: Sequence[str] | None) -> bool:
        """Whether a row whose generated tokens are ``tokens`` (the newest last) stops now."""
        token = tokens[-1]
        if token in self.eos:
            return True
        if until is not None:  # the generated text holds one of the stop sequences
            text = self.tokenizer.decode(list(tokens), skip_special_tokens=True)
            return any(u and u in text for u in until)
        if self.stop_at_newline and token not in self.newline:
            self.newline[token] = "\n" in self.tokenizer.decode([token])
        return self.stop_at_newline and self.newline[token]


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-padded ``(ids, attention mask)`` of the prompts (each with at least one token).

    Raises:
        ValueError: an empty prompt.

    Example:
        >>> ids, attn = left_pad([[5, 6], [7]], 0)
        >>> ids.tolist(), attn.tolist()
        ([[5, 6], [0, 7]], [[1, 1], [0, 1]])
    """
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    for b, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {b} has no tokens")
        ids[b, L - len(p) :] = torch.tensor(list(p))
        attn[b, L - len(p) :] = 1
    return ids, attn


def cached_step(model: Any) -> Callable[[Tensor, Tensor, Any], tuple[Tensor, Any]]:
    """``forward(ids, attention, past) -> (last logits, past)`` over a causal LM with its own KV cache and
    left padding: position ids follow the attention mask, and only the last position's logits are
    computed where the model supports it (``logits_to_keep``). The logits keep the model's dtype.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> ids, attn = left_pad([tok("Hi")["input_ids"]], 0)
        >>> logits, past = cached_step(model)(ids, attn, None)
        >>> logits.shape[0], past is not None
        (1, True)
    """
    # A peft wrapper's forward takes ``**kwargs`` and hands them on: read the wrapped model's signature.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cache_kw = cache_keyword(base)
    # Only the last position's logits are used: skip the vocabulary projection of the rest of
    # the prompt (a (B, L, vocab) tensor) where the model supports it.
    params = inspect.signature(base.forward).parameters
    keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
    extra = {keep_kw: 1} if keep_kw else {}

    def forward(ids: Tensor, attn: Tensor, past: Any) -> tuple[Tensor, Any]:
        pos = (attn.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **{cache_kw: past}, **extra)
        return out.logits[:, -1], getattr(out, cache_kw)

    return forward
