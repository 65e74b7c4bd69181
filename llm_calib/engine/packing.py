"""The batch layout of multiple-choice questions, shared by scoring and training.

One row per question holds ``prompt + option_1 + ... + option_K``; a 4-D mask lets each option
attend to the prompt and itself only, and positions restart after the prompt for every option.
Only the hidden states that predict an option token (``rows``) go through the vocabulary head.
Letters (:func:`pack_letters`) and open answers (:func:`pack_continuations`) use the same structure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, NamedTuple

import torch
from torch import Tensor

from llm_calib.config.choices import NORMALIZE_MODES

__all__ = [
    "LENGTH_NORMALIZATIONS",
    "PACKED_MASK_ATTENTION",
    "PART_OVERHEAD_TOKENS",
    "OptionSequences",
    "PackedQuestions",
    "accepts_packed_masks",
    "causal_additive_mask",
    "gather_token_logprobs",
    "length_batches",
    "length_parts",
    "option_scores_from_logits",
    "option_sequences",
    "pack_continuations",
    "pack_letters",
    "pack_prompts",
    "pack_questions",
    "reduce_per_option",
]

LENGTH_NORMALIZATIONS: tuple[str, ...] = ("char", "byte")
"""The modes of :data:`~llm_calib.config.choices.NORMALIZE_MODES` that divide by the option's text length (they need the option texts)."""


