"""The prefix cache: requests that start with the same tokens (a few-shot context, a task
description, one prompt sampled N times) have that prefix's keys and values computed once and
reused for every continuation.

* :func:`prefix_groups` groups prompts by their longest common token prefix (exact ids);
* :func:`plan_prefix_batches` turns the groups into batches (one prefix per batch, rows sorted by
  the length of what follows the prefix, the expanded keys/values bounded in bytes);
* :func:`compute_prefix` runs the prefix once (:class:`PrefixKV`) and :func:`forward_rows_after`
  runs a packed batch of continuations on top of it, returning the hidden states at
  ``packed.rows`` as :func:`~llm_calib.engine.options.forward_rows` does for whole sequences;
* :func:`run_prefix_plan` drives a scorer's ``score(indices, prefix)`` over the plan, computing
  each prefix once, and records :class:`PrefixCacheStats` (groups, tokens saved, peak bytes).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from llm_calib.engine.flat import (
    FlatUnsupportedError,
    flat_supported,
    forward_rows_flat,
    prefixes_per_row,
)
from llm_calib.engine.options import compute_dtype, forward_rows
from llm_calib.engine.packing import PackedQuestions, accepts_packed_masks, length_batches
from llm_calib.models import split_decoder_head

__all__ = [
    "DEFAULT_PREFIX_CACHE_MB", "MAX_GROUP_SCAN", "MIN_PREFIX_TOKENS", "PrefixBatch", "PrefixCacheSettings", "PrefixCacheStats",
    "PrefixGroup", "PrefixKV", "cache_keyword", "common_prefix_length", "compute_prefix", "forward_rows_after",
    "kv_bytes_per_token", "plan_prefix_batches", "prefix_cache", "prefix_cache_settings", "prefix_groups",
    "run_prefix_plan",
]

T = TypeVar("T")

MIN_PREFIX_TOKENS = 16
"""Shortest prefix worth a pass of its own: below it, copying its keys/values costs about what it saves."""

MAX_GROUP_SCAN = 512
"""Most prompts :func:`prefix_groups` puts in one group (bounds its work at ``len(prompts) * MAX_GROUP_SCAN``;
a larger set sharing one prefix is cut into groups of this size, each computing the prefix once)."""

DEFAULT_PREFIX_CACHE_MB = 1024.0
"""Default bound on the prefix keys/values held for one batch (flat batches: the prefixes it continues;
padded batches: the prefix and its copy per row), in MiB."""


@dataclass(frozen=True)
class PrefixCacheSettings:
    """Whether scorers share prefixes (``enabled``), and the bound ``max_mb`` (MiB) on the prefix
    keys/values of one batch.

    Example:
        >>> PrefixCacheSettings().enabled, PrefixCacheSettings().max_mb == DEFAULT_PREFIX_CACHE_MB
        (True, True)
    """

    enabled: bool = True
    max_mb: float = DEFAULT_PREFIX_CACHE_MB

    def __post_init__(self) -> None:
        if not self.max_mb > 0:
            raise ValueError(f"prefix cache size must be > 0 MiB, got {self.max_mb!r}")


_SETTINGS: contextvars.ContextVar[PrefixCacheSettings | None] = contextvars.ContextVar(
    "llm_calib_prefix_cache", default=None)


@contextlib.contextmanager
def prefix_cache(enabled: bool = True, max_mb: float = DEFAULT_PREFIX_CACHE_MB) -> Iterator[PrefixCacheSettings]:
    """Set the prefix-cache settings of every scorer called inside the block (their ``prefix_cache``
    and ``prefix_cache_mb`` arguments left at None); the default is on, :data:`DEFAULT_PREFIX_CACHE_MB`.

    Raises:
        ValueError: ``max_mb <= 0``.

    Example:
        >>> with prefix_cache(enabled=False):
        ...     prefix_cache_settings().enabled
        False
        >>> prefix_cache_settings().enabled
        True
    """
    settings = PrefixCacheSettings(bool(enabled), float(max_mb))
    token = _SETTINGS.set(settings)
    try:
        yield settings
    finally:
        _SETTINGS.reset(token)


def prefix_cache_settings(enabled: bool | None = None, max_mb: float | None = None) -> PrefixCacheSettings:
    """The settings in force (:func:`prefix_cache`), with ``enabled`` / ``max_mb`` overriding them where not None.

    Raises:
        ValueError: ``max_mb <= 0``.

    Example:
        >>> prefix_cache_settings(max_mb=64).max_mb
        64.0
    """
    current = _SETTINGS.get() or PrefixCacheSettings()
    return PrefixCacheSettings(current.enabled if enabled is None else bool(enabled),
                               current.max_mb if max_mb is None else float(max_mb))


def cache_keyword(module: Any) -> str:
    """The cache keyword of ``module.forward``: transformers >= 5.2x renamed ``past_key_values`` to ``cache``.

    Example:
        >>> from llm_calib.models import split_decoder_head, tiny_random_model
        >>> cache_keyword(split_decoder_head(tiny_random_model()[0])[0]) in ("cache", "past_key_values")
        True
    """
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens ``a`` and ``b`` share.

    Example:
        >>> common_prefix_length([1, 2, 3, 4], [1, 2, 5])
        2
    """
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass(frozen=True)
class PrefixGroup:
    """Prompts sharing their first ``prefix_len`` tokens (0: a prompt scored without a shared prefix).

    Example:
        >>> PrefixGroup(3, (0, 2)).indices
        (0, 2)
    """

    prefix_len: int
    indices: tuple[int, ...]


