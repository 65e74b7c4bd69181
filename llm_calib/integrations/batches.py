"""Hugging Face causal-LM batches (``input_ids``, ``attention_mask``, ``labels``) as CALM batches.

A labelled batch is what a causal-LM collator gives a training loop: ``labels`` aligned with
``input_ids``, ``-100`` where nothing is predicted (the prompt, padding). Each sequence becomes one
open question of :class:`~llm_calib.formats.OpenEnded`'s layout: its labelled tokens are the
answer, the lower-level loss g is the mean token cross-entropy of each sequence's answer, averaged
over sequences, and the upper level reads the next-token distribution where the first answer
token is predicted. An unlabelled (upper-level) batch holds prompts only; the upper level reads
the next-token distribution after each prompt's last token, where the model starts answering.

Left or right padding, and padding-free packing (``position_ids`` restarting at 0 for every
sequence, no ``attention_mask``) are read alike: every sequence is taken out of its row and the
batch is packed again right-padded, as :func:`~llm_calib.engine.packing.pack_continuations` packs
llm-calib's own open questions (the same tensors when the labels are a block at the end).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from llm_calib.engine.packing import PackedQuestions

__all__ = ["IGNORE_INDEX", "LabelledSequence", "labelled_prompts", "labelled_sequences", "pack_labelled", "prompt_batch",
           "prompt_sequences"]

IGNORE_INDEX = -100
"""The label of a token that is not predicted (Hugging Face's and PyTorch's ``ignore_index``)."""


@dataclass(frozen=True)
class LabelledSequence:
    """One sequence of a labelled batch: its tokens and the positions whose token is predicted.

    Attributes:
        tokens: the token ids (padding removed).
        targets: positions ``j >= 1`` of ``tokens`` whose label is predicted from position ``j - 1``.
        target_ids: the label at each of ``targets``.

    Example:
        >>> LabelledSequence((5, 6, 7), (2,), (7,)).key
        ((5, 6, 7), (2,), (7,))
    """

    tokens: tuple[int, ...]
    targets: tuple[int, ...]
    target_ids: tuple[int, ...]

    @property
    def key(self) -> tuple[tuple[int, ...], ...]:
        """What identifies the sequence (its trunk-cache key)."""
        return self.tokens, self.targets, self.target_ids


def _tensor(inputs: Mapping[str, Any], key: str, what: str) -> Tensor:
    value = inputs[key]
    if not isinstance(value, Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{what}: {key!r} must be a tensor of token ids (B, L), got {type(value).__name__}") from err
    if value.dim() == 1:
        value = value.unsqueeze(0)
    if value.dim() != 2:
        raise ValueError(f"{what}: {key!r} must have shape (batch, length), got {tuple(value.shape)}")
    return value.detach().cpu()


def _rows(inputs: Mapping[str, Any], what: str) -> tuple[Tensor, list[list[tuple[int, int]]], dict[str, Tensor]]:
    """``input_ids`` and, per row, the ``(start, end)`` spans of its sequences; the other fields read."""
    if not isinstance(inputs, Mapping) or "input_ids" not in inputs:
        got = sorted(inputs) if isinstance(inputs, Mapping) else type(inputs).__name__
        raise ValueError(f"{what}: expected a Hugging Face causal-LM batch (a mapping with 'input_ids', "
                         f"'attention_mask', 'labels'), got {got}")
    ids = _tensor(inputs, "input_ids", what)
    fields = {k: _tensor(inputs, k, what) for k in ("attention_mask", "labels", "position_ids") if inputs.get(k) is not None}
    for key, value in fields.items():
        if value.shape != ids.shape:
            raise ValueError(f"{what}: {key!r} has shape {tuple(value.shape)}, 'input_ids' {tuple(ids.shape)}; "
                             "they must match")
    B, L = ids.shape
    spans: list[list[tuple[int, int]]] = []
    if "attention_mask" in fields:
        mask = fields["attention_mask"].bool()
        for b in range(B):
            where = torch.nonzero(mask[b]).flatten()
            if len(where) == 0:
                raise ValueError(f"{what}: row {b} has no tokens (its attention_mask is all 0)")
            start, end = int(where[0]), int(where[-1]) + 1
            if end - start != len(where):
                raise ValueError(f"{what}: row {b}'s attention_mask has a hole (padding between tokens); "
                                 "one sequence per row, padded on the left or the right")
            spans.append([(start, end)])
    elif "position_ids" in fields:  # padding-free packing: a sequence starts where its positions restart at 0
        pos = fields["position_ids"]
        for b in range(B):
            starts = [int(t) for t in torch.nonzero(pos[b] == 0).flatten()] or [0]
            if starts[0] != 0:
                raise ValueError(f"{what}: row {b}'s position_ids do not start at 0")
            spans.append([(s, e) for s, e in zip(starts, [*starts[1:], L], strict=True)])
    else:
        spans = [[(0, L)] for _ in range(B)]
    return ids, spans, fields


def labelled_sequences(inputs: Mapping[str, Any], *, what: str = "labelled batch") -> list[LabelledSequence]:
    """The sequences of a labelled causal-LM batch, with their predicted positions.

    ``labels[b, j]`` is the target of the token at position ``j`` predicted from position ``j - 1``
    (unshifted, as Hugging Face models take them); ``-100`` marks tokens that are not predicted.

    Raises:
        ValueError: no ``labels``, shapes that do not match, a row with a hole in its
            ``attention_mask``, or a sequence whose labels are all ``-100`` (nothing to train on);
            one line naming the batch and the row.

    Example:
        >>> import torch
        >>> batch = {"input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]),
        ...          "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
        ...          "labels": torch.tensor([[-100, -100, 7, 8], [-100, 10, -100, -100]])}
        >>> [(s.tokens, s.targets) for s in labelled_sequences(batch)]
        [((5, 6, 7, 8), (2, 3)), ((9, 10), (1,))]
        >>> labelled_sequences({**batch, "labels": torch.full((2, 4), -100)})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: labelled batch: row 0 has no labelled token (its labels are all -100): ...
    """
    ids, spans, fields = _rows(inputs, what)
    if "labels" not in fields:
        raise ValueError(f"{what}: no 'labels' (the tokens to predict, -100 elsewhere); a labelled batch needs "
                         "them, e.g. from DataCollatorForSeq2Seq or TRL's completion-only collator")
    labels = fields["labels"]
    out = []
    for b, row in enumerate(spans):
        for start, end in row:
            seg = labels[b, start:end]
            targets = [j for j in range(1, end - start) if int(seg[j]) != IGNORE_INDEX]
            if not targets:
                where = f"row {b}" if len(row) == 1 else f"row {b}, the sequence at positions {start}-{end - 1},"
                raise ValueError(
                    f"{what}: {where} has no labelled token (its labels are all -100): nothing to train on; "
                    "check that the completion survives truncation (max_length) and that the collator labels it")
            bad = [int(seg[j]) for j in targets if int(seg[j]) < 0]
            if bad:
                raise ValueError(f"{what}: row {b} has label {bad[0]}: labels are token ids or -100")
            out.append(LabelledSequence(tuple(int(t) for t in ids[b, start:end]), tuple(targets),
                                        tuple(int(seg[j]) for j in targets)))
    return out


def prompt_sequences(inputs: Mapping[str, Any], *, what: str = "upper-level batch") -> list[tuple[int, ...]]:
    """The prompts of an unlabelled (upper-level) causal-LM batch.

    Raises:
        ValueError: ``labels`` that mark any token (the upper level reads no labels: give it prompts
            only), shapes that do not match or a row with a hole in its ``attention_mask``.

    Example:
        >>> import torch
        >>> prompt_sequences({"input_ids": torch.tensor([[0, 5, 6]]), "attention_mask": torch.tensor([[0, 1, 1]])})
        [(5, 6)]
        >>> prompt_sequences({"input_ids": torch.tensor([[5, 6]]), "labels": torch.tensor([[-100, 6]])})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: upper-level batch: has labels (1 labelled token) where none are expected: ...
    """
    ids, spans, fields = _rows(inputs, what)
    if "labels" in fields and bool((fields["labels"] != IGNORE_INDEX).any()):
        n = int((fields["labels"] != IGNORE_INDEX).sum())
        raise ValueError(f"{what}: has labels ({n} labelled token{'s' if n != 1 else ''}) where none are expected: "
                         "the upper level reads the model's entropy where its answer starts, from prompts alone; "
                         "pass prompts without answers and without a 'labels' column")
    return [tuple(int(t) for t in ids[b, s:e]) for b, row in enumerate(spans) for s, e in row]


def _right_padded(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    B, L = len(seqs), max(len(s) for s in seqs)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for b, seq in enumerate(seqs):
        ids[b, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        mask[b, : len(seq)] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def pack_labelled(sequences: Sequence[LabelledSequence], pad_id: int) -> PackedQuestions:
    """Right-padded model inputs of labelled sequences; each sequence is one question whose one
    "option" is its labelled tokens (what :func:`~llm_calib.engine.packing.pack_continuations` packs
    for a prompt followed by its answer).

    Example:
        >>> from llm_calib.engine.packing import pack_continuations
        >>> p = pack_labelled([LabelledSequence((1, 2, 3, 4), (2, 3), (3, 4)), LabelledSequence((5, 6), (1,), (6,))], 0)
        >>> q = pack_continuations([((1, 2), (3, 4)), ((5,), (6,))], 0)
        >>> all(torch.equal(getattr(p, f), getattr(q, f)) for f in ("input_ids", "rows", "target_ids", "option_lengths"))
        True
    """
    if not sequences:
        raise ValueError("pack_labelled needs at least one sequence")
    ids, mask, pos = _right_padded([s.tokens for s in sequences], pad_id)
    L = ids.shape[1]
    rows = [b * L + j - 1 for b, s in enumerate(sequences) for j in s.targets]
    target_ids = [t for s in sequences for t in s.target_ids]
    target_option = [b for b, s in enumerate(sequences) for _ in s.targets]
    n = len(sequences)
    return PackedQuestions(ids, mask, pos, torch.tensor(rows), torch.arange(len(rows)), torch.tensor(target_ids),
                           torch.tensor(target_option), torch.arange(n),
                           torch.tensor([len(s.targets) for s in sequences]), [1] * n)


def labelled_prompts(inputs: Mapping[str, Any], *, what: str = "labelled batch") -> list[tuple[int, ...]]:
    """The prompt of each sequence of a labelled batch: its tokens before the first labelled one (the
    labels only mark where the answer starts; an upper level taken from a labelled set reads these).

    Example:
        >>> import torch
        >>> labelled_prompts({"input_ids": torch.tensor([[5, 6, 7, 8]]), "labels": torch.tensor([[-100, -100, 7, 8]])})
        [(5, 6)]
    """
    return [s.tokens[: s.targets[0]] for s in labelled_sequences(inputs, what=what)]


def prompt_batch(prompts: Sequence[Sequence[int]], pad_id: int) -> dict[str, Tensor]:
    """Prompts as an unlabelled causal-LM batch (``input_ids``, ``attention_mask``, right-padded).

    Example:
        >>> prompt_batch([(5, 6), (7,)], 0)["attention_mask"].tolist()
        [[1, 1], [1, 0]]
    """
    ids, mask, _ = _right_padded(prompts, pad_id)
    return {"input_ids": ids, "attention_mask": mask}