@dataclass
class PackedQuestions:
    """Model inputs and gather indices for a batch of questions.

    Attributes:
        input_ids: ``(B, L)`` token ids.
        attention_mask: ``(B, 1, L, L)`` boolean "may attend" mask, or ``(B, L)`` padding mask.
        position_ids: ``(B, L)``.
        rows: flat indices ``b * L + t`` of the hidden states that need the head.
        target_rows: for each scored token, its index into ``rows``.
        target_ids: for each scored token, the token id whose log-probability is read.
        target_option: for each scored token, the global option index it belongs to.
        option_question: for each option, its question index.
        option_lengths: token count of each option.
        n_options: options per question.

    Example:
        >>> p = pack_questions([((1, 2), ((3,), (4, 5)))], pad_id=0)
        >>> p.input_ids.tolist(), p.position_ids.tolist()
        ([[1, 2, 3, 4, 5]], [[0, 1, 2, 2, 3]])
        >>> p.rows.tolist(), p.target_rows.tolist(), p.target_ids.tolist()
        ([1, 3], [0, 0, 1], [3, 4, 5])
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    rows: Tensor
    target_rows: Tensor
    target_ids: Tensor
    target_option: Tensor
    option_question: Tensor
    option_lengths: Tensor
    n_options: list[int]
    _memo: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    """What :meth:`on`, :meth:`additive_mask` and :meth:`option_slots` made once for this batch (its tensors are
    never changed in place): a training step evaluates its losses on one batch many times."""

    @property
    def batch_size(self) -> int:
        """Number of questions."""
        return len(self.n_options)

    def _once(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, kept for the next call with ``key``; made afresh (not kept) in inference mode, whose tensors
        a later differentiated pass could not save, and while :func:`torch.compile` traces."""
        if key in self._memo:
            return self._memo[key]
        value = make()
        if not torch.is_inference_mode_enabled() and not torch.compiler.is_compiling():
            self._memo[key] = value
        return value

    def on(self, device: torch.device | str) -> PackedQuestions:
        """This batch with its tensors on ``device``: itself where they are, else a copy made once.

        Example:
            >>> p = pack_questions([((1, 2), ((3,), (4, 5)))], pad_id=0)
            >>> p.on("cpu") is p
            True
        """
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        return self._once(("on", device), lambda: replace(self, **{
            f.name: getattr(self, f.name).to(device) for f in fields(self)
            if f.init and isinstance(getattr(self, f.name), Tensor)}))

    def option_slots(self, device: torch.device | str | None = None) -> Tensor:
        """Per option, its place among its question's options (``0 .. K-1``): with :attr:`option_question`, where
        its score goes in a ``(B, K_max)`` table.

        Example:
            >>> pack_questions([((1,), ((2,), (3,))), ((4,), ((5,), (6,), (7,)))], pad_id=0).option_slots().tolist()
            [0, 1, 0, 1, 2]
        """
        device = self.option_question.device if device is None else torch.device(device)
        return self._once(("option_slots", device), lambda: torch.tensor(
            [k for n in self.n_options for k in range(n)], dtype=torch.long, device=device))

    def answer_start_rows(self) -> Tensor:
        """Per question, the index into ``rows`` of the last prompt position (predicts every answer's first token).

        Example:
            >>> p = pack_questions([((1, 2), ((3,), (4, 5))), ((6,), ((7, 8),))], pad_id=0)
            >>> p.answer_start_rows().tolist()
            [0, 2]
        """
        first_target = torch.cumsum(self.option_lengths, 0) - self.option_lengths
        n_opt = torch.tensor(self.n_options)
        first_option = torch.cumsum(n_opt, 0) - n_opt
        return self.target_rows[first_target[first_option]]

    def option_length_table(self, device: torch.device | str | None = None) -> Tensor:
        """Option lengths in tokens laid out like the option scores, ``(B, K_max)`` float64 (0 for padding), on
        ``device`` (default: the batch's); made once per device.

        Example:
            >>> pack_questions([((1,), ((2,), (3, 4))), ((5,), ((6, 7, 8),))], 0).option_length_table().tolist()
            [[1.0, 2.0], [3.0, 0.0]]
        """
        device = self.option_lengths.device if device is None else torch.device(device)

        def make() -> Tensor:
            on = self.on(device)
            out = torch.zeros((self.batch_size, max(self.n_options)), dtype=torch.float64, device=device)
            return out.index_put((on.option_question, self.option_slots(device)), on.option_lengths.to(torch.float64))

        return self._once(("option_length_table", device), make)

    def additive_mask(self, dtype: torch.dtype, device: torch.device | str | None = None) -> Tensor:
        """The 4-D mask as additive biases (0 where allowed, the dtype's minimum elsewhere), on ``device``
        (default: the mask's); made once per dtype and device."""
        if self.attention_mask.dim() != 4:
            raise ValueError("additive_mask needs the 4-D packed mask")
        device = self.attention_mask.device if device is None else torch.device(device)

        def make() -> Tensor:
            allowed = self.on(device).attention_mask
            out = torch.zeros(allowed.shape, dtype=dtype, device=device)
            return out.masked_fill_(~allowed, torch.finfo(dtype).min)

        return self._once(("additive_mask", dtype, device), make)


