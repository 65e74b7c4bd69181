"""Open-ended QA: greedy answers, token-probability confidences, SQuAD exact match and F1.

The answer is the greedy continuation of the prompt (see :mod:`llm_calib.prompts`) up to the first
newline or end-of-sequence token. Its confidence is the mean probability of its tokens (product and
minimum are reported too). An answer is correct when its SQuAD-normalised form equals that of any
accepted alias; token F1 (maximum over aliases) is the soft variant.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from llm_calib import metrics
from llm_calib.answers import exact_match, token_f1
from llm_calib.data.records import OpenQA
from llm_calib.prompts import PromptFormat, record_prompt, uses_chat_template
from llm_calib.scoring.base import encode_prompt, progress_bar

__all__ = [
    "GreedyAnswer",
    "OpenEndedSet",
    "encode_open_prompts",
    "eos_token_ids",
    "finish_answer",
    "generate_greedy",
    "open_ended_summary",
    "score_open_ended",
]

@dataclass(frozen=True)
class GreedyAnswer:
    """One greedy generation.

    Attributes:
        text: the answer text (stripped, cut at the first newline).
        token_ids: ids of the answer tokens.
        token_probs: probability of each answer token under the model (temperature 1).
        stop: why generation ended: ``"newline"``, ``"eos"`` or ``"length"``.

    Example:
        >>> GreedyAnswer("Paris", (7,), (0.5,), "eos").text
        'Paris'
    """

    text: str
    token_ids: tuple[int, ...]
    token_probs: tuple[float, ...]
    stop: str


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


def generate_greedy(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 32,
    stop_at_newline: bool = True,
) -> list[GreedyAnswer]:
    """Greedy decoding of a batch of tokenised prompts, with per-token probabilities.

    A simple loop with the model's KV cache and left padding, so it works for any causal LM.
    A row stops at an EOS token, at a token whose text contains a newline (if
    ``stop_at_newline``), or after ``max_new_tokens`` tokens. The stop token is not part of the
    answer, except that text before a newline inside the same token is kept (with its probability).
    If the answer has no tokens, ``token_probs`` holds the probability of the stop token.

    Args:
        model: a Hugging Face causal LM.
        tokenizer: its tokenizer.
        prompts: token ids of each prompt.
        max_new_tokens: generation budget per prompt (>= 1).
        stop_at_newline: stop at the first newline.

    Returns:
        One :class:`GreedyAnswer` per prompt.

    Raises:
        ValueError: ``max_new_tokens < 1`` or an empty prompt.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> out = generate_greedy(model, tok, [tok("What is 2 + 3?")["input_ids"]], max_new_tokens=4)
        >>> len(out[0].token_probs) >= 1
        True
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not prompts:
        return []
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = eos_token_ids(model, tokenizer)
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    for b, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {b} has no tokens")
        ids[b, L - len(p) :] = torch.tensor(list(p))
        attn[b, L - len(p) :] = 1
    ids, attn = ids.to(device), attn.to(device)
    generated: list[list[int]] = [[] for _ in range(B)]
    probs: list[list[float]] = [[] for _ in range(B)]
    done = [False] * B
    # transformers >= 5.2x renamed ``past_key_values`` to ``cache`` (input and output). A peft
    # wrapper's forward takes ``**kwargs`` and hands them on: read the wrapped model's signature.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(base.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    # Only the last position's logits are used: skip the vocabulary projection of the rest of
    # the prompt (a (B, L, vocab) tensor) where the model supports it.
    keep_kw = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
    keep = {keep_kw: 1} if keep_kw else {}
    has_newline: dict[int, bool] = {}
    past = None
    step_ids = ids
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            pos = (attn.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
            out = model(
                input_ids=step_ids,
                attention_mask=attn,
                position_ids=pos,
                use_cache=True,
                **{cache_kw: past},
                **keep,
            )
            past = getattr(out, cache_kw)
            p = torch.softmax(out.logits[:, -1].float(), dim=-1)
            top_p, top = p.max(dim=-1)
            for b in range(B):
                if not done[b]:
                    generated[b].append(int(top[b]))
                    probs[b].append(float(top_p[b]))
                    tok = int(top[b])
                    if stop_at_newline and tok not in has_newline:
                        has_newline[tok] = "\n" in tokenizer.decode([tok])
                    if tok in eos or (stop_at_newline and has_newline[tok]):
                        done[b] = True
            if all(done):
                break
            step_ids = top[:, None]
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=device)], dim=1)
    return [
        finish_answer(tokenizer, g, pr, eos, stop_at_newline)
        for g, pr in zip(generated, probs, strict=True)
    ]