def prefix_groups(prompts: Sequence[Sequence[int]], *, min_tokens: int = MIN_PREFIX_TOKENS) -> list[PrefixGroup]:
    """Group prompts by their longest common token prefix.

    The prompts sorted by their token ids put every set of prompts with a common prefix next to
    each other; they are cut into contiguous groups saving the most tokens in all,
    ``sum((members - 1) * common prefix)`` (exact dynamic programme over groups of at most
    :data:`MAX_GROUP_SCAN` prompts), so a few-shot context shared by a subject's questions is not
    cut back to a short description shared with another subject. A prefix stops one token before
    its group's shortest prompt (the last prompt token runs with the continuation: it predicts
    the first answer token) and is at least ``min_tokens`` long; a prompt alone gets ``prefix_len`` 0.

    Args:
        prompts: token ids of each prompt.
        min_tokens: shortest prefix worth sharing (>= 1).

    Returns:
        Groups covering every index once, in order of their smallest index.

    Raises:
        ValueError: ``min_tokens < 1``.

    Example:
        >>> fewshot = [7] * 20
        >>> [(g.prefix_len, g.indices) for g in prefix_groups([fewshot + [1, 2], [9, 9], fewshot + [3]])]
        [(20, (0, 2)), (0, (1,))]
    """
    if not isinstance(min_tokens, int) or min_tokens < 1:
        raise ValueError(f"min_tokens must be a positive integer, got {min_tokens!r}")
    order = sorted(range(len(prompts)), key=lambda i: (tuple(prompts[i]), i))
    n = len(order)
    adjacent = [common_prefix_length(prompts[order[k]], prompts[order[k + 1]]) for k in range(n - 1)]
    # best[j]: most tokens saved by grouping the first j sorted prompts; start[j]: where its last group starts
    best, start, shared = [0] * (n + 1), list(range(n + 1)), [0] * (n + 1)
    for j in range(1, n + 1):
        best[j], start[j] = best[j - 1], j - 1
        common, shortest = len(prompts[order[j - 1]]), len(prompts[order[j - 1]])
        for i in range(j - 2, max(j - 1 - MAX_GROUP_SCAN, -1), -1):  # the group order[i:j]
            common = min(common, adjacent[i])
            shortest = min(shortest, len(prompts[order[i]]))
            c = min(common, shortest - 1)  # the last prompt token runs with the continuation
            if c < min_tokens:
                break
            if best[i] + (j - i - 1) * c > best[j]:
                best[j], start[j], shared[j] = best[i] + (j - i - 1) * c, i, c
    groups, j = [], n
    while j > 0:
        members = tuple(sorted(order[start[j] : j]))
        if len(members) == 1:
            groups.append(PrefixGroup(0, members))
        else:
            groups.append(PrefixGroup(shared[j], members))
        j = start[j]
    return sorted(groups, key=lambda g: g.indices[0])