def length_batches(lengths: Sequence[int], size: int) -> Iterator[list[int]]:
    """Indices in order of increasing length, in batches of ``size`` (little padding per batch).

    Example:
        >>> list(length_batches([5, 1, 3], 2))
        [[1, 2], [0]]
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    for start in range(0, len(order), size):
        yield order[start : start + size]


PART_OVERHEAD_TOKENS = 64
"""What one more forward pass costs in :func:`length_parts`, in padded tokens: the per-pass work that does not
scale with the tokens (Python, operator dispatch, the head's smaller GEMMs), measured as a few milliseconds per pass of
SmolLM2-135M's top layers against about 1.5 ms of CPU time per token (``benchmarks/calm_step_profile.py``)."""


def length_parts(lengths: Sequence[int], overhead: int = PART_OVERHEAD_TOKENS, *,
                 n_parts: int | None = None) -> list[list[int]]:
    """Split one batch into parts of similar length that cost fewer padded tokens together.

    A batch padded to its longest question spends the token-wise work (every projection, the MLP,
    the norms) on its padding too: 28% of the tokens of batch-8 ARC-Easy training batches. The
    questions sorted by length are cut into contiguous parts minimising
    ``sum(len(part) * longest(part)) + overhead * number_of_parts`` (exact dynamic programme).
    Each question's numbers do not depend on the part it is in beyond float rounding (padding is
    masked out), so running the parts one by one computes what the whole batch does. Under
    ``torchrun`` the ranks must run the same number of parts (FSDP2 gathers weights in every
    pass), so each rank splits its shard into ``n_parts`` parts, a count they agree on
    (:meth:`EncodedRecords.batch <llm_calib.calm.encoding.EncodedRecords.batch>`).

    Args:
        lengths: packed length of each question of the batch.
        overhead: the cost of one more part, in padded tokens (>= 0).
        n_parts: split into exactly this many parts (1 to ``len(lengths)``; ``overhead`` then
            plays no part); None: as many as cost least.

    Returns:
        The parts as lists of positions in ``lengths``, shortest questions first; one part holding
        every position when splitting saves nothing (without ``n_parts``).

    Raises:
        ValueError: no lengths, a negative ``overhead``, or ``n_parts`` out of range.

    Example:
        >>> length_parts([100, 40, 42, 98], overhead=10)
        [[1, 2], [3, 0]]
        >>> length_parts([100, 40, 42, 98], overhead=200)
        [[1, 2, 3, 0]]
        >>> length_parts([100, 40, 42, 98], overhead=200, n_parts=2)
        [[1, 2], [3, 0]]
    """
    if not lengths:
        raise ValueError("length_parts needs at least one length")
    if overhead < 0:
        raise ValueError(f"overhead must be >= 0 (padded tokens per part), got {overhead}")
    if n_parts is not None and not 1 <= n_parts <= len(lengths):
        raise ValueError(f"n_parts must be between 1 and the {len(lengths)} lengths, got {n_parts}")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    n = len(order)
    if n_parts is not None:
        return _cheapest_parts_of_count(lengths, order, n_parts)
    # best[j]: cheapest cost of the j shortest questions; cut[j]: where its last part starts
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]
        for i in range(j):
            cost = best[i] + (j - i) * longest + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    parts, j = [], n
    while j > 0:
        parts.append(order[cut[j] : j])
        j = cut[j]
    return parts[::-1]


def _cheapest_parts_of_count(lengths: Sequence[int], order: list[int], n_parts: int) -> list[list[int]]:
    """:func:`length_parts`' programme with the number of parts as a second index: the cheapest split of the
    length-sorted positions ``order`` into exactly ``n_parts`` contiguous parts (the overhead is the same for all)."""
    n = len(order)
    # best[k][j]: cheapest cost of the j shortest questions in k parts; cut[k][j]: where the k-th part starts
    best = [[0.0] + [float("inf")] * n]
    cut = [[0] * (n + 1)]
    for k in range(1, n_parts + 1):
        best.append([float("inf")] * (n + 1))
        cut.append([0] * (n + 1))
        for j in range(k, n + 1):
            longest = lengths[order[j - 1]]
            for i in range(k - 1, j):
                cost = best[k - 1][i] + (j - i) * longest
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    parts, j = [], n
    for k in range(n_parts, 0, -1):
        parts.append(order[cut[k][j] : j])
        j = cut[k][j]
    return parts[::-1]


