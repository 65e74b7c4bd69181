"""Collators that turn questions into the batches a CALM step takes.

* :class:`MultipleChoiceCollator`: question + options (+ answer) -> the option-likelihood batch
  llm-calib's own trainer uses (every option scored as a continuation of the prompt in one packed
  row), under the prompt of a :class:`~llm_calib.config.calibration.CalibrationConfig`.
* :class:`OpenAnswerCollator`: open question (+ reference answer) -> a Hugging Face causal-LM
  batch (``input_ids``, ``attention_mask``, ``labels`` with -100 on the prompt), under the prompt
  ``llm-calib calibrate`` trains open questions with.

Both take examples as llm-calib records (:class:`~llm_calib.data.MultipleChoice`,
:class:`~llm_calib.data.OpenQA`) or as dicts (a ``datasets.Dataset`` row); with ``labels=False``
they make upper-level batches, and refuse examples that carry an answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from llm_calib.calm.encoding import EncodedRecords
from llm_calib.config.calibration import CalibrationConfig
from llm_calib.data.jsonl import mc_from_dict, openqa_from_dict
from llm_calib.data.records import MultipleChoice, OpenQA
from llm_calib.formats import OpenEnded, TaskFormat, multiple_choice_format
from llm_calib.integrations.batches import IGNORE_INDEX
from llm_calib.prompts.resolution import resolve_prompt_settings

__all__ = ["QUESTIONS_KEY", "MultipleChoiceCollator", "OpenAnswerCollator", "PromptCollator"]

QUESTIONS_KEY = "questions"
"""The key of a :class:`MultipleChoiceCollator` batch: ``{"questions": EncodedRecords}``."""

_ANSWER_KEYS = ("answer", "answers", "label", "answerKey", "gold")
_SOURCE = "collated example"


def _example_name(example: Any, position: int) -> str:
    rid = example.get("id") if isinstance(example, Mapping) else getattr(example, "id", None)
    return f"example {rid!r}" if rid is not None else f"example {position} of the batch"


def _mc_record(example: Any, position: int, labels: bool | None) -> MultipleChoice:
    if isinstance(example, MultipleChoice):
        return example
    if not isinstance(example, Mapping):
        raise ValueError(f"multiple-choice collator: {_example_name(example, position)} is a {type(example).__name__}; "
                         "expected a MultipleChoice record or a dict with 'question', 'options' and 'answer'")
    row = dict(example)
    choices = row.pop("choices", None)
    if "options" not in row and choices is not None:  # Hugging Face's ARC / CommonsenseQA layout
        row["options"] = list(choices["text"]) if isinstance(choices, Mapping) else list(choices)
        if isinstance(choices, Mapping) and "label" in choices and isinstance(row.get("answerKey"), str):
            letters = list(choices["label"])
            if row["answerKey"] in letters:
                row["answerKey"] = letters.index(row["answerKey"])
    given = [k for k in _ANSWER_KEYS if row.get(k) is not None]
    if labels is False and given:
        raise ValueError(f"upper-level batch: {_example_name(example, position)} has labels ({given[0]!r}) where "
                         "none are expected: the upper level reads only the questions and options; drop the "
                         "answer column (the held-out set's answers are for evaluation)")
    if not labels:
        for key in given:
            del row[key]
        row["answer"] = 0  # a placeholder: no loss of the upper level reads it
    elif "answer" not in row and given:
        row["answer"] = row[given[0]]
    return mc_from_dict(row, source=_SOURCE, line=position, domain=str(row.get("domain") or "collated"))


def _open_record(example: Any, position: int, labels: bool | None) -> OpenQA:
    if isinstance(example, OpenQA):
        return example
    if not isinstance(example, Mapping):
        raise ValueError(f"open-answer collator: {_example_name(example, position)} is a {type(example).__name__}; "
                         "expected an OpenQA record or a dict with 'question' and 'answers'")
    row = dict(example)
    given = [k for k in _ANSWER_KEYS if row.get(k) is not None]
    if labels is False and given:
        raise ValueError(f"upper-level batch: {_example_name(example, position)} has labels ({given[0]!r}) where "
                         "none are expected: the upper level reads only the questions; drop the answer column")
    if not labels:
        for key in given:
            del row[key]
        row["answers"] = ["-"]  # a placeholder: prompts only are packed
    elif "answers" not in row and "answer" in row:
        row["answers"] = row["answer"] if isinstance(row["answer"], list) else [row["answer"]]
    return openqa_from_dict(row, source=_SOURCE, line=position, domain=str(row.get("domain") or "collated"))


class MultipleChoiceCollator:
    """Multiple-choice examples -> ``{"questions": EncodedRecords}``, the batch of llm-calib's trainer.

    The encoding (:class:`~llm_calib.calm.encoding.EncodedRecords`) is what
    :func:`llm_calib.calibrate` packs: the prompt, format and normalisation of ``config`` (its
    ``prompt`` part: scorer, style, chat template, few-shot...). A
    :class:`~llm_calib.integrations.CalmStep` given this batch builds the packed option batch from
    it, with its trunk cache. Each record is tokenised once (kept for later batches).

    Args:
        tokenizer: the model's tokenizer.
        config: the prompt settings (default :class:`~llm_calib.config.calibration.CalibrationConfig()`:
            option likelihood, cloze, the chat template when the tokenizer has one).
        labels: True: examples carry the gold answer (``answer``: index, letter or text; or
            ``label``, ``answerKey``); False: upper-level inputs, answers refused; None: upper-level
            inputs taken from a labelled set, answers ignored.

    Attributes:
        format: the task format (pass it to :class:`~llm_calib.integrations.CalmStep`).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> collate = MultipleChoiceCollator(tok)
        >>> batch = collate([{"question": "2 + 2 = ?", "options": ["3", "4"], "answer": "4"},
        ...                  {"question": "Capital of France?", "choices": ["Paris", "Rome"], "label": 0}])
        >>> enc = batch["questions"]
        >>> len(enc), enc.layout, [r.gold for r in enc.records]
        (2, 'options', [1, 0])
        >>> MultipleChoiceCollator(tok, labels=False)([{"question": "2 + 2?", "options": ["3", "4"], "answer": 1}])
        Traceback (most recent call last):
        ...
        ValueError: upper-level batch: example 0 of the batch has labels ('answer') where none are expected: the upper level reads only the questions and options; drop the answer column (the held-out set's answers are for evaluation)
    """

    def __init__(self, tokenizer: Any, config: CalibrationConfig | None = None, *, labels: bool | None = True) -> None:
        settings = resolve_prompt_settings((config or CalibrationConfig()).prompt)  # an entry point: resolved here
        self.tokenizer = tokenizer
        self.labels = labels
        self.format: TaskFormat = multiple_choice_format(settings.scorer, normalize=settings.normalize,
                                                         prompt=settings.prompt)
        self._encoded: dict[MultipleChoice, tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]] = {}

    def records(self, examples: Sequence[Any]) -> list[MultipleChoice]:
        """The examples as :class:`~llm_calib.data.MultipleChoice` records (dict fields checked)."""
        return [_mc_record(e, i, self.labels) for i, e in enumerate(examples)]

    def encode(self, examples: Sequence[Any]) -> EncodedRecords:
        """The :class:`~llm_calib.calm.encoding.EncodedRecords` of ``examples``, in order."""
        records = self.records(examples)
        if not records:
            raise ValueError("multiple-choice collator: an empty batch")
        new = [r for r in dict.fromkeys(records) if r not in self._encoded]
        if new:
            prompts, options = self.format.encode(self.tokenizer, new)
            self._encoded.update(zip(new, zip(prompts, options, strict=True), strict=True))
        pairs = [self._encoded[r] for r in records]
        return EncodedRecords(records, [p for p, _ in pairs], [o for _, o in pairs], self.format)

    def __call__(self, examples: Sequence[Any]) -> dict[str, EncodedRecords]:
        """``{"questions": EncodedRecords}`` of the examples."""
        return {QUESTIONS_KEY: self.encode(examples)}


class OpenAnswerCollator:
    """Open questions -> a Hugging Face causal-LM batch under llm-calib's open-question prompt.

    Labelled: prompt + ``" " + first answer`` (+ the stop newline with ``config.prompt.open_examples``),
    ``labels`` -100 on the prompt and the padding; unlabelled (``labels=False``): the prompt alone.
    Right-padded with the tokenizer's padding id. The tokens are those :func:`llm_calib.calibrate`
    trains on.

    Args:
        tokenizer: the model's tokenizer.
        config: the prompt settings (the open prompt: chat template and ``The answer is:``, or the
            few-shot short-answer prompt of ``prompt.open_examples``).
        labels: True: examples carry ``answers`` (or ``answer``); False: prompts only, answers refused;
            None: prompts only, answers ignored (upper-level inputs taken from a labelled set).

    Attributes:
        format: the task format (:class:`~llm_calib.formats.OpenEnded`).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> batch = OpenAnswerCollator(tok)([{"question": "Capital of France?", "answers": ["Paris"]}])
        >>> sorted(batch), tok.decode(batch["input_ids"][0][batch["labels"][0] != -100])
        (['attention_mask', 'input_ids', 'labels'], ' Paris')
    """

    def __init__(self, tokenizer: Any, config: CalibrationConfig | None = None, *, labels: bool | None = True) -> None:
        settings = resolve_prompt_settings((config or CalibrationConfig()).prompt)  # an entry point: resolved here
        self.tokenizer = tokenizer
        self.labels = labels
        self.format: TaskFormat = OpenEnded(settings.open_prompt, answer_stop=settings.answer_stop)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def __call__(self, examples: Sequence[Any]) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask`` and (labelled) ``labels``, right-padded."""
        records = [_open_record(e, i, self.labels) for i, e in enumerate(examples)]
        if not records:
            raise ValueError("open-answer collator: an empty batch")
        prompts, answers = self.format.encode(self.tokenizer, records)
        seqs = [list(p) + (list(a[0]) if self.labels else []) for p, a in zip(prompts, answers, strict=True)]
        L = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), L), dtype=torch.long)
        labels = torch.full((len(seqs), L), IGNORE_INDEX, dtype=torch.long)
        for b, (seq, prompt) in enumerate(zip(seqs, prompts, strict=True)):
            ids[b, : len(seq)] = torch.tensor(seq)
            mask[b, : len(seq)] = 1
            labels[b, len(prompt) : len(seq)] = ids[b, len(prompt) : len(seq)]
        out = {"input_ids": ids, "attention_mask": mask}
        if self.labels:
            out["labels"] = labels
        return out