@dataclass(frozen=True)
class PrefixBatch:
    """One batch of a plan: the rows ``indices`` continue the first ``prefix_len`` tokens of
    ``prompts[indices[0]]`` (0: no prefix, whole sequences). In a plan for flat batches a batch
    may continue several prefixes: a segment that ``joins_previous`` runs in the same forward pass
    as the segment before it.

    Example:
        >>> PrefixBatch(0, (1, 0)).prefix_len, PrefixBatch(0, (1, 0)).joins_previous
        (0, False)
    """

    prefix_len: int
    indices: tuple[int, ...]
    joins_previous: bool = False


def plan_prefix_batches(
    prompts: Sequence[Sequence[int]], lengths: Sequence[int], batch_size: int, *, bytes_per_token: int,
    max_bytes: float, min_tokens: int = MIN_PREFIX_TOKENS, flat: bool = False,
) -> list[PrefixBatch]:
    """Batches of at most ``batch_size`` rows on shared prefixes (:func:`prefix_groups`).

    Within a group the rows are sorted by the length left after the prefix (little padding per
    batch). Padded batches (``flat=False``) hold one prefix each and at most as many rows as keep
    ``(rows + 1) * prefix_len * bytes_per_token`` (the prefix and its copy per row) within
    ``max_bytes``; a group whose prefix does not fit with even one row is scored without it, and
    prompts without a shared prefix are batched by length as
    :func:`~llm_calib.engine.packing.length_batches` does.

    Flat batches (``flat=True``, :mod:`llm_calib.engine.flat`: no padding, no copy of a prefix per
    row) are filled to ``batch_size`` rows in the order of the groups, then the prompts without
    a shared prefix, so a batch may continue several prefixes (segments with ``joins_previous``)
    as long as their keys/values fit ``max_bytes`` together; a prefix larger than ``max_bytes``
    alone is not shared.

    Args:
        prompts: token ids of each prompt.
        lengths: each request's full length (prompt and what is scored after it).
        batch_size: rows per batch (>= 1).
        bytes_per_token: bytes of keys and values per token (:func:`kv_bytes_per_token`).
        max_bytes: bound on the prefix keys/values of one batch.
        min_tokens: shortest prefix worth sharing.
        flat: plan flat batches.

    Example:
        >>> fewshot = [7] * 20
        >>> prompts = [fewshot + [1, 2], [9, 9], fewshot + [3]]
        >>> plan = plan_prefix_batches(prompts, [4, 2, 3], 8, bytes_per_token=10, max_bytes=1e6)
        >>> [(b.prefix_len, b.indices) for b in plan]
        [(20, (2, 0)), (0, (1,))]
        >>> plan = plan_prefix_batches(prompts, [4, 2, 3], 8, bytes_per_token=10, max_bytes=1e6, flat=True)
        >>> [(b.prefix_len, b.indices, b.joins_previous) for b in plan]
        [(20, (2, 0), False), (0, (1,), True)]
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    groups = prefix_groups(prompts, min_tokens=min_tokens)
    if flat:
        return _plan_flat(groups, lengths, batch_size, bytes_per_token, max_bytes)
    plan: list[PrefixBatch] = []
    loners: list[int] = []
    for g in groups:
        rows = min(batch_size, int(max_bytes // max(g.prefix_len * bytes_per_token, 1)) - 1)
        if g.prefix_len == 0 or rows < 1:
            loners.extend(g.indices)
            continue
        members = sorted(g.indices, key=lambda i: (lengths[i], i))
        plan.extend(PrefixBatch(g.prefix_len, tuple(members[s : s + rows])) for s in range(0, len(members), rows))
    for idx in length_batches([lengths[i] for i in loners], batch_size):
        plan.append(PrefixBatch(0, tuple(loners[i] for i in idx)))
    return plan


def _plan_flat(groups: list[PrefixGroup], lengths: Sequence[int], batch_size: int, bytes_per_token: int,
               max_bytes: float) -> list[PrefixBatch]:
    """:func:`plan_prefix_batches` for flat batches: groups, then loners, cut into batches of ``batch_size`` rows."""
    sources: list[tuple[int, list[int]]] = []
    loners: list[int] = []
    for g in groups:
        if g.prefix_len == 0 or g.prefix_len * bytes_per_token > max_bytes:
            loners.extend(g.indices)
        else:
            sources.append((g.prefix_len, sorted(g.indices, key=lambda i: (lengths[i], i))))
    sources.append((0, sorted(loners, key=lambda i: (lengths[i], i))))
    passes: list[list[tuple[int, list[int]]]] = [[]]
    rows, held = 0, 0.0
    for prefix_len, members in sources:
        cost = prefix_len * bytes_per_token
        in_pass = False  # this group's prefix is held by the current batch
        for i in members:
            if rows == batch_size or (not in_pass and rows and held + cost > max_bytes):
                passes.append([])
                rows, held, in_pass = 0, 0.0, False
            if not in_pass:
                passes[-1].append((prefix_len, []))
                held, in_pass = held + cost, True
            passes[-1][-1][1].append(i)
            rows += 1
    return [PrefixBatch(prefix_len, tuple(idx), k > 0) for p in passes for k, (prefix_len, idx) in enumerate(p)]


@dataclass
class PrefixKV:
    """Keys and values of one prefix, per layer ``(1, kv_heads, length, head_dim)``.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> kv = compute_prefix(tiny_random_model()[0], [5, 6, 7])
        >>> kv.length, kv.nbytes > 0
        (3, True)
    """

    tokens: tuple[int, ...]
    layers: list[tuple[Tensor, Tensor]]

    @property
    def length(self) -> int:
        """Number of prefix tokens."""
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values held."""
        return sum(k.nelement() * k.element_size() + v.nelement() * v.element_size() for k, v in self.layers)


