"""Sampled answers: N answers per question, the prompt's keys and values computed once and shared.

:func:`sample_answers` runs each batch of prompts through the model once, repeats the resulting KV
cache N times along the batch (one row per sample) and decodes every row by multinomial sampling
under a temperature and nucleus (top-p) filter, with the stopping rule of the greedy decoder
(EOS, a newline, or the record's stop sequences: :class:`~llm_calib.engine.generation.StopRule` and
:func:`~llm_calib.engine.generation.finish_answer`, the core it shares with the greedy decoder).

Every sample has its own random generator, seeded by :func:`sample_seed` from (``seed``,
question index, sample index), so a sample does not depend on the batch it ran in, and it draws
exactly as a Hugging Face ``model.generate(do_sample=True, temperature=…, top_p=…, top_k=0)`` call
of that one prompt after ``torch.manual_seed(sample_seed(...))``: the same float32 scores, the same
warpers (temperature, then top-p keeping at least one token) and one ``torch.multinomial`` draw per
step. The samples are therefore the same token ids as N separate ``generate`` calls, up to float
rounding between a batched and an unbatched forward pass.

Example:
    >>> from llm_calib.models import tiny_random_model
    >>> model, tok = tiny_random_model()
    >>> out = sample_answers(model, tok, [tok("Capital of France?")["input_ids"]],
    ...                      SamplingSettings(n=3, max_new_tokens=4))
    >>> len(out), len(out[0]), out[0][0].stop in ("eos", "newline", "until", "length")
    (1, 3, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from llm_calib.engine.generation import (
    StopRule,
    cached_step,
    eos_token_ids,
    finish_answer,
    left_pad,
)

__all__ = ["SampledAnswer", "SamplingSettings", "sample_answers", "sample_seed"]


@dataclass(frozen=True)
class SamplingSettings:
    """How answers are sampled.

    Attributes:
        n: answers per question (``>= 1``).
        temperature: divides the logits before sampling (``> 0``).
        top_p: nucleus sampling: the smallest set of most probable tokens whose probability
            reaches ``top_p`` (``(0, 1]``; 1 keeps every token).
        seed: seeds every sample's generator (:func:`sample_seed`).
        max_new_tokens: generation budget per answer (``>= 1``).

    Example:
        >>> SamplingSettings(n=10, temperature=0.7).top_p
        1.0
        >>> SamplingSettings(n=0)
        Traceback (most recent call last):
        ...
        ValueError: samples (n) must be an integer >= 1, got 0
    """

    n: int = 10
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 32

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"samples (n) must be an integer >= 1, got {self.n!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0 when sampling, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")


@dataclass(frozen=True)
class SampledAnswer:
    """One sampled answer.

    Attributes:
        text: the answer text (cut as a greedy answer is: first newline or stop sequence).
        token_ids: ids of the answer tokens.
        token_probs: probability of each answer token under the model at temperature 1.
        stop: ``"newline"``, ``"until"``, ``"eos"`` or ``"length"``.
        seed: the seed of this sample's generator.

    Example:
        >>> SampledAnswer("Paris", (7,), (0.5,), "eos", 3).text
        'Paris'
    """

    text: str
    token_ids: tuple[int, ...]
    token_probs: tuple[float, ...]
    stop: str
    seed: int


def sample_seed(seed: int, question: int, sample: int) -> int:
    """The seed of sample ``sample`` of question ``question``: a hash of the three (numpy's
    ``SeedSequence``), independent of batching, in ``[0, 2**63)``.

    Example:
        >>> sample_seed(0, 1, 2) == sample_seed(0, 1, 2) != sample_seed(0, 2, 1)
        True
    """
    state = np.random.SeedSequence([int(seed), int(question), int(sample)]).generate_state(2, np.uint32)
    return int((int(state[0]) << 32 | int(state[1])) & (2**63 - 1))


def _warp(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """Sampling probabilities of rows of float32 logits: temperature, then top-p (at least one token kept)."""
    scores = logits / temperature if temperature != 1.0 else logits
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        drop_sorted = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        drop_sorted[..., -1:] = False
        scores = scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), -math.inf)
    return torch.softmax(scores, dim=-1)


class _Rows:
    """The decoding state of the rows of one batch: tokens, probabilities, stop flags."""

    def __init__(self, rule: StopRule, until: list[Sequence[str] | None]):
        self.rule, self.until = rule, until
        self.tokens: list[list[int]] = [[] for _ in until]
        self.probs: list[list[float]] = [[] for _ in until]
        self.done = [False] * len(until)

    def add(self, row: int, token: int, prob: float) -> None:
        self.tokens[row].append(token)
        self.probs[row].append(prob)
        self.done[row] = self.rule.stops(self.tokens[row], self.until[row])


def _sample_batch(forward: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], seeds: list[int],
                  until: list[Sequence[str] | None], settings: SamplingSettings, stop_at_newline: bool,
                  eos: set[int], device: torch.device) -> list[SampledAnswer]:
    """Sample ``settings.n`` answers of each prompt of one batch, sharing each prompt's cache."""
    n = settings.n
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids, attn = left_pad(prompts, pad)
    attn = attn.to(device)
    logits, past = forward(ids.to(device), attn, None)
    logits = logits.to(dtype=torch.float32)
    past.batch_repeat_interleave(n)  # one copy of each prompt's keys/values per sample, computed once
    logits, attn = logits.repeat_interleave(n, 0), attn.repeat_interleave(n, 0)
    generators = [torch.Generator(device="cpu").manual_seed(s) for s in seeds]
    rows = _Rows(StopRule(tokenizer, eos, stop_at_newline), until)
    active = list(range(len(seeds)))
    for t in range(settings.max_new_tokens):
        probs = _warp(logits, settings.temperature, settings.top_p).cpu()
        model_probs = torch.softmax(logits, dim=-1).cpu()
        chosen = []
        for r, row in enumerate(active):
            token = int(torch.multinomial(probs[r:r + 1], 1, generator=generators[row]))
            rows.add(row, token, float(model_probs[r, token]))
            chosen.append(token)
        keep = [r for r, row in enumerate(active) if not rows.done[row]]
        if not keep or t == settings.max_new_tokens - 1:
            break
        if len(keep) < len(active):  # finished rows leave the batch and its cache
            index = torch.tensor(keep, device=device)
            past.batch_select_indices(index)
            attn = attn[index]
            active = [active[r] for r in keep]
        attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)
        step_ids = torch.tensor([[chosen[r]] for r in keep], device=device)
        logits, past = forward(step_ids, attn, past)
        logits = logits.to(dtype=torch.float32)
    out = []
    for row, s in enumerate(seeds):
        ans = finish_answer(tokenizer, rows.tokens[row], rows.probs[row], eos, stop_at_newline, until[row])
        out.append(SampledAnswer(ans.text, ans.token_ids, ans.token_probs, ans.stop, s))
    return out


