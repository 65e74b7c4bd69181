"""Flat continuation batches: the questions of a batch laid end to end in one sequence, without
padding, each attending to its own shared prefix (if any) and to its own tokens.

A packed batch (:func:`~llm_calib.engine.packing.pack_questions`: one row per question, a prompt
followed by its options) pads every row to the longest, and running it on a shared prefix
(:func:`~llm_calib.engine.prefix.forward_rows_after`) copies the prefix's keys and values once
per row (and once per query head under grouped-query attention) and attends over
``prefix + longest row`` for every row. Here the decoder runs on the ``N`` tokens of the batch that matter (every real token but the
last of each option, whose hidden state nothing reads) as one sequence, so the projections and the
MLP see no padding, and attention is split in two parts that are merged exactly by their
log-sum-exp:

* the **prefix part**: the tokens of the questions continuing one prefix attend to its keys and
  values as they are, ``(1, kv_heads, P, head_dim)``, in one call (no copy, no mask);
* the **own part**: each question's tokens attend to the question's own tokens under its packed
  mask (the prompt causally, each option to the prompt and itself), questions of similar length
  laid out ``(rows, heads, width, head_dim)`` in one call (:class:`OwnPart`), without a mask where
  the rows are plainly causal.

``out = (e^{lse_1} out_1 + e^{lse_2} out_2) / (e^{lse_1} + e^{lse_2})`` is the softmax over the
union of both key sets: the same numbers as attention over the concatenated keys, up to float
rounding. A batch may mix questions on different prefixes and questions without one.

The decoder runs under its own attention function (registered with transformers'
``AttentionInterface`` and set on the decoder's config for the pass only); models whose attention
layers do not go through that interface, or use a sliding window the batch's positions reach, logit
soft-capping or attention sinks, are detected (:func:`flat_supported`, and a check that every
layer ran the function) and scored the padded way instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from llm_calib.engine.options import compute_dtype
from llm_calib.engine.packing import PackedQuestions, length_parts
from llm_calib.models import split_decoder_head

__all__ = [
    "FLAT_ATTENTION", "MAX_SCORES", "OWN_PART_OVERHEAD", "FlatBatch", "FlatUnsupportedError", "OwnPart",
    "attention_with_logsumexp", "flat_batch", "flat_batches", "flat_supported", "forward_rows_flat", "merge_attention", "packed_lengths",
    "prefixes_per_row",
]

log = logging.getLogger(__name__)

FLAT_ATTENTION = "llm_calib_flat"
"""The name the flat attention function is registered under in transformers' ``AttentionInterface``."""


class FlatUnsupportedError(RuntimeError):
    """A model's attention cannot run flat (soft-capping, sinks, a sliding window the batch reaches,
    attention layers that bypass transformers' attention interface)."""


def prefixes_per_row(prefixes: Any | Sequence[Any | None] | None, rows: int) -> list[Any | None]:
    """The prefix (a :class:`~llm_calib.engine.prefix.PrefixKV`, or None) of each of ``rows`` rows, from
    one prefix for all, one per row, or None (ValueError when a per-row list has another length).

    Example:
        >>> prefixes_per_row(None, 2), prefixes_per_row(["kv", None], 2)
        ([None, None], ['kv', None])
    """
    per_row = [prefixes] * rows if prefixes is None or not isinstance(prefixes, Sequence) else list(prefixes)
    if len(per_row) != rows:
        raise ValueError(f"{len(per_row)} prefixes for {rows} rows")
    return per_row


def packed_lengths(packed: PackedQuestions) -> Tensor:
    """Number of real (not padding) tokens in each row of a packed batch.

    Example:
        >>> from llm_calib.engine.packing import pack_letters, pack_questions
        >>> packed_lengths(pack_questions([((1, 2), ((3,), (4, 5))), ((6,), ((7,),))], pad_id=0)).tolist()
        [5, 2]
        >>> packed_lengths(pack_letters([(1, 2, 3), (4,)], [(7, 8), (7, 8)], pad_id=0)).tolist()
        [3, 1]
    """
    if packed.attention_mask.dim() == 2:
        return packed.attention_mask.sum(1).long()
    B, L = packed.input_ids.shape
    prompt = packed.rows[packed.answer_start_rows()] - torch.arange(B) * L + 1
    options = torch.zeros(B, dtype=torch.long).index_add_(0, packed.option_question, packed.option_lengths)
    return prompt + options