def finish_answer(
    tokenizer: Any, ids: Sequence[int], probs: Sequence[float], eos: set[int], stop_at_newline: bool = True
) -> GreedyAnswer:
    """The :class:`GreedyAnswer` of generated token ids and their probabilities (the stopping
    rule of :func:`generate_greedy`, for decoding loops of one's own).

    A final EOS token is dropped; a final token containing a newline (with ``stop_at_newline``)
    is dropped too, except for text before the newline inside it, which stays with its
    probability. An empty answer takes the probability of the stop token as its confidence.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> ids = tok.encode(" Paris", add_special_tokens=False)
        >>> ans = finish_answer(tok, [*ids, tok.eos_token_id], [0.9] * len(ids) + [0.5], {tok.eos_token_id})
        >>> ans.text, ans.stop, ans.token_probs == (0.9,) * len(ids)
        ('Paris', 'eos', True)
    """
    ids, probs = list(ids), list(probs)
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


@dataclass
class OpenEndedSet:
    """Greedy answers to open questions with confidences and correctness.

    Follows :class:`~llm_calib.formats.base.ScoredResult`, the interface it shares with
    :class:`~llm_calib.scoring.base.ScoredSet`.

    Attributes:
        answers: the generated answer texts.
        references: the accepted aliases of each question.
        domains: domain per question.
        ids: record id per question.
        token_probs: answer-token probabilities per question.
        info: settings (JSON-serialisable).
        details: per question ``prompt`` (text), ``token_ids`` (of the answer) and ``stop``
            (why generation ended), or None.

    Example:
        >>> s = OpenEndedSet(["Paris", "Rome"], [("Paris",), ("Oslo",)], ["geo", "geo"],
        ...                  ["q0", "q1"], [(0.9, 0.5), (0.2,)])
        >>> s.correct.tolist(), s.confidence("mean").round(2).tolist()
        ([True, False], [0.7, 0.2])
    """

    answers: list[str]
    references: list[tuple[str, ...]]
    domains: list[str]
    ids: list[str]
    token_probs: list[tuple[float, ...]]
    info: dict[str, Any] = field(default_factory=dict)
    details: list[dict[str, Any]] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.answers)

    def confidence(self, kind: str = "mean") -> np.ndarray:
        """Per-question confidence: ``"mean"``, ``"product"`` or ``"min"`` of the token probabilities."""
        funcs = {"mean": np.mean, "product": np.prod, "min": np.min}
        if kind not in funcs:
            raise ValueError(f"kind must be one of {tuple(funcs)}, got {kind!r}")
        return np.asarray([float(funcs[kind](p)) if p else 0.0 for p in self.token_probs])

    @property
    def correct(self) -> np.ndarray:
        """Exact match (SQuAD-normalised) against any alias."""
        return np.asarray(
            [exact_match(a, r) for a, r in zip(self.answers, self.references, strict=True)]
        )

    @property
    def f1(self) -> np.ndarray:
        """Token F1 against the best alias."""
        return np.asarray(
            [token_f1(a, r) for a, r in zip(self.answers, self.references, strict=True)]
        )

    @property
    def confidences(self) -> np.ndarray:
        """The mean token probability of each answer, clipped to ``[0, 1]`` (what the calibration
        metrics bin)."""
        return np.clip(self.confidence("mean"), 0.0, 1.0)

    @property
    def accuracy(self) -> float:
        """Fraction of exact matches (NaN for an empty set)."""
        return float(self.correct.mean()) if len(self) else float("nan")

    def summary(self, n_bins: int = 10, ci: bool = True, n_resamples: int = 1000, seed: int = 0) -> dict[str, float]:
        """The calibration metrics of the answers (:func:`open_ended_summary`)."""
        return open_ended_summary(self, n_bins=n_bins, ci=ci, n_resamples=n_resamples, seed=seed)

    def select(self, indices: Sequence[int]) -> OpenEndedSet:
        """The sub-set at ``indices``."""
        return OpenEndedSet(
            [self.answers[i] for i in indices],
            [self.references[i] for i in indices],
            [self.domains[i] for i in indices],
            [self.ids[i] for i in indices],
            [self.token_probs[i] for i in indices],
            dict(self.info),
            [self.details[i] for i in indices] if self.details is not None else None,
        )

    def by_domain(self) -> dict[str, OpenEndedSet]:
        """Split by domain, in order of first appearance."""
        groups: dict[str, list[int]] = {}
        for i, d in enumerate(self.domains):
            groups.setdefault(d, []).append(i)
        return {d: self.select(idx) for d, idx in groups.items()}

    @staticmethod
    def concat(sets: Sequence[OpenEndedSet]) -> OpenEndedSet:
        """Concatenate several sets (the first one's info is kept).

        Example:
            >>> a = OpenEndedSet(["Paris"], [("Paris",)], ["geo"], ["q0"], [(0.9,)])
            >>> len(OpenEndedSet.concat([a, a]))
            2
        """
        if not sets:
            raise ValueError("OpenEndedSet.concat needs at least one set")
        return OpenEndedSet(
            [a for s in sets for a in s.answers],
            [r for s in sets for r in s.references],
            [d for s in sets for d in s.domains],
            [i for s in sets for i in s.ids],
            [p for s in sets for p in s.token_probs],
            dict(sets[0].info),
            [d for s in sets for d in s.details]  # type: ignore[union-attr]
            if all(s.details is not None for s in sets)
            else None,
        )