def sample_answers(model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], settings: SamplingSettings, *,
                   stop_at_newline: bool = True, until: Sequence[Sequence[str] | None] | None = None,
                   batch_size: int = 8, question_indices: Sequence[int] | None = None) -> list[list[SampledAnswer]]:
    """``settings.n`` sampled answers of every tokenised prompt.

    Args:
        model: a Hugging Face causal LM (any model whose cache supports ``batch_repeat_interleave``).
        tokenizer: its tokenizer.
        prompts: token ids of each prompt (each non-empty).
        settings: n, temperature, top-p, seed and the token budget.
        stop_at_newline: a row stops at its first token holding a newline.
        until: per prompt, stop sequences (lm-eval's ``until``) or None (see
            :func:`~llm_calib.engine.generation.finish_answer`).
        batch_size: prompts per forward pass (each becomes ``n`` rows of the decoding batch).
        question_indices: each prompt's index in the whole set, for its samples' seeds (default
            ``0, 1, …``), so a set scored in chunks or in another order draws the same samples.

    Returns:
        Per prompt, its ``n`` :class:`SampledAnswer` in sample order.

    Raises:
        ValueError: an empty prompt, ``batch_size < 1`` or a wrong number of ``until`` rows or
            ``question_indices``.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> p = [tok("2 + 2 =")["input_ids"], tok("Capital of Italy?")["input_ids"]]
        >>> a = sample_answers(model, tok, p, SamplingSettings(n=2, seed=1, max_new_tokens=3))
        >>> b = sample_answers(model, tok, p[1:], SamplingSettings(n=2, seed=1, max_new_tokens=3),
        ...                    question_indices=[1])
        >>> [s.token_ids for s in a[1]] == [s.token_ids for s in b[0]]
        True
    """
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError(f"prompt {next(i for i, p in enumerate(prompts) if len(p) == 0)} has no tokens")
    stops = list(until) if until is not None else [None] * len(prompts)
    if len(stops) != len(prompts):
        raise ValueError(f"until: {len(stops)} rows of stop sequences for {len(prompts)} prompts")
    indices = list(question_indices) if question_indices is not None else list(range(len(prompts)))
    if len(indices) != len(prompts):
        raise ValueError(f"question_indices: {len(indices)} indices for {len(prompts)} prompts")
    device = next(model.parameters()).device
    forward = cached_step(model)
    eos = eos_token_ids(model, tokenizer)
    out: list[list[SampledAnswer]] = []
    with torch.inference_mode():
        for start in range(0, len(prompts), int(batch_size)):
            chunk = range(start, min(start + int(batch_size), len(prompts)))
            seeds = [sample_seed(settings.seed, indices[q], i) for q in chunk for i in range(settings.n)]
            rows_until = [stops[q] for q in chunk for _ in range(settings.n)]
            answers = _sample_batch(forward, tokenizer, [prompts[q] for q in chunk], seeds, rows_until, settings,
                                    stop_at_newline, eos, device)
            out.extend(answers[k * settings.n:(k + 1) * settings.n] for k in range(len(chunk)))
    return out