def _own_mask(packed: PackedQuestions) -> Tensor:
    """The ``(B, 1, L, L)`` boolean mask of each row's own tokens (a padding query sees itself)."""
    if packed.attention_mask.dim() == 4:
        return packed.attention_mask
    keys = packed.attention_mask.bool()
    L = keys.shape[1]
    allowed = torch.ones(L, L, dtype=torch.bool).tril()[None] & keys[:, None, :]
    return (allowed | torch.eye(L, dtype=torch.bool)[None])[:, None]


OWN_PART_OVERHEAD = 4096
"""What one more own-part attention call costs, in query-key pairs (:func:`flat_batch` splits a
batch's own part into calls of similar length when that saves more pairs than this per call)."""


@dataclass
class OwnPart:
    """Rows of a flat batch whose own-part attention runs in one call, laid out ``(rows, width)``.

    Attributes:
        slots: ``(rows * width,)`` the flat token in each slot (padding: token 0, never attended).
        tokens: the flat positions of the part's tokens.
        valid: the slot of each of ``tokens``.
        bias: ``(rows, 1, width, width)`` additive mask, or None where every row is plainly causal.
        shape: ``(rows, width)``.
    """

    slots: Tensor
    tokens: Tensor
    valid: Tensor
    bias: Tensor | None
    shape: tuple[int, int]

    def to(self, device: torch.device | str) -> OwnPart:
        """The tensors on ``device``."""
        return OwnPart(self.slots.to(device), self.tokens.to(device), self.valid.to(device),
                       None if self.bias is None else self.bias.to(device), self.shape)


@dataclass
class FlatBatch:
    """A packed batch laid out flat: the ``N`` tokens that run (the real tokens but the last of
    each option, whose hidden state nothing reads), question after question, the spans of flat
    tokens continuing each prefix, and the flat positions of ``packed.rows``.

    Attributes:
        input_ids: ``(1, N)`` token ids.
        position_ids: ``(1, N)`` positions, counted after the question's prefix.
        own_parts: the own-part attention calls (:class:`OwnPart`).
        prefix_spans: ``(prefix, start, end)``: flat tokens ``start:end`` continue ``prefix`` (a
            :class:`~llm_calib.engine.prefix.PrefixKV`).
        rows: flat positions of ``packed.rows``.
        max_position: the largest position of the batch (prefix included).
        fused: ``attention_with_logsumexp``'s ``fused`` (None: the CPU's fused kernel on a CPU).
        layers_run: attention layers the pass has run so far.

    Example:
        >>> from llm_calib.engine.packing import pack_questions
        >>> fb = flat_batch(pack_questions([((1, 2), ((3,), (4, 5))), ((6,), ((7,),))], pad_id=0), None)
        >>> fb.input_ids.tolist(), fb.position_ids.tolist(), fb.rows.tolist()
        ([[1, 2, 4, 6]], [[0, 1, 2, 0]], [1, 2, 3])
    """

    input_ids: Tensor
    position_ids: Tensor
    own_parts: list[OwnPart]
    prefix_spans: list[tuple[Any, int, int]]
    rows: Tensor
    max_position: int
    fused: bool | None = None
    layers_run: int = field(default=0)

    @property
    def n_tokens(self) -> int:
        """Number of tokens that run."""
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device | str) -> FlatBatch:
        """The tensors on ``device`` (the prefixes stay where they are)."""
        return FlatBatch(self.input_ids.to(device), self.position_ids.to(device),
                         [p.to(device) for p in self.own_parts], self.prefix_spans, self.rows.to(device),
                         self.max_position, self.fused)