def open_ended_summary(
    scored: OpenEndedSet,
    n_bins: int = 10,
    ci: bool = True,
    n_resamples: int = 1000,
    seed: int = 0,
) -> dict[str, float]:
    """Calibration metrics of open-ended answers (confidence = mean token probability).

    Keys: ``n``, ``accuracy`` (exact match), ``f1``, ``ece``, ``ece15``, ``adaptive_ece``,
    ``mce``, ``brier`` and ``nll`` (of the confidence as a probability of being correct),
    ``auroc``, ``mean_confidence``, ``ece_product``, ``ece_min`` (ECE of the product and minimum
    token-probability confidences); with ``ci``, bootstrap intervals of the headline metrics.

    Args:
        scored: greedy answers with their token probabilities.
        n_bins: equal-width bins of the ECE variants.
        ci: add 95% bootstrap intervals.
        n_resamples: bootstrap resamples.
        seed: bootstrap seed.

    Returns:
        The metrics by name.

    Example:
        >>> s = OpenEndedSet(["Paris", "Rome"], [("Paris",), ("Oslo",)], ["geo"] * 2,
        ...                  ["q0", "q1"], [(0.9,), (0.2,)])
        >>> r = open_ended_summary(s, ci=False)
        >>> r["accuracy"], round(r["brier"], 3)
        (0.5, 0.025)
    """
    c = np.clip(scored.confidence("mean"), 0.0, 1.0)
    k = scored.correct.astype(np.float64)

    def _brier(c: np.ndarray, k: np.ndarray) -> float:
        return float(np.mean((np.asarray(c) - np.asarray(k)) ** 2))

    def _nll(c: np.ndarray, k: np.ndarray) -> float:
        cc = np.clip(np.asarray(c), metrics.NLL_EPS, 1 - metrics.NLL_EPS)
        kk = np.asarray(k)
        return float(-np.mean(kk * np.log(cc) + (1 - kk) * np.log(1 - cc)))

    def _acc(c: np.ndarray, k: np.ndarray) -> float:
        return float(np.mean(k))

    funcs = {
        "accuracy": _acc,
        "ece": lambda c, k: metrics.ece(c, k, n_bins),
        "adaptive_ece": lambda c, k: metrics.adaptive_ece(c, k, n_bins),
        "brier": _brier,
        "nll": _nll,
        "auroc": metrics.auroc,
    }
    out: dict[str, float] = {"n": len(scored)}
    out.update({name: f(c, k) for name, f in funcs.items()})
    out["f1"] = float(np.mean(scored.f1)) if len(scored) else math.nan
    out["ece15"] = metrics.ece(c, k, 15)
    out["mce"] = metrics.mce(c, k, n_bins)
    out["mean_confidence"] = float(c.mean())
    out["ece_product"] = metrics.ece(np.clip(scored.confidence("product"), 0, 1), k, n_bins)
    out["ece_min"] = metrics.ece(np.clip(scored.confidence("min"), 0, 1), k, n_bins)
    if ci:
        for name, f in funcs.items():
            lo, hi = metrics.bootstrap_ci(f, c, k, n_resamples=n_resamples, seed=seed)
            out[f"{name}_ci_low"], out[f"{name}_ci_high"] = lo, hi
    return out