def compute_prefix(model: Any, tokens: Sequence[int]) -> PrefixKV:
    """Run ``tokens`` (positions 0 to ``len(tokens) - 1``) through the decoder once and keep every layer's keys/values.

    Raises:
        ValueError: no tokens.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model = tiny_random_model()[0]
        >>> len(compute_prefix(model, [5, 6]).layers) == model.config.num_hidden_layers
        True
    """
    from transformers import DynamicCache

    if len(tokens) == 0:
        raise ValueError("compute_prefix needs at least one token")
    decoder, _ = split_decoder_head(model)
    device = next(decoder.parameters()).device
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([list(tokens)], device=device)
    with torch.inference_mode():
        decoder(input_ids=ids, position_ids=torch.arange(len(tokens), device=device)[None], use_cache=True,
                **{cache_keyword(decoder): cache})
    return PrefixKV(tuple(int(t) for t in tokens), [(k, v) for k, v, *_ in cache])


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of keys and values one token adds to a model's cache: ``2 * layers * kv_heads * head_dim``
    elements of the compute dtype, from the config (measured on a one-token prefix where it lacks them).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model = tiny_random_model()[0]
        >>> kv_bytes_per_token(model) == compute_prefix(model, [0]).nbytes
        True
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers, heads = getattr(config, "num_hidden_layers", None), getattr(config, "num_attention_heads", None)
    if not layers or not heads or not getattr(config, "hidden_size", None):
        return compute_prefix(model, [0]).nbytes
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=compute_dtype(model)).element_size()