def _own_part(masks: list[Tensor], starts: list[int], dtype: torch.dtype) -> OwnPart:
    """One own-part call over rows with the given ``(m, m)`` masks of their kept tokens, the first at flat ``start``."""
    n, width = len(masks), max(m.shape[0] for m in masks)
    slots = torch.zeros(n * width, dtype=torch.long)
    tokens, valid = [], []
    causal = True
    for r, (m, start) in enumerate(zip(masks, starts, strict=True)):
        k = m.shape[0]
        slots[r * width : r * width + k] = torch.arange(start, start + k)
        tokens.append(torch.arange(start, start + k))
        valid.append(torch.arange(r * width, r * width + k))
        causal = causal and bool(torch.equal(m, torch.ones(k, k, dtype=torch.bool).tril()))
    bias = None
    if not causal:
        allowed = torch.eye(width, dtype=torch.bool).repeat(n, 1, 1)  # a padding query sees itself
        for r, m in enumerate(masks):
            allowed[r, : m.shape[0], : m.shape[0]] = m
        bias = torch.zeros((n, 1, width, width), dtype=dtype).masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return OwnPart(slots, torch.cat(tokens), torch.cat(valid), bias, (n, width))


def flat_batch(packed: PackedQuestions, prefixes: Any | Sequence[Any | None] | None,
               dtype: torch.dtype = torch.float32, *, own_overhead: int = OWN_PART_OVERHEAD) -> FlatBatch:
    """Lay a packed batch out flat (:class:`FlatBatch`).

    The own-part attention of rows of very different lengths is split into calls of similar
    length (:func:`~llm_calib.engine.packing.length_parts` on the squared lengths: fewest query-key
    pairs, ``own_overhead`` pairs per call); a call whose rows are plainly causal runs without a mask.

    Args:
        packed: the batch, its rows holding what follows each question's prefix.
        prefixes: the :class:`~llm_calib.engine.prefix.PrefixKV` every row continues, one per row
            (None: that row has no prefix), or None for none at all. Rows on the same prefix object
            are laid out next to each other (one attention call per prefix).
        dtype: dtype of the additive own-part masks (the model's compute dtype).
        own_overhead: the cost of one more own-part call, in query-key pairs.

    Raises:
        ValueError: ``prefixes`` does not have one entry per row.

    Example:
        >>> from llm_calib.engine.packing import pack_letters, pack_questions
        >>> fb = flat_batch(pack_letters([(1, 2, 3), (4,)], [(7, 8), (7, 8)], pad_id=0), None)
        >>> fb.input_ids.tolist(), [p.bias is None for p in fb.own_parts]
        ([[1, 2, 3, 4]], [True])
        >>> flat_batch(pack_questions([((1, 2), ((3,), (4, 5)))], pad_id=0), None).input_ids.tolist()  # not 3, 5
        [[1, 2, 4]]
    """
    B, L = packed.input_ids.shape
    per_row = prefixes_per_row(prefixes, B)
    # rows on the same prefix next to each other, in order of first appearance (no prefix: key None)
    first: dict[int, int] = {}
    for b, p in enumerate(per_row):
        first.setdefault(id(p), b)
    order = sorted(range(B), key=lambda b: (first[id(per_row[b])], b))
    own = _own_mask(packed)[:, 0]
    # a token runs only if its hidden state is read (a row) or another token attends to it: the last
    # token of each option (or answer) does neither
    real = torch.arange(L)[None, :] < packed_lengths(packed)[:, None]
    seen = (own & real[:, :, None] & ~torch.eye(L, dtype=torch.bool)[None]).any(dim=1)
    needed = torch.zeros(B * L, dtype=torch.bool)
    needed[packed.rows] = True
    keep = real & (seen | needed.view(B, L))
    kept = [keep[b].nonzero().flatten() for b in range(B)]
    flat_slot = torch.cat([b * L + kept[b] for b in order])
    N = flat_slot.numel()
    slot_flat = torch.zeros(B * L, dtype=torch.long)
    slot_flat[flat_slot] = torch.arange(N)
    offset = torch.tensor([per_row[b].length if per_row[b] is not None else 0 for b in range(B)])
    position_ids = (packed.position_ids + offset[:, None]).reshape(-1)[flat_slot]
    spans: list[tuple[Any, int, int]] = []
    start = {}
    at = 0
    for b in order:
        p, end = per_row[b], at + kept[b].numel()
        start[b] = at
        if p is not None:
            if spans and spans[-1][0] is p and spans[-1][2] == at:
                spans[-1] = (p, spans[-1][1], end)
            else:
                spans.append((p, at, end))
        at = end
    masks = [own[b][kept[b]][:, kept[b]] for b in range(B)]
    parts = [_own_part([masks[b] for b in part], [start[b] for b in part], dtype)
             for part in length_parts([m.shape[0] ** 2 for m in masks], own_overhead)]
    return FlatBatch(packed.input_ids.reshape(-1)[flat_slot][None], position_ids[None], parts, spans,
                     slot_flat[packed.rows], int(position_ids.max()) if N else 0)