def encode_open_prompts(
    tokenizer: Any, records: Sequence[OpenQA], prompt: PromptFormat | None = None
) -> list[list[int]]:
    """Token ids of the prompts after which open questions are answered.

    The one place that builds open-ended prompts: greedy answering (:func:`score_open_ended`) and
    CALM training on open questions (:mod:`llm_calib.calm.trainer`) both continue these ids.

    Args:
        tokenizer: a Hugging Face tokenizer.
        records: :class:`~llm_calib.data.records.OpenQA` records.
        prompt: the prompt format (default ``PromptFormat()``); must be the cloze style.

    Returns:
        One list of ids per record.

    Raises:
        TypeError: a record that is not :class:`~llm_calib.data.records.OpenQA`.
        ValueError: a prompt style other than ``"cloze"``.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> ids = encode_open_prompts(tok, [OpenQA("Capital of France?", ("Paris",), "geo", "q0")])
        >>> tok.decode(ids[0]).endswith("The answer is:")
        True
    """
    for r in records:
        if not isinstance(r, OpenQA):
            raise TypeError(f"records must be OpenQA records, got {type(r).__name__}")
    fmt = prompt or PromptFormat()
    if fmt.style != "cloze":
        raise ValueError(
            f"open questions have no options to list: prompt.style must be 'cloze', got {fmt.style!r}"
        )
    chat = uses_chat_template(tokenizer, fmt)
    return [encode_prompt(tokenizer, record_prompt(tokenizer, r, fmt), chat=chat) for r in records]


def score_open_ended(
    model: Any,
    tokenizer: Any,
    records: Sequence[OpenQA],
    *,
    prompt: PromptFormat | None = None,
    max_new_tokens: int = 32,
    batch_size: int = 8,
    progress: bool = False,
) -> OpenEndedSet:
    """Answer open questions greedily and record confidences.

    Args:
        model: a Hugging Face causal LM.
        tokenizer: its tokenizer.
        records: :class:`~llm_calib.data.records.OpenQA` records.
        prompt: the prompt format (default ``PromptFormat()``: chat template, question only,
            ``The answer is:``).
        max_new_tokens: generation budget per answer.
        batch_size: questions generated together.
        progress: show a tqdm progress bar.

    Returns:
        An :class:`OpenEndedSet`.

    Raises:
        TypeError: a record that is not :class:`~llm_calib.data.records.OpenQA`.
        ValueError: ``batch_size < 1`` or a prompt style other than ``"cloze"``.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> s = score_open_ended(model, tok, [OpenQA("Capital of France?", ("Paris",), "geo", "q0")],
        ...                      max_new_tokens=3)
        >>> 0.0 < float(s.confidence("mean")[0]) <= 1.0
        True
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    records = list(records)
    fmt = prompt or PromptFormat()
    prompts = encode_open_prompts(tokenizer, records, fmt)
    chat = uses_chat_template(tokenizer, fmt)
    order = sorted(range(len(records)), key=lambda i: len(prompts[i]))
    answers: list[GreedyAnswer | None] = [None] * len(records)
    bar = progress_bar(total=len(records), desc="open-ended", enabled=progress)
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            outs = generate_greedy(
                model, tokenizer, [prompts[i] for i in idx], max_new_tokens=max_new_tokens
            )
            for i, o in zip(idx, outs, strict=True):
                answers[i] = o
            bar.update(len(idx))
    finally:
        bar.close()
    done = [a for a in answers if a is not None]
    return OpenEndedSet(
        answers=[a.text for a in done],
        references=[tuple(r.answers) for r in records],
        domains=[r.domain for r in records],
        ids=[r.id for r in records],
        token_probs=[a.token_probs for a in done],
        info={
            "max_new_tokens": max_new_tokens,
            "chat_template": chat,
            "answer_prefix": fmt.answer_prefix,
            "template": fmt.template,
            "fewshot": fmt.fewshot,
        },
        details=[
            {"prompt": record_prompt(tokenizer, r, fmt), "token_ids": list(a.token_ids), "stop": a.stop}
            for r, a in zip(records, done, strict=True)
        ],
    )