def causal_additive_mask(attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive ``(B, 1, L, L)`` causal mask of a 2-D padding mask, for decoder layers run one by one.

    Padded keys are hidden; a padded query sees itself only (keeps softmax rows finite).

    Example:
        >>> m = causal_additive_mask(torch.tensor([[0, 1, 1]]), torch.float32)
        >>> (m[0, 0] == 0).int().tolist()
        [[1, 0, 0], [0, 1, 0], [0, 1, 1]]
    """
    keys = attention_mask.bool()
    L = keys.shape[1]
    allowed = torch.ones(L, L, dtype=torch.bool).tril()[None] & keys[:, None, :]
    allowed |= torch.eye(L, dtype=torch.bool)[None]
    out = torch.zeros((keys.shape[0], 1, L, L), dtype=dtype)
    return out.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)


def pack_questions(
    items: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], pad_id: int
) -> PackedQuestions:
    """Pack ``(prompt_ids, [option_ids, ...])`` pairs, one row per question.

    Raises:
        ValueError: no questions, an empty prompt or an option without tokens.

    Example:
        >>> p = pack_questions([((1, 2), ((3,), (4, 5))), ((6,), ((7,), (8,), (9,)))], pad_id=0)
        >>> p.input_ids.shape, p.n_options
        (torch.Size([2, 5]), [2, 3])
    """
    B = len(items)
    if B == 0:
        raise ValueError("pack_questions needs at least one question")
    L = max(len(p) + sum(len(o) for o in opts) for p, opts in items)
    # The rows are built as Python lists and become tensors at once: a few operators per batch, not
    # several per question and option (the packing runs in every training step).
    ids: list[list[int]] = []
    pos: list[list[int]] = []
    seg: list[list[int]] = []
    rows: list[int] = []
    target_rows: list[int] = []
    target_ids: list[int] = []
    target_option: list[int] = []
    option_question: list[int] = []
    option_lengths: list[int] = []
    n_options: list[int] = []
    for b, (prompt, options) in enumerate(items):
        p = len(prompt)
        if p == 0:
            raise ValueError(f"question {b}: empty prompt")
        row_ids, row_pos, row_seg = [int(t) for t in prompt], list(range(p)), [0] * p
        first_row = len(rows)
        rows.append(b * L + p - 1)  # predicts the first token of every option
        offset = p
        for k, opt in enumerate(options):
            n = len(opt)
            if n == 0:
                raise ValueError(f"question {b}, option {k}: no tokens")
            option_ids = [int(t) for t in opt]
            row_ids += option_ids
            row_pos += range(p, p + n)
            row_seg += [k + 1] * n
            option_index = len(option_lengths)
            target_rows.append(first_row)
            target_rows += range(len(rows), len(rows) + n - 1)
            rows += range(b * L + offset, b * L + offset + n - 1)
            target_ids += option_ids
            target_option += [option_index] * n
            option_question.append(b)
            option_lengths.append(n)
            offset += n
        n_options.append(len(options))
        pad = L - offset
        ids.append(row_ids + [pad_id] * pad)
        pos.append(row_pos + [0] * pad)
        seg.append(row_seg + [-1] * pad)
    input_ids, position_ids, segments, index_tensors = _grid_and_indices(
        [ids, pos, seg], [rows, target_rows, target_ids, target_option, option_question, option_lengths])
    prompt, padding = segments == 0, segments < 0  # (B, L) bool each
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    # a query sees the causal keys of the prompt and of its own option (never padding: its segment -1 matches
    # only padding queries, which see themselves alone below, keeping their softmax rows finite)
    same_option = (segments[:, :, None] == segments[:, None, :]) & ~padding[:, None, :]
    allowed = causal & (prompt[:, None, :] | same_option)
    allowed |= torch.eye(L, dtype=torch.bool) & padding[:, :, None]
    return PackedQuestions(input_ids, allowed[:, None], position_ids, *index_tensors, n_options)


def _grid_and_indices(grids: list[list[list[int]]], vectors: list[list[int]]) -> tuple[Any, ...]:
    """``torch.long`` tensors of equal-shaped ``(B, L)`` grids and of 1-D index lists, made as two tensors
    (one for the grids, one for the vectors) and handed out as views of them: a few operators per batch, where
    a tensor per list costs four each (packing runs in every training step)."""
    grid = torch.tensor(grids, dtype=torch.long)
    flat = torch.tensor([x for v in vectors for x in v], dtype=torch.long)
    B, L = grid.shape[1:]
    out: list[Any] = [grid.as_strided((B, L), (L, 1), i * B * L) for i in range(len(grids))]
    views, offset = [], 0
    for v in vectors:
        views.append(flat.as_strided((len(v),), (1,), offset))
        offset += len(v)
    return (*out, views)


def _right_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded ``(ids, padding mask, position ids)`` of plain causal sequences."""
    L = max(len(s) for s in seqs)
    # Python lists first, then one tensor each (not several operators per sequence)
    ids = torch.tensor([[int(t) for t in seq] + [pad_id] * (L - len(seq)) for seq in seqs], dtype=torch.long)
    mask = torch.tensor([[1] * len(seq) + [0] * (L - len(seq)) for seq in seqs], dtype=torch.long)
    pos = torch.tensor([[*range(len(seq)), *([max(len(seq) - 1, 0)] * (L - len(seq)))] for seq in seqs], dtype=torch.long)
    return ids, mask, pos


def pack_letters(prompts: Sequence[Sequence[int]], letter_ids: Sequence[Sequence[int]], pad_id: int) -> PackedQuestions:
    """Pack letter-scorer prompts (right-padded), one gathered row per question; each option is its letter token.

    Example:
        >>> p = pack_letters([(1, 2, 3), (4,)], [(7, 8), (7, 8, 9)], pad_id=0)
        >>> p.rows.tolist(), p.target_rows.tolist(), p.n_options
        ([2, 3], [0, 0, 1, 1, 1], [2, 3])
    """
    ids, mask, pos = _right_pad(prompts, pad_id)
    L = ids.shape[1]
    pairs = list(zip(prompts, letter_ids, strict=True))
    question = [b for b, (_, letters) in enumerate(pairs) for _ in letters]  # per letter (option): its question
    return PackedQuestions(
        ids, mask, pos, torch.tensor([b * L + len(p) - 1 for b, (p, _) in enumerate(pairs)]), torch.tensor(question),
        torch.tensor([int(t) for _, letters in pairs for t in letters]), torch.arange(len(question)),
        torch.tensor(question), torch.ones(len(question), dtype=torch.long), [len(letters) for _, letters in pairs],
    )


def pack_continuations(items: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int) -> PackedQuestions:
    """Pack ``(prompt_ids, answer_ids)`` pairs as right-padded causal sequences; the answer is the one "option".

    Raises:
        ValueError: no questions, an empty prompt or an answer without tokens.

    Example:
        >>> p = pack_continuations([((1, 2), (3, 4)), ((5,), (6,))], pad_id=0)
        >>> p.input_ids.tolist(), p.attention_mask.tolist()
        ([[1, 2, 3, 4], [5, 6, 0, 0]], [[1, 1, 1, 1], [1, 1, 0, 0]])
        >>> p.rows.tolist(), p.target_ids.tolist(), p.answer_start_rows().tolist()
        ([1, 2, 4], [3, 4, 6], [0, 2])
    """
    if not items:
        raise ValueError("pack_continuations needs at least one question")
    for b, (prompt, answer) in enumerate(items):
        if not prompt:
            raise ValueError(f"question {b}: empty prompt")
        if not answer:
            raise ValueError(f"question {b}: the answer has no tokens")
    ids, mask, pos = _right_pad([list(p) + list(a) for p, a in items], pad_id)
    L = ids.shape[1]
    rows = [b * L + len(p) - 1 + j for b, (p, a) in enumerate(items) for j in range(len(a))]
    target_ids = [int(t) for _, a in items for t in a]
    target_option = [b for b, (_, a) in enumerate(items) for _ in a]
    lengths = [len(a) for _, a in items]
    return PackedQuestions(
        ids, mask, pos, torch.tensor(rows), torch.arange(len(rows)), torch.tensor(target_ids),
        torch.tensor(target_option), torch.arange(len(items)), torch.tensor(lengths), [1] * len(items),
    )


def pack_prompts(prompts: Sequence[Sequence[int]], pad_id: int) -> PackedQuestions:
    """Pack prompts alone (right-padded), one gathered row per prompt: its last token, which predicts the
    first token of the answer (open questions' upper level reads the entropy there; no answer is needed).

    Each question has one "option" of one token; its target id is a placeholder 0 that no loss reads.

    Raises:
        ValueError: no prompts, or an empty one.

    Example:
        >>> p = pack_prompts([(5, 6, 7), (8,)], pad_id=0)
        >>> p.input_ids.tolist(), p.rows.tolist(), p.answer_start_rows().tolist()
        ([[5, 6, 7], [8, 0, 0]], [2, 3], [0, 1])
    """
    if not prompts:
        raise ValueError("pack_prompts needs at least one prompt")
    for b, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"question {b}: empty prompt")
    ids, mask, pos = _right_pad(prompts, pad_id)
    L, n = ids.shape[1], len(prompts)
    rows = [b * L + len(p) - 1 for b, p in enumerate(prompts)]
    return PackedQuestions(ids, mask, pos, torch.tensor(rows), torch.arange(n), torch.zeros(n, dtype=torch.long),
                           torch.arange(n), torch.arange(n), torch.ones(n, dtype=torch.long), [1] * n)