MAX_SCORES = 2**24
"""Most attention scores :func:`attention_with_logsumexp` holds at once without the fused kernel (64 MiB
in float32): longer query sets run in blocks of queries."""

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attention_with_logsumexp(query: Tensor, key: Tensor, value: Tensor, bias: Tensor | None,
                             scale: float, *, causal: bool = False, fused: bool | None = None) -> tuple[Tensor, Tensor]:
    """Attention output and the log-sum-exp of each query's scaled scores (over the allowed keys).

    ``query`` is ``(B, heads, Lq, D)``; ``key``/``value`` ``(B, kv_heads, Lk, D)`` with query head
    ``h`` on key head ``h // (heads // kv_heads)`` (grouped-query attention without copies);
    ``bias`` an additive ``(B, 1, Lq, Lk)`` mask or None; ``causal``: query ``i`` sees keys up to
    ``i`` (no ``bias`` then). On a CPU the fused flash kernel computes both (``fused`` None or
    True); elsewhere, or with ``fused=False``, matrix products in float32 (float64 for float64) do.

    Returns:
        ``(out, lse)``: ``(B, heads, Lq, D)`` in the query's dtype and ``(B, heads, Lq)`` in float32
        (float64 for a float64 query).

    Example:
        >>> q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
        >>> out, lse = attention_with_logsumexp(q, k, v, None, 8 ** -0.5)
        >>> ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        >>> bool(torch.allclose(out, ref, atol=1e-5)), tuple(lse.shape)
        (True, (1, 4, 3))
    """
    if fused is None:
        fused = _CPU_FLASH is not None and query.device.type == "cpu"
    if causal and bias is not None:
        raise ValueError("attention_with_logsumexp: a causal call takes no bias")
    if fused and (_CPU_FLASH is None or query.device.type != "cpu"):
        raise ValueError(f"attention_with_logsumexp: the fused kernel runs on a CPU only, not {query.device}")
    work = torch.promote_types(query.dtype, torch.float32)
    if fused:
        out, lse = _CPU_FLASH(query, key, value, 0.0, causal, attn_mask=bias, scale=scale)
        return out, lse.to(work)
    B, H, Lq, D = query.shape
    KV, Lk = key.shape[1], key.shape[2]
    G = H // KV
    k, v = key.to(work).transpose(-1, -2), value.to(work)
    step = max(1, MAX_SCORES // max(B * H * Lk, 1))  # queries per product: the scores bounded in memory
    outs, lses = [], []
    for start in range(0, Lq, step):
        end = min(start + step, Lq)
        q = query[:, :, start:end].to(work).reshape(B, KV, G * (end - start), D)
        scores = torch.matmul(q, k) * scale
        if causal:
            above = torch.arange(start, end, device=query.device)[:, None] < torch.arange(Lk, device=query.device)
            scores = scores.masked_fill_(above.repeat(G, 1), float("-inf"))
        elif bias is not None:
            scores = scores + bias[:, :, start:end].to(work).expand(B, 1, end - start, Lk).repeat(1, 1, G, 1)
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.matmul(torch.exp(scores - lse[..., None]), v).reshape(B, H, end - start, D))
        lses.append(lse.reshape(B, H, end - start))
    return torch.cat(outs, 2).to(query.dtype), torch.cat(lses, 2)