def _conversational(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, Mapping) and "role" in m for m in value)


class PromptCollator:
    """Upper-level prompts -> an unlabelled causal-LM batch (``input_ids``, ``attention_mask``, right-padded).

    Examples are TRL's prompt-only rows: ``{"prompt": text}`` or ``{"prompt": [messages]}`` (the chat
    template with the generation prompt, as TRL's ``SFTTrainer`` tokenises a prompt),
    ``{"messages": [...]}`` awaiting the assistant's reply, ``{"text": text}``, or tokenised
    ``{"input_ids": [...]}``.

    Args:
        tokenizer: the model's tokenizer (its chat template for conversations).
        labels: False: an example carrying an answer (``completion``, ``labels``, ``answer(s)``, or
            messages ending with the assistant's turn) is refused; None: the answer is dropped (a
            labelled set used for its prompts).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> batch = PromptCollator(tok)([{"prompt": "2 + 2 ="}, {"prompt": [{"role": "user", "content": "Hi"}]}])
        >>> batch["input_ids"].shape[0], sorted(batch)
        (2, ['attention_mask', 'input_ids'])
        >>> PromptCollator(tok)([{"prompt": "2 + 2 =", "completion": " 4"}])
        Traceback (most recent call last):
        ...
        ValueError: upper-level batch: example 0 of the batch has labels ('completion') where none are expected: the upper level reads prompts alone; pass prompt-only rows
    """

    def __init__(self, tokenizer: Any, *, labels: bool | None = False) -> None:
        self.tokenizer = tokenizer
        self.labels = labels
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0

    def _answer_field(self, row: Mapping[str, Any]) -> str | None:
        for key in ("completion", "labels", *_ANSWER_KEYS):
            if row.get(key) is not None:
                return key
        messages = row.get("messages")
        if _conversational(messages) and messages[-1].get("role") == "assistant":
            return "messages (the last turn is the assistant's)"
        return None

    def tokens(self, example: Any, position: int) -> list[int]:
        """The prompt token ids of one example."""
        if not isinstance(example, Mapping):
            raise ValueError(f"prompt collator: example {position} is a {type(example).__name__}; expected a dict with "
                             "'prompt', 'messages', 'text' or 'input_ids'")
        answer = self._answer_field(example)
        if answer is not None and self.labels is False:
            raise ValueError(f"upper-level batch: {_example_name(example, position)} has labels ({answer!r}) where none "
                             "are expected: the upper level reads prompts alone; pass prompt-only rows")
        if example.get("input_ids") is not None:
            return [int(t) for t in example["input_ids"]]
        messages = example.get("prompt", example.get("messages"))
        if _conversational(messages):
            while messages and messages[-1].get("role") == "assistant":  # labels=None: the answer is dropped
                messages = messages[:-1]
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
            return list(out["input_ids"])
        text = example.get("prompt", example.get("text"))
        if not isinstance(text, str) or not text:
            raise ValueError(f"prompt collator: {_example_name(example, position)} has no prompt ('prompt', 'messages', "
                             "'text' or 'input_ids')")
        return list(self.tokenizer(text)["input_ids"])

    def __call__(self, examples: Sequence[Any]) -> dict[str, torch.Tensor]:
        """``input_ids`` and ``attention_mask`` of the examples' prompts."""
        seqs = [self.tokens(e, i) for i, e in enumerate(examples)]
        if not seqs:
            raise ValueError("prompt collator: an empty batch")
        L = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), L), dtype=torch.long)
        for b, seq in enumerate(seqs):
            ids[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[b, : len(seq)] = 1
        return {"input_ids": ids, "attention_mask": mask}
