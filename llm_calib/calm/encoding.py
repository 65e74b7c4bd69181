"""Records tokenised once for training and evaluation, with an optional trunk cache.

:func:`encode_records` turns a record set into an :class:`EncodedRecords`: token ids of every
prompt and option (or reference answer), ready to be packed into :class:`~llm_calib.calm.objectives.Batch`
es. The encoding depends only on the tokenizer and the prompt fields of the configuration, so one
encoding serves every method and seed run on the same records; with a trunk-caching model
(LoRA on the top layers only, :attr:`FunctionalLM.caches_trunk
<llm_calib.calm.lora.FunctionalLM.caches_trunk>`) it also keeps the frozen bottom layers' hidden
states of each question, computed once, for as long as the object lives.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from llm_calib.calm.config import CalibrationConfig, open_prompt_format
from llm_calib.calm.lora import FunctionalLM
from llm_calib.calm.objectives import Batch
from llm_calib.data.records import MultipleChoice, OpenQA, record_kind
from llm_calib.prompts import PromptFormat, build_prompt, continuation_text, uses_chat_template
from llm_calib.scoring.base import encode_continuation, encode_prompt
from llm_calib.scoring.letter import letter_token_ids
from llm_calib.scoring.open_ended import encode_open_prompts
from llm_calib.scoring.option_likelihood import encode_questions
from llm_calib.scoring.packing import (
    PackedQuestions,
    pack_continuations,
    pack_letters,
    pack_questions,
)

__all__ = ["LAYOUTS", "TRUNK_CHUNK", "EncodedRecords", "EncodingCache", "encode_records"]

LAYOUTS = ("options", "letter", "open")
"""How an :class:`EncodedRecords` packs its questions (see its ``layout``)."""

TRUNK_CHUNK = 16
"""Questions per trunk-cache forward pass: question ``i`` is always computed with the questions of
its chunk ``[16 (i // 16), 16 (i // 16) + 16)``, so each cached value is independent of which batch
first needed it and a resumed or data-parallel run computes the same numbers."""


@dataclass
class EncodedRecords:
    """Tokenised questions of one record set, ready to be packed into batches.

    Attributes:
        records: the records, in order (batch indices refer to positions in this list).
        prompts: prompt token ids per record.
        options: per record, the option continuations (``"options"``), one letter id per option
            (``"letter"``) or the reference answer alone (``"open"``).
        layout: ``"options"`` (option likelihood: prompt + every option, packed), ``"letter"``
            (listed prompt, one answer-letter token per option) or ``"open"`` (open questions,
            prompt + reference answer as a plain causal sequence).
        answer_stop: ``"open"``: each reference ends with the stop token of greedy answering (the
            short-answer prompt, :func:`encode_records`); its batches say so
            (:attr:`Batch.answer_stop <llm_calib.calm.objectives.Batch>`).
        trunk_cache: hidden states entering the first trainable layer, per record index, filled
            by :meth:`batch` and :meth:`fill_trunk_cache` with a trunk-caching model. They depend
            on the frozen base model only, so an encoding may be reused by every run on the same
            base model and adapted layers; a different base needs a fresh encoding.

    Example:
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> enc = encode_records(tok, builtin_multiple_choice(n_per_domain=2, domains=["capitals"]),
        ...                      CalibrationConfig())
        >>> len(enc), enc.layout, enc.pack([0, 1], 0).input_ids.shape[0]
        (2, 'options', 2)
    """

    records: list[MultipleChoice] | list[OpenQA]
    prompts: list[tuple[int, ...]]
    options: list[tuple[tuple[int, ...], ...]]
    layout: str
    trunk_cache: dict[int, Tensor] = field(default_factory=dict)
    answer_stop: bool = False

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")

    def __len__(self) -> int:
        return len(self.records)

    def pack(self, indices: Sequence[int], pad_id: int) -> PackedQuestions:
        """Pack the questions at ``indices`` into one model input (no trunk)."""
        idx = list(indices)
        if self.layout == "letter":
            return pack_letters([self.prompts[i] for i in idx], [[o[0] for o in self.options[i]] for i in idx], pad_id)
        if self.layout == "open":
            return pack_continuations([(self.prompts[i], self.options[i][0]) for i in idx], pad_id)
        return pack_questions([(self.prompts[i], self.options[i]) for i in idx], pad_id)

    def length(self, i: int) -> int:
        """Packed length (tokens) of question ``i``: its prompt plus its options (not letters)."""
        return len(self.prompts[i]) + (0 if self.layout == "letter" else sum(len(o) for o in self.options[i]))

    @property
    def trunk_cache_bytes(self) -> int:
        """Memory held by the trunk cache, in bytes."""
        return sum(v.numel() * v.element_size() for v in self.trunk_cache.values())

    def fill_trunk_cache(self, lm: FunctionalLM, pad_id: int, indices: Iterable[int] | None = None) -> None:
        """Compute the cached trunk of the questions at ``indices`` (default: all) that lack one.

        Does nothing when ``lm`` does not cache its trunk. Questions are computed chunk by chunk
        (:data:`TRUNK_CHUNK`), whichever indices are asked for.
        """
        if not lm.caches_trunk:
            return
        wanted = range(len(self.records)) if indices is None else indices
        chunks = sorted({i // TRUNK_CHUNK for i in wanted if i not in self.trunk_cache})
        for c in chunks:
            chunk = list(range(c * TRUNK_CHUNK, min((c + 1) * TRUNK_CHUNK, len(self.records))))
            hidden = lm.trunk_hidden(self.pack(chunk, pad_id))
            for row, i in enumerate(chunk):
                self.trunk_cache[i] = hidden[row, : self.length(i)].clone()

    def batch(self, indices: Sequence[int], pad_id: int, lm: FunctionalLM | None = None) -> Batch:
        """The :class:`~llm_calib.calm.objectives.Batch` of the questions at ``indices``.

        With a trunk-caching ``lm`` the batch carries the cached trunk (computed on first use).
        """
        idx = list(indices)
        packed = self.pack(idx, pad_id)
        open_ended = self.layout == "open"
        # an open question's one "option" is its reference answer, hence label 0
        labels = torch.tensor([0 if open_ended else self.records[i].gold for i in idx], dtype=torch.long)
        trunk = None
        if lm is not None and lm.caches_trunk:
            self.fill_trunk_cache(lm, pad_id, idx)
            L = packed.input_ids.shape[1]
            trunk = torch.stack(
                [torch.nn.functional.pad(self.trunk_cache[i], (0, 0, 0, L - self.trunk_cache[i].shape[0])) for i in idx]
            )
        return Batch(packed, labels, [self.records[i].id for i in idx], trunk, open_ended,
                     answer_stop=open_ended and self.answer_stop)


def encode_records(
    tokenizer: Any, records: Sequence[MultipleChoice] | Sequence[OpenQA], config: CalibrationConfig
) -> EncodedRecords:
    """Tokenise records once for the configured scorer and prompt format.

    Multiple-choice records follow ``config.prompt.scorer`` and ``config.prompt.style``. Open questions
    use the open-ended scorer's prompt (:func:`~llm_calib.scoring.open_ended.encode_open_prompts`)
    of :func:`~llm_calib.calm.config.open_prompt_format`, followed by the first reference alias as
    the continuation, tokenised on its own like an option: ``" " + alias`` under the chat prompt,
    ``" " + alias + "\\n"`` under the few-shot short-answer prompt (``config.prompt.open_examples``), so
    the trained answer ends with the newline token at which greedy answering stops (to train on
    every alias, give one record per alias: :func:`~llm_calib.data.one_record_per_alias`).

    Args:
        tokenizer: the model's tokenizer.
        records: all multiple choice or all open questions.
        config: the run's configuration (only its ``prompt`` part matters).

    Returns:
        An :class:`EncodedRecords` with an empty trunk cache.

    Raises:
        ValueError: no records, records of both kinds or of another type, or an open question
            without a reference answer (each naming the record).

    Example:
        >>> from llm_calib.data import OpenQA
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> enc = encode_records(tok, [OpenQA("Capital of France?", ("Paris",), "geo", "q0")],
        ...                      CalibrationConfig())
        >>> enc.layout, tok.decode(enc.options[0][0])
        ('open', ' Paris')
    """
    records = list(records)
    if not records:
        raise ValueError("no records to encode")
    if record_kind(records) == "open":
        unanswered = [r.id for r in records if not r.answers]
        if unanswered:
            raise ValueError(f"open question {unanswered[0]!r} has no reference answer to train or monitor on")
        prompts = encode_open_prompts(tokenizer, records, open_prompt_format(config))
        stop = "\n" if config.prompt.open_examples else ""
        answers = [(tuple(encode_continuation(tokenizer, continuation_text(r.answers[0]) + stop)),) for r in records]
        return EncodedRecords(records, [tuple(p) for p in prompts], answers, layout="open",
                              answer_stop=bool(config.prompt.open_examples))
    if config.prompt.scorer == "letter":
        fmt = PromptFormat(style="listed", chat_template=config.prompt.chat_template)
        chat = uses_chat_template(tokenizer, fmt)
        prompts = [tuple(encode_prompt(tokenizer, build_prompt(tokenizer, r.question, r.options, fmt), chat=chat)) for r in records]
        options = [tuple((t,) for t in letter_token_ids(tokenizer, len(r.options))) for r in records]
        return EncodedRecords(records, prompts, options, layout="letter")
    fmt = PromptFormat(style=config.prompt.style, chat_template=config.prompt.chat_template)
    enc = encode_questions(tokenizer, records, fmt)
    return EncodedRecords(records, [e.prompt for e in enc], [e.options for e in enc], layout="options")


class EncodingCache:
    """One :class:`EncodedRecords` (and so one trunk cache) per record set, prompt format and
    adapted layers, reused by every run that asks for it: several methods and seeds on the same
    base model pay for tokenisation and the frozen trunk once.

    Example:
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> qs, cache = builtin_multiple_choice(n_per_domain=2, domains=["capitals"]), EncodingCache()
        >>> from llm_calib.calm.config import TrainingSettings
        >>> cache(tok, qs, CalibrationConfig()) is cache(tok, list(qs), CalibrationConfig(training=TrainingSettings(lr=0.1)))
        True
    """

    def __init__(self) -> None:
        self.encodings: dict[Any, EncodedRecords] = {}

    def __call__(self, tokenizer: Any, records: Sequence[Any], config: CalibrationConfig) -> EncodedRecords:
        """The encoding of ``records`` under ``config``'s scorer, prompt style, chat template, open
        examples and LoRA layers (records are recognised by domain and id); made on first use."""
        prompt = config.prompt
        key = (tuple(f"{r.domain}/{r.id}" for r in records), prompt.scorer, prompt.style, prompt.chat_template,
               prompt.open_examples, config.lora.layers, config.lora.top_layers)
        if key not in self.encodings:
            self.encodings[key] = encode_records(tokenizer, records, config)
        return self.encodings[key]