def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Attention over two disjoint key sets from each set's output and log-sum-exp (``out`` ``(..., D)``,
    ``lse`` ``(...)``); the result is in ``out_a``'s dtype, its log-sum-exp in ``lse_a``'s.

    Example:
        >>> q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
        >>> a = attention_with_logsumexp(q, k[:, :, :2], v[:, :, :2], None, 0.5, fused=False)
        >>> b = attention_with_logsumexp(q, k[:, :, 2:], v[:, :, 2:], None, 0.5, fused=False)
        >>> whole, _ = attention_with_logsumexp(q, k, v, None, 0.5, fused=False)
        >>> bool(torch.allclose(merge_attention(*a, *b)[0], whole, atol=1e-6))
        True
    """
    lse = torch.logaddexp(lse_a, lse_b.to(lse_a.dtype))
    work = torch.promote_types(out_a.dtype, lse.dtype)
    out = out_a.to(work) * torch.exp(lse_a - lse)[..., None] + out_b.to(work) * torch.exp(lse_b - lse)[..., None]
    return out.to(out_a.dtype), lse


_ACTIVE: contextvars.ContextVar[FlatBatch | None] = contextvars.ContextVar("llm_calib_flat_batch", default=None)


def _in_slots(x: Tensor, part: OwnPart) -> Tensor:
    """``(1, h, N, D)`` -> ``(rows, h, width, D)``: an own part's tokens in their slots."""
    n, width = part.shape
    return x[0].index_select(1, part.slots).view(x.shape[1], n, width, x.shape[-1]).transpose(0, 1)