def reduce_per_option(token_values: Tensor, packed: PackedQuestions, normalize: str = "sum") -> Tensor:
    """Sum (``"sum"``) or average (``"mean"``) per-token values over each option's tokens (differentiable).

    Raises:
        ValueError: an unknown ``normalize``.

    Example:
        >>> import torch
        >>> p = pack_continuations([((1,), (2, 3)), ((4,), (5,))], pad_id=0)
        >>> reduce_per_option(torch.tensor([1.0, 3.0, 5.0]), p, "mean").tolist()
        [2.0, 5.0]
    """
    if normalize not in ("sum", "mean"):
        raise ValueError(f"normalize must be 'sum' or 'mean', got {normalize!r}")
    device = token_values.device
    on = packed.on(device)
    n_opt = len(packed.option_lengths)
    out = torch.zeros(n_opt, dtype=token_values.dtype, device=device).index_add(0, on.target_option, token_values)
    if normalize == "mean":
        out = out / on.option_lengths.to(token_values.dtype)
    return out


def gather_token_logprobs(logits: Tensor, packed: PackedQuestions) -> Tensor:
    """Log-probability of every scored token from logits ``(len(rows), V)``; half precision is upcast to float32.

    Example:
        >>> import torch
        >>> p = pack_questions([((1,), ((2,), (3, 4)))], pad_id=0)
        >>> [round(v, 4) for v in gather_token_logprobs(torch.zeros(2, 5), p).tolist()]
        [-1.6094, -1.6094, -1.6094]
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    on = packed.on(logp.device)
    return logp[on.target_rows, on.target_ids]


def option_scores_from_logits(logits: Tensor, packed: PackedQuestions, normalize: str = "sum",
                              lengths: Tensor | None = None) -> Tensor:
    """Option scores ``(B, K_max)`` from head logits at ``packed.rows`` (``-inf`` at padding; differentiable).

    An option's score is the sum or mean of its token log-probabilities, or (``"char"``,
    ``"byte"``) the sum divided by ``lengths``, its ``(B, K_max)`` length in characters or bytes.

    Raises:
        ValueError: an unknown ``normalize``, or ``"char"``/``"byte"`` without ``lengths``.

    Example:
        >>> import torch
        >>> p = pack_questions([((1,), ((2,), (3, 4)))], pad_id=0)
        >>> [round(v, 4) for v in option_scores_from_logits(torch.zeros(2, 5), p)[0].tolist()]
        [-1.6094, -3.2189]
    """
    if normalize not in NORMALIZE_MODES:
        spelled = ", ".join(repr(m) for m in NORMALIZE_MODES[:-1]) + f" or {NORMALIZE_MODES[-1]!r}"
        raise ValueError(f"normalize must be {spelled}, got {normalize!r}")
    by_length = normalize in LENGTH_NORMALIZATIONS
    if by_length and lengths is None:
        raise ValueError(f"normalize={normalize!r} needs the options' lengths in characters or bytes")
    device = logits.device
    token_lp = gather_token_logprobs(logits, packed)
    per_option = reduce_per_option(token_lp, packed, "sum" if by_length else normalize)
    B, K = packed.batch_size, max(packed.n_options)
    out = torch.full((B, K), float("-inf"), dtype=token_lp.dtype, device=device)
    out = out.index_put((packed.on(device).option_question, packed.option_slots(device)), per_option)
    if by_length:
        out = out / lengths.to(device, out.dtype)
    return out


PACKED_MASK_ATTENTION = ("eager", "sdpa")
"""Attention implementations that accept the packed 4-D masks (flash kernels do not)."""


def accepts_packed_masks(model: Any) -> bool:
    """True when ``model``'s attention implementation accepts the packed 4-D masks (else :func:`option_sequences`).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> accepts_packed_masks(tiny_random_model()[0])
        True
    """
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None) or "eager"
    return impl in PACKED_MASK_ATTENTION


class OptionSequences(NamedTuple):
    """Packed questions as one plain causal sequence per (question, option).

    Attributes:
        packed: the same questions with a ``(R, L')`` padding mask (R options); its ``rows`` pick
            the hidden states the packed ``rows`` picked, in order; other fields are the packed ones.
        source: per flat position of ``packed``, the packed flat position of the same token (padding: 0).
        target: per packed flat position, a flat position of ``packed`` with the same hidden state.
    """

    packed: PackedQuestions
    source: Tensor
    target: Tensor


def option_sequences(packed: PackedQuestions) -> OptionSequences:
    """Lay out packed questions as one sequence ``prompt + option`` per option, for kernels without 4-D masks.

    Each option sees the context it sees in the packed row, so every score is the same.

    Raises:
        ValueError: ``packed`` has a 2-D mask already.

    Example:
        >>> p = pack_questions([((1, 2), ((3,), (4, 5)))], pad_id=0)
        >>> seq = option_sequences(p)
        >>> seq.packed.input_ids.tolist(), seq.packed.rows.tolist()
        ([[1, 2, 3, 0], [1, 2, 4, 5]], [1, 6])
    """
    if packed.attention_mask.dim() != 4:
        raise ValueError("option_sequences needs questions packed with the 4-D mask (pack_questions)")
    B, L = packed.input_ids.shape
    # options are numbered question by question (pack_questions): each question's option lengths in order
    per_question = [t.tolist() for t in torch.split(packed.option_lengths, packed.n_options)]
    # the row predicting a question's first answer token is the last prompt token, b * L + P - 1
    last_prompt = packed.rows[packed.answer_start_rows()].tolist()
    prompt_len = [last_prompt[b] - b * L + 1 for b in range(B)]
    L2 = max(prompt_len[b] + n for b in range(B) for n in per_question[b])
    R = len(packed.option_lengths)
    ids = torch.zeros((R, L2), dtype=packed.input_ids.dtype)
    attn = torch.zeros((R, L2), dtype=torch.long)
    pos = torch.zeros((R, L2), dtype=torch.long)
    source = torch.zeros(R * L2, dtype=torch.long)
    target = torch.zeros(B * L, dtype=torch.long)
    r = 0
    for b in range(B):
        p = prompt_len[b]
        offset = p
        for k, n in enumerate(per_question[b]):
            src = torch.cat([torch.arange(p), torch.arange(offset, offset + n)]) + b * L
            ids[r, : p + n] = packed.input_ids.reshape(-1)[src]
            attn[r, : p + n] = 1
            pos[r, : p + n] = torch.arange(p + n)
            source[r * L2 : r * L2 + p + n] = src
            if k == 0:
                target[b * L : b * L + p] = torch.arange(p) + r * L2
            target[b * L + offset : b * L + offset + n] = torch.arange(p, p + n) + r * L2
            offset += n
            r += 1
    seq = PackedQuestions(
        ids, attn, pos, target[packed.rows], packed.target_rows, packed.target_ids, packed.target_option,
        packed.option_question, packed.option_lengths, packed.n_options,
    )
    return OptionSequences(seq, source, target)