def _suffix_mask(packed: PackedQuestions, prefix_len: int, dtype: torch.dtype) -> Tensor:
    """Additive ``(B, 1, S, P + S)`` mask: every row sees the whole prefix, then its own packed mask."""
    B, S = packed.input_ids.shape
    if packed.attention_mask.dim() == 4:
        allowed = packed.attention_mask
    else:  # a padding mask: causal over valid keys, a padding query sees itself only
        keys = packed.attention_mask.bool()
        allowed = torch.ones(S, S, dtype=torch.bool).tril()[None] & keys[:, None, :]
        allowed = (allowed | torch.eye(S, dtype=torch.bool)[None])[:, None]
    full = torch.cat([torch.ones((B, 1, S, prefix_len), dtype=torch.bool), allowed], dim=-1)
    return torch.zeros(full.shape, dtype=dtype).masked_fill_(~full, torch.finfo(dtype).min)


def forward_rows_after(model: Any, prefix: PrefixKV | Sequence[PrefixKV | None] | None,
                       packed: PackedQuestions) -> Tensor:
    """Final hidden states at ``packed.rows`` of a packed batch of continuations of ``prefix``.

    ``packed`` holds what follows the prefix (positions counted from 0 as if it stood alone):
    every row attends to all prefix tokens and, within the row, as its own mask says; positions
    are shifted by the prefix length. ``prefix`` is one :class:`PrefixKV` for every row, one per
    row (None: that row stands alone), or None (whole sequences). The result equals
    :func:`~llm_calib.engine.options.forward_rows` on the whole sequences up to float rounding.

    Models that run flat batches (:func:`~llm_calib.engine.flat.flat_supported`) run the real
    tokens of the batch as one unpadded sequence on the prefixes' keys and values as they are
    (:func:`~llm_calib.engine.flat.forward_rows_flat`); others run the padded batch with the
    prefix's keys and values copied per row (one prefix for all rows).

    Raises:
        ValueError: a model that runs neither flat batches nor 4-D masks, or rows on different
            prefixes for a model that does not run flat batches.

    Example:
        >>> from llm_calib.engine.options import forward_rows
        >>> from llm_calib.engine.packing import pack_questions
        >>> from llm_calib.models import tiny_random_model
        >>> model = tiny_random_model()[0]
        >>> whole = forward_rows(model, pack_questions([((5, 6, 7), ((8,), (9, 10)))], pad_id=0))[0]
        >>> after = forward_rows_after(model, compute_prefix(model, [5, 6]), pack_questions([((7,), ((8,), (9, 10)))], 0))
        >>> bool(torch.allclose(whole, after, atol=1e-5))
        True
    """
    if flat_supported(model):
        with contextlib.suppress(FlatUnsupportedError):  # remembered: the padded way from now on
            return forward_rows_flat(model, packed, prefix)
    per_row = prefixes_per_row(prefix, packed.batch_size)
    if len({id(p) for p in per_row}) > 1:
        raise ValueError("rows on different prefixes need a model that runs flat batches")
    prefix = per_row[0]
    if prefix is None:
        with torch.inference_mode():
            return forward_rows(model, packed)[0]
    return _forward_rows_expanded(model, prefix, packed)


def _forward_rows_expanded(model: Any, prefix: PrefixKV, packed: PackedQuestions) -> Tensor:
    """:func:`forward_rows_after` the padded way: the prefix's keys/values copied per row, a 4-D mask."""
    from transformers import DynamicCache

    if not accepts_packed_masks(model):
        raise ValueError("forward_rows_after needs attention that takes 4-D masks (eager or sdpa) or flat batches")
    decoder, _ = split_decoder_head(model)
    device = next(decoder.parameters()).device
    B = packed.input_ids.shape[0]
    P = prefix.length
    # the expanded views are copied once, when the continuation's keys are appended
    cache = DynamicCache([(k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)) for k, v in prefix.layers],
                         config=model.config)
    with torch.inference_mode():
        out = decoder(input_ids=packed.input_ids.to(device),
                      attention_mask=_suffix_mask(packed, P, compute_dtype(model)).to(device),
                      position_ids=(packed.position_ids + P).to(device), use_cache=True,
                      **{cache_keyword(decoder): cache})
    hidden = out.last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1])[packed.rows.to(device)]