def _flat_attention(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                    dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> tuple[Tensor, None]:
    """The attention function transformers calls in every layer during a flat pass (``query``
    ``(1, heads, N, D)``, ``key``/``value`` ``(1, kv_heads, N, D)``, after rotary embeddings)."""
    batch = _ACTIVE.get()
    if batch is None:
        raise RuntimeError(f"the {FLAT_ATTENTION!r} attention runs only inside llm_calib.engine.flat.forward_rows_flat")
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise FlatUnsupportedError(f"attention with {name}")
    window = kwargs.get("sliding_window")
    if window is not None and batch.max_position >= window:
        raise FlatUnsupportedError(f"a sliding window of {window} tokens within the batch's {batch.max_position + 1}")
    layer = getattr(module, "layer_idx", None)
    if layer is None or dropout:
        raise FlatUnsupportedError("an attention module without layer_idx, or dropout")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    H, D = query.shape[1], query.shape[-1]
    out = torch.empty((H, batch.n_tokens, D), dtype=query.dtype, device=query.device)
    lse = torch.empty((H, batch.n_tokens), dtype=torch.promote_types(query.dtype, torch.float32), device=query.device)
    for part in batch.own_parts:
        n, width = part.shape
        own_out, own_lse = attention_with_logsumexp(_in_slots(query, part), _in_slots(key, part),
                                                    _in_slots(value, part), part.bias, scale, causal=part.bias is None,
                                                    fused=batch.fused)
        out.index_copy_(1, part.tokens, own_out.transpose(0, 1).reshape(H, n * width, D).index_select(1, part.valid))
        lse.index_copy_(1, part.tokens, own_lse.transpose(0, 1).reshape(H, n * width).index_select(1, part.valid))
    for prefix, start, end in batch.prefix_spans:
        pk, pv = prefix.layers[layer]
        pre_out, pre_lse = attention_with_logsumexp(query[:, :, start:end], pk, pv, None, scale, fused=batch.fused)
        out[:, start:end], lse[:, start:end] = merge_attention(out[:, start:end], lse[:, start:end], pre_out[0], pre_lse[0])
    batch.layers_run += 1
    return out.transpose(0, 1).unsqueeze(0).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The flat attention builds its own masks: transformers' mask builders return none."""
    return None


_REGISTERED = False


def _register() -> bool:
    """Register :data:`FLAT_ATTENTION` with transformers (once); False when this transformers has no attention interface."""
    global _REGISTERED
    if _REGISTERED:
        return True
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    AttentionInterface.register(FLAT_ATTENTION, _flat_attention)
    with contextlib.suppress(ImportError):
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface.register(FLAT_ATTENTION, _no_mask)
    _REGISTERED = True
    return True


_UNSUPPORTED: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_SETTINGS: contextvars.ContextVar[tuple[bool, bool | None]] = contextvars.ContextVar(
    "llm_calib_flat_batches", default=(True, None))


@contextlib.contextmanager
def flat_batches(enabled: bool = True, *, fused_attention: bool | None = None) -> Iterator[None]:
    """Whether scorers called inside the block run flat batches where the model allows (the default)
    or the padded layout (``enabled=False``: the layout before flat batches, for comparisons), and
    how flat attention is computed: the CPU's fused flash kernel (``fused_attention`` None: on a
    CPU) or matrix products (False: what other devices run).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model = tiny_random_model()[0]
        >>> with flat_batches(False):
        ...     flat_supported(model)
        False
    """
    token = _SETTINGS.set((bool(enabled), fused_attention))
    try:
        yield
    finally:
        _SETTINGS.reset(token)


def flat_supported(model: Any) -> bool:
    """Whether ``model`` runs flat batches: a decoder whose config transformers' attention interface
    dispatches on, no logit soft-capping in attention, not found unsupported by an earlier pass,
    and flat batches not turned off (:func:`flat_batches`).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> flat_supported(tiny_random_model()[0])
        True
    """
    if not _SETTINGS.get()[0]:
        return False
    try:
        decoder, _ = split_decoder_head(model)
    except TypeError:
        return False
    config = getattr(decoder, "config", None)
    if decoder in _UNSUPPORTED or config is None or not hasattr(config, "_attn_implementation"):
        return False
    if getattr(config, "sub_configs", None) or getattr(config, "attn_logit_softcapping", None):
        return False
    return _register()


@contextlib.contextmanager
def _flat_pass(decoder: Any, batch: FlatBatch) -> Iterator[None]:
    """The decoder's attention set to :data:`FLAT_ATTENTION` on ``batch`` for the block, restored after."""
    config = decoder.config
    saved = config._attn_implementation
    token = _ACTIVE.set(batch)
    # transformers' own switch, which its attention layers read at every call (setattr: a transformers
    # attribute, not one of this project's private names)
    setattr(config, "_attn_implementation", FLAT_ATTENTION)  # noqa: B010
    try:
        yield
    finally:
        setattr(config, "_attn_implementation", saved)  # noqa: B010
        _ACTIVE.reset(token)


def forward_rows_flat(model: Any, packed: PackedQuestions, prefixes: Any | Sequence[Any | None] | None = None) -> Tensor:
    """Final hidden states at ``packed.rows`` of a packed batch run flat (the module docstring),
    each row continuing its prefix (:func:`flat_batch`'s ``prefixes``). The result equals
    :func:`~llm_calib.engine.options.forward_rows` on the whole sequences up to float rounding.

    Raises:
        FlatUnsupportedError: the model cannot run flat (check :func:`flat_supported` first);
            the model is then remembered as unsupported.

    Example:
        >>> from llm_calib.engine.options import forward_rows
        >>> from llm_calib.engine.packing import pack_questions
        >>> from llm_calib.models import tiny_random_model
        >>> model = tiny_random_model()[0]
        >>> packed = pack_questions([((5, 6, 7), ((8,), (9, 10))), ((11,), ((12, 13),))], pad_id=0)
        >>> bool(torch.allclose(forward_rows_flat(model, packed), forward_rows(model, packed)[0], atol=1e-5))
        True
    """
    if not flat_supported(model):
        raise FlatUnsupportedError(f"{type(model).__name__} cannot run flat batches")
    decoder, _ = split_decoder_head(model)
    device = next(decoder.parameters()).device
    batch = flat_batch(packed, prefixes, compute_dtype(model)).to(device)
    batch.fused = _SETTINGS.get()[1]
    try:
        with torch.inference_mode(), _flat_pass(decoder, batch):
            out = decoder(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
        layers = len(getattr(decoder, "layers", ())) or decoder.config.num_hidden_layers
        if batch.layers_run != layers:
            raise FlatUnsupportedError(f"{batch.layers_run} of {layers} attention layers ran the flat attention")
    except FlatUnsupportedError as err:
        _UNSUPPORTED[decoder] = str(err)
        log.info("flat batches are off for %s: %s", type(model).__name__, err)
        raise
    return out.last_hidden_state[0].index_select(0, batch.rows)