@dataclass
class PrefixCacheStats:
    """What the prefix cache did in a run.

    Attributes:
        groups: distinct prefixes computed.
        requests: requests scored on a shared prefix.
        tokens_saved: prefix tokens not recomputed, ``sum over groups of (members - 1) * prefix length``.
        peak_bytes: the most prefix key/value bytes held at once (the prefixes of a flat batch; the
            prefix and its copy per row of a padded batch).

    Example:
        >>> PrefixCacheStats().as_dict()
        {'groups': 0, 'requests': 0, 'tokens_saved': 0, 'peak_bytes': 0}
    """

    groups: int = 0
    requests: int = 0
    tokens_saved: int = 0
    peak_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counts as a plain dict (for ``ScoredSet.info``)."""
        return asdict(self)


def run_prefix_plan(
    model: Any, prompts: Sequence[Sequence[int]], plan: Sequence[PrefixBatch],
    score: Callable[[list[int], list[PrefixKV | None]], Sequence[T]], *, stats: PrefixCacheStats | None = None,
    on_batch: Callable[[int], None] | None = None, flat: bool = False,
) -> list[T]:
    """``score(indices, prefixes)`` over the batches of ``plan`` (segments that join the previous one run
    in its call), with the prefix each row continues (None: none), in input order; each distinct prefix is
    computed once and released when no batch needs it any more (the plan keeps a group's batches together).
    ``flat``: the scorer runs flat batches, so a batch holds each prefix once (else once per row too,
    which ``stats.peak_bytes`` counts).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model = tiny_random_model()[0]
        >>> prompts = [[7] * 20 + [1], [7] * 20 + [2], [3]]
        >>> plan = plan_prefix_batches(prompts, [21, 21, 1], 4, bytes_per_token=1, max_bytes=1e9)
        >>> stats = PrefixCacheStats()
        >>> run_prefix_plan(model, prompts, plan, lambda idx, kvs: [kv.length if kv else 0 for kv in kvs], stats=stats)
        [20, 20, 0]
        >>> stats.groups, stats.requests, stats.tokens_saved
        (1, 2, 20)
    """
    stats = stats if stats is not None else PrefixCacheStats()
    out: list[Any] = [None] * len(prompts)
    held: dict[tuple[int, ...], PrefixKV] = {}
    for segments in _batches(plan):
        keys = [tuple(prompts[seg.indices[0]][: seg.prefix_len]) if seg.prefix_len > 0 else None for seg in segments]
        for key in [k for k in held if k not in keys]:
            del held[key]  # release a prefix no batch needs any more before computing the next
        idx: list[int] = []
        kvs: list[PrefixKV | None] = []
        for seg, key in zip(segments, keys, strict=True):
            kv = None
            if key is not None:
                if key not in held:
                    held[key] = compute_prefix(model, key)
                    stats.groups += 1
                    stats.tokens_saved -= seg.prefix_len
                kv = held[key]
                stats.requests += len(seg.indices)
                stats.tokens_saved += len(seg.indices) * seg.prefix_len
            idx.extend(seg.indices)
            kvs.extend([kv] * len(seg.indices))
        held_bytes = sum(kv.nbytes for kv in held.values())
        stats.peak_bytes = max(stats.peak_bytes, held_bytes if flat else held_bytes * (len(idx) + 1))
        for i, value in zip(idx, score(idx, kvs), strict=True):
            out[i] = value
        if on_batch is not None:
            on_batch(len(idx))
    return out


def _batches(plan: Sequence[PrefixBatch]) -> Iterator[list[PrefixBatch]]:
    """The segments of ``plan`` that run in one call each (a segment that joins the previous one runs with it)."""
    current: list[PrefixBatch] = []
    for seg in plan:
        if current and not seg.joins_previous:
            yield current
            current = []
        current.append(seg)
    if current:
        yield current
