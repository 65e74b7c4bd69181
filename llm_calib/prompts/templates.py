"""Prompt formats for multiple-choice and open-ended scoring.

A :class:`PromptFormat` turns a record into the text before the scored continuation. The default
is the reference format of :doc:`/methods/calm` (chat template, the question, ``The answer is:``);
templates, presets and few-shot examples are described in :doc:`/tutorials/evaluate_llm`
("Templates and few-shot examples").
"""

from __future__ import annotations

import random
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from llm_calib.config.choices import CHOICE_KINDS, FEWSHOT_SAMPLERS, PROMPT_PRESETS, PROMPT_STYLES

__all__ = [
    "LETTERS",
    "SHORT_ANSWER_TEMPLATE",
    "PromptFormat",
    "build_prompt",
    "continuation_text",
    "draw_fewshot",
    "draw_short_answer_examples",
    "option_continuations",
    "option_letters",
    "preset",
    "prompt_dict",
    "record_prompt",
    "record_uses_chat_template",
    "short_answer_format",
    "template_fields",
    "user_message",
    "uses_chat_template",
    "with_fewshot",
]

LETTERS: str = string.ascii_uppercase
"""Letters used to label listed options (``A`` ... ``Z``)."""



@dataclass(frozen=True)
class PromptFormat:
    """How a question is turned into a prompt.

    Attributes:
        style: ``"cloze"`` (the question only) or ``"listed"`` (options listed as ``A.``, ``B.``, ...;
            the letter scorer needs it).
        chat_template: use the tokenizer's chat template (``True``), plain text (``False``), or the
            template when the tokenizer has one (``None``).
        system_message: a system message (chat, or in front of a plain prompt); ``None`` keeps the
            template's default.
        answer_prefix: text after the generation prompt, before the scored continuation (with a
            ``template``, only where it has the field ``{answer_prefix}``).
        template: the question text with named fields (:func:`template_fields`), e.g.
            ``"Question: {question}\\nAnswer:"``; replaces ``user text + "\\n" + answer_prefix``.
        target_delimiter: text between the prompt and each scored choice (stripped), ``" "`` as in lm-eval.
        choices: score each option's ``"text"`` or its ``"letters"``.
        description: text written once at the very start, with the template's fields.
        fewshot: solved examples before each question (0: zero-shot).
        fewshot_split: data spec the examples come from (:func:`~llm_calib.prompts.resolution.resolve_fewshot`).
        fewshot_seed: seed of the per-question draw of examples.
        fewshot_delimiter: text between examples, and before the question.
        fewshot_sampler: ``"random"`` (seeded per question) or ``"first_n"`` (lm-eval's MMLU sampler).
        fewshot_match: a ``meta`` key (e.g. ``"subject"``) an example must share with the question.
        fewshot_pool: the candidate example records (set by :func:`with_fewshot`; not compared or shown).

    Example:
        >>> fmt = PromptFormat(style="listed", chat_template=False)
        >>> print(build_prompt(None, "2 + 2 = ?", ("3", "4"), fmt))
        2 + 2 = ?
        A. 3
        B. 4
        The answer is:
    """

    style: Literal["cloze", "listed"] = "cloze"
    chat_template: bool | None = None
    system_message: str | None = None
    answer_prefix: str = "The answer is:"
    template: str | None = None
    target_delimiter: str = " "
    choices: Literal["text", "letters"] = "text"
    description: str = ""
    fewshot: int = 0
    fewshot_split: str | None = None
    fewshot_seed: int = 1234
    fewshot_delimiter: str = "\n\n"
    fewshot_sampler: Literal["random", "first_n"] = "random"
    fewshot_match: str | None = None
    fewshot_pool: tuple[Any, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.style not in PROMPT_STYLES:
            raise ValueError(f"PromptFormat.style must be one of {PROMPT_STYLES}, got {self.style!r}")
        if self.chat_template not in (True, False, None):
            raise ValueError(f"PromptFormat.chat_template must be True, False or None, got {self.chat_template!r}")
        if self.choices not in CHOICE_KINDS:
            raise ValueError(f"PromptFormat.choices must be one of {CHOICE_KINDS}, got {self.choices!r}")
        if not isinstance(self.fewshot, int) or isinstance(self.fewshot, bool) or self.fewshot < 0:
            raise ValueError(f"PromptFormat.fewshot must be an integer >= 0, got {self.fewshot!r}")
        if self.fewshot_sampler not in FEWSHOT_SAMPLERS:
            raise ValueError(f"PromptFormat.fewshot_sampler must be one of {FEWSHOT_SAMPLERS}, got {self.fewshot_sampler!r}")
        if self.template is not None and not self.template.strip():
            raise ValueError("PromptFormat.template must not be empty (None for the default format)")
        object.__setattr__(self, "fewshot_pool", tuple(self.fewshot_pool))


def option_letters(n: int) -> str:
    """The labels of ``n`` (1 to 26) listed options; ValueError outside that range.

    Example:
        >>> option_letters(4)
        'ABCD'
    """
    if not 1 <= n <= len(LETTERS):
        raise ValueError(f"n (number of options) must be in 1..{len(LETTERS)}, got {n}")
    return LETTERS[:n]


def user_message(question: str, options: Sequence[str] | None, fmt: PromptFormat) -> str:
    """The user turn: the question, plus the lettered options with ``style="listed"`` (which needs them).

    Example:
        >>> user_message("Pick one.", ("x", "y"), PromptFormat(style="listed"))
        'Pick one.\\nA. x\\nB. y'
    """
    question = question.strip()
    if fmt.style == "cloze":
        return question
    if not options:
        raise ValueError("options are required for PromptFormat(style='listed')")
    letters = option_letters(len(options))
    return "\n".join([question] + [f"{c}. {o}" for c, o in zip(letters, options, strict=True)])


def uses_chat_template(tokenizer: Any, fmt: PromptFormat) -> bool:
    """Whether ``fmt`` applied to ``tokenizer`` (or None) goes through the chat template.

    Raises:
        ValueError: ``fmt.chat_template`` is ``True`` but the tokenizer has no chat template.

    Example:
        >>> uses_chat_template(None, PromptFormat())
        False
    """
    has = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    if fmt.chat_template is None:
        return has
    if fmt.chat_template and not has:
        raise ValueError(
            "PromptFormat(chat_template=True) but the tokenizer has no chat template; "
            "use chat_template=None or False"
        )
    return bool(fmt.chat_template)


def record_uses_chat_template(tokenizer: Any, record: Any, fmt: PromptFormat) -> bool:
    """Whether ``record``'s prompt went through the chat template: never for an already rendered
    ``prompt`` (lm-eval's plain contexts), else :func:`uses_chat_template`.

    Example:
        >>> from llm_calib.data.records import MultipleChoice
        >>> rendered = MultipleChoice("2 + 2?", ("4", "5"), 0, "math", "q1", prompt="Q: 2 + 2?\\nA:")
        >>> record_uses_chat_template(None, rendered, PromptFormat(chat_template=True))
        False
    """
    if getattr(record, "prompt", None) is not None:
        return False
    return uses_chat_template(tokenizer, fmt)


def _render(tokenizer: Any, fmt: PromptFormat, user: str, prefix: str | None) -> str:
    """``user`` as the chat's user turn then ``prefix``, or plain (``prefix`` on a new line; None: none)."""
    if uses_chat_template(tokenizer, fmt):
        system = [{"role": "system", "content": fmt.system_message}] if fmt.system_message is not None else []
        messages = [*system, {"role": "user", "content": user}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + (prefix or "")
    head = f"{fmt.system_message}\n\n" if fmt.system_message else ""
    return head + user + ("" if prefix is None else f"\n{prefix}")


def build_prompt(
    tokenizer: Any, question: str, options: Sequence[str] | None = None, fmt: PromptFormat | None = None,
) -> str:
    """The prompt before the scored continuation: the chat template's ``[system?, user]`` with the
    generation prompt, or ``[system + "\\n\\n"] + user + "\\n"``; then ``fmt.answer_prefix``.

    A chat-templated prompt holds the template's special tokens: tokenise it with
    ``add_special_tokens=False``. ``fmt`` defaults to ``PromptFormat()``; ``tokenizer`` is only
    needed for a chat template.

    Example:
        >>> build_prompt(None, "Capital of France?", fmt=PromptFormat(chat_template=False))
        'Capital of France?\\nThe answer is:'
    """
    fmt = fmt or PromptFormat()
    return _render(tokenizer, fmt, user_message(question, options, fmt), fmt.answer_prefix)


def continuation_text(option: str) -> str:
    """The scored continuation of an option: ``" " + option.strip()``.

    Example:
        >>> continuation_text("Paris ")
        ' Paris'
    """
    return " " + option.strip()


def _letters_for(record: Any) -> str:
    options = getattr(record, "options", None)
    return option_letters(len(options)) if options else ""


class _Fields(dict):
    """Template fields; a missing one raises a KeyError that names it and the record."""

    def __init__(self, data: Mapping[str, str], record_id: str) -> None:
        super().__init__(data)
        self.record_id = record_id

    def __missing__(self, key: str) -> str:
        raise KeyError(
            f"prompt template field {{{key}}} is not available for record {self.record_id!r}; "
            f"available: {', '.join('{' + k + '}' for k in sorted(self))}"
        )


def template_fields(record: Any, fmt: PromptFormat | None = None) -> dict[str, str]:
    """The named fields a template can use for one record.

    ``question``, ``options`` (``A. text`` lines), ``letters`` (``"A, B"``), ``option_a`` ...,
    ``subject`` (``meta["subject"]`` with spaces for ``_``, else the domain), ``context``
    (``meta`` ``context``, ``passage`` or ``fact``, else empty), ``domain``, ``answer_prefix`` (of
    ``fmt``) and every ``meta`` key.

    Example:
        >>> from llm_calib.data.records import MultipleChoice
        >>> q = MultipleChoice("2 + 2 = ?", ("3", "4"), 1, "math", "q0", {"subject": "high_school_math"})
        >>> f = template_fields(q)
        >>> f["options"], f["subject"], f["letters"]
        ('A. 3\\nB. 4', 'high school math', 'A, B')
    """
    fmt = fmt or PromptFormat()
    meta = {str(k): str(v) for k, v in (getattr(record, "meta", None) or {}).items()}
    out: dict[str, str] = dict(meta)
    options = getattr(record, "options", None)
    if options:
        letters = option_letters(len(options))
        out["options"] = "\n".join(f"{c}. {o.strip()}" for c, o in zip(letters, options, strict=True))
        out["letters"] = ", ".join(letters)
        for c, o in zip(letters, options, strict=True):
            out[f"option_{c.lower()}"] = o.strip()
    subject = meta.get("subject")
    out["subject"] = subject.replace("_", " ") if subject else str(record.domain)
    out["context"] = next((meta[k] for k in ("context", "passage", "fact") if meta.get(k)), "")
    out["domain"] = str(record.domain)
    out["question"] = record.question.strip()
    out["answer_prefix"] = fmt.answer_prefix
    return out


def _format(text: str, fields: dict[str, str], record: Any, what: str) -> str:
    try:
        return text.format_map(_Fields(fields, str(record.id)))
    except (ValueError, IndexError) as exc:
        raise ValueError(f"PromptFormat.{what} {text!r} is not a valid format string: {exc}") from None


def _question_block(record: Any, fmt: PromptFormat) -> tuple[str, str | None]:
    """The question's own text and the answer prefix on the line after it (None with a template)."""
    if fmt.template is not None:
        return _format(fmt.template, template_fields(record, fmt), record, "template"), None
    return user_message(record.question, getattr(record, "options", None), fmt), fmt.answer_prefix


def _target(record: Any, fmt: PromptFormat) -> str:
    options = getattr(record, "options", None)
    if options is None:
        return record.answers[0].strip()
    if fmt.choices == "letters":
        return _letters_for(record)[record.gold]
    return options[record.gold].strip()


def _example_text(record: Any, fmt: PromptFormat) -> str:
    body, prefix = _question_block(record, fmt)
    text = body if prefix is None else f"{body}\n{prefix}"
    return text + fmt.target_delimiter + _target(record, fmt)


def draw_fewshot(fmt: PromptFormat, record: Any) -> list[Any]:
    """The ``fmt.fewshot`` examples shown before ``record``, in order.

    Drawn from ``fmt.fewshot_pool`` minus the record (same id or question), sharing
    ``meta[fmt.fewshot_match]`` when set, seeded by ``fmt.fewshot_seed`` and the record's id (so
    independent of the other questions), or the first candidates with ``fewshot_sampler="first_n"``.

    Raises:
        ValueError: ``fewshot > 0`` without a pool, too few candidates, or a pool of another kind.

    Example:
        >>> from llm_calib.data.records import OpenQA
        >>> pool = [OpenQA(f"Q{i}?", (f"A{i}",), "toy", f"p{i}") for i in range(5)]
        >>> fmt = with_fewshot(PromptFormat(fewshot=2), pool)
        >>> q = OpenQA("Q?", ("A",), "toy", "q0")
        >>> draw_fewshot(fmt, q) == draw_fewshot(fmt, q), len(draw_fewshot(fmt, q))
        (True, 2)
    """
    k = fmt.fewshot
    if k == 0:
        return []
    if not fmt.fewshot_pool:
        raise ValueError(
            f"PromptFormat.fewshot={k} needs examples: set fewshot_split to a data spec and call "
            "llm_calib.prompts.resolution.resolve_fewshot(), or pass them with with_fewshot()"
        )
    kind = type(record)
    question = record.question.strip()
    candidates = [ex for ex in fmt.fewshot_pool if ex.id != record.id and ex.question.strip() != question]
    if fmt.fewshot_match is not None:
        want = (getattr(record, "meta", None) or {}).get(fmt.fewshot_match)
        candidates = [ex for ex in candidates if (ex.meta or {}).get(fmt.fewshot_match) == want]
    if any(type(ex) is not kind for ex in candidates):
        raise ValueError(
            f"the few-shot pool ({fmt.fewshot_split or 'given'}) holds records of another kind "
            f"than {kind.__name__} record {record.id!r}"
        )
    if len(candidates) < k:
        raise ValueError(
            f"PromptFormat.fewshot={k} but the pool has only {len(candidates)} other examples"
            + (f" with the same {fmt.fewshot_match}" if fmt.fewshot_match else "")
            + f" for record {record.id!r}"
        )
    if fmt.fewshot_sampler == "first_n":
        return candidates[:k]
    return random.Random(f"{fmt.fewshot_seed}:{record.id}:{question}").sample(candidates, k)


def record_prompt(tokenizer: Any, record: Any, fmt: PromptFormat | None = None) -> str:
    """The prompt of one record: ``description``, the few-shot examples, then the question.

    Each example is its question block, ``target_delimiter`` and its answer (gold text, letter or
    first accepted answer), followed by ``fewshot_delimiter``; the question block is the rendered
    ``template``, else the user text and the answer prefix. With a chat template all of it is the
    user turn. Without template, description or examples this is :func:`build_prompt`; a record
    with an already rendered ``prompt`` (e.g. lm-eval's) returns it verbatim.

    Raises:
        KeyError: a template field the record does not have (the message names it).
        ValueError: few-shot without a pool (see :func:`draw_fewshot`).

    Example:
        >>> from llm_calib.data.records import MultipleChoice
        >>> q = MultipleChoice("Capital of France?", ("Paris", "Rome"), 0, "geo", "q0")
        >>> print(record_prompt(None, q, preset("lm_eval_arc")))
        Question: Capital of France?
        Answer:
    """
    if getattr(record, "prompt", None) is not None:  # already rendered (e.g. by lm-eval)
        return record.prompt
    fmt = fmt or PromptFormat()
    head = _format(fmt.description, template_fields(record, fmt), record, "description") if fmt.description else ""
    shots = "".join(_example_text(ex, fmt) + fmt.fewshot_delimiter for ex in draw_fewshot(fmt, record))
    body, prefix = _question_block(record, fmt)
    return _render(tokenizer, fmt, head + shots + body, prefix)


def option_continuations(record: Any, fmt: PromptFormat | None = None) -> tuple[str, ...]:
    """Each option's scored continuation: ``target_delimiter`` + option text (or letter); a record's
    already rendered ``continuations`` verbatim.

    Example:
        >>> from llm_calib.data.records import MultipleChoice
        >>> q = MultipleChoice("Pick.", ("x ", "y"), 0, "toy", "q0")
        >>> option_continuations(q), option_continuations(q, PromptFormat(choices="letters"))
        ((' x', ' y'), (' A', ' B'))
    """
    if getattr(record, "continuations", None) is not None:  # already rendered (e.g. by lm-eval)
        return tuple(record.continuations)
    fmt = fmt or PromptFormat()
    if fmt.choices == "letters":
        return tuple(fmt.target_delimiter + c for c in _letters_for(record))
    return tuple(fmt.target_delimiter + o.strip() for o in record.options)


def _question_key(text: str) -> str:
    return " ".join(text.split()).lower()


def with_fewshot(fmt: PromptFormat, pool: Sequence[Any], exclude: Sequence[Any] = ()) -> PromptFormat:
    """A copy of ``fmt`` drawing its few-shot examples from ``pool`` minus the records sharing an id
    or a question (whitespace and case folded) with ``exclude`` (the evaluated records).

    Raises:
        ValueError: fewer than ``fmt.fewshot`` candidates remain.

    Example:
        >>> from llm_calib.data.records import OpenQA
        >>> pool = [OpenQA(f"Q{i}?", (f"A{i}",), "toy", f"p{i}") for i in range(3)]
        >>> len(with_fewshot(PromptFormat(fewshot=1), pool, exclude=pool[:1]).fewshot_pool)
        2
    """
    ids = {r.id for r in exclude}
    questions = {_question_key(r.question) for r in exclude}
    kept = tuple(r for r in pool if r.id not in ids and _question_key(r.question) not in questions)
    if len(kept) < fmt.fewshot:
        raise ValueError(
            f"few-shot split {fmt.fewshot_split or '(given pool)'}: {len(kept)} examples left after "
            f"removing the evaluated questions, need fewshot={fmt.fewshot}"
        )
    return replace(fmt, fewshot_pool=kept)


def prompt_dict(fmt: PromptFormat, tokenizer: Any = None) -> dict[str, Any]:
    """The settings of a format as a JSON-ready dict (the pool as its size); with a ``tokenizer``,
    ``chat_template`` as resolved (:func:`uses_chat_template`), never None.

    Example:
        >>> prompt_dict(preset("lm_eval_arc"))["template"]
        'Question: {question}\\nAnswer:'
    """
    out = {k: getattr(fmt, k) for k in fmt.__dataclass_fields__ if k != "fewshot_pool"}
    out["fewshot_pool_size"] = len(fmt.fewshot_pool)
    if tokenizer is not None:
        out["chat_template"] = uses_chat_template(tokenizer, fmt)
    return out


SHORT_ANSWER_TEMPLATE = "Q: {question}\nA:"
"""The question block of :func:`short_answer_format` (each example is this, a space, its answer)."""


def _short_answer_pairs(examples: Any, what: str) -> tuple[tuple[str, str], ...]:
    """``examples`` as stripped (question, answer) pairs; ValueError naming ``what[i]`` otherwise."""
    if isinstance(examples, (str, bytes)) or not isinstance(examples, Sequence):
        raise ValueError(f"{what} must be a list of [question, answer] pairs, got {examples!r}")
    out = []
    for i, pair in enumerate(examples):
        if (isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2
                or not all(isinstance(t, str) and t.strip() for t in pair)):
            raise ValueError(f"{what}[{i}] must be a [question, answer] pair of two non-empty strings, got {pair!r}")
        out.append((" ".join(pair[0].split()), " ".join(pair[1].split())))
    return tuple(out)


def short_answer_format(examples: Sequence[tuple[str, str]]) -> PromptFormat:
    """The few-shot short-answer prompt of open questions: ``Q: ...`` / ``A: ...`` examples, then the question.

    Plain text; the fixed examples (``(question, answer)`` pairs, whitespace squeezed; none gives
    zero-shot) go into ``description``, the question is :data:`SHORT_ANSWER_TEMPLATE`, so greedy
    answers stop at the newline the examples end with (see :doc:`/methods/calm`).

    Raises:
        ValueError: an example that is not a pair of two non-empty strings (names its index).

    Example:
        >>> from llm_calib.data.records import OpenQA
        >>> fmt = short_answer_format([("Capital of Italy?", "Rome")])
        >>> print(record_prompt(None, OpenQA("Capital of France?", ("Paris",), "geo", "q0"), fmt))
        Q: Capital of Italy?
        A: Rome
        <BLANKLINE>
        Q: Capital of France?
        A:
    """
    pairs = _short_answer_pairs(examples, "examples")

    def escape(text: str) -> str:
        return text.replace("{", "{{").replace("}", "}}")

    description = "".join(f"Q: {escape(q)}\nA: {escape(a)}\n\n" for q, a in pairs)
    return PromptFormat(chat_template=False, template=SHORT_ANSWER_TEMPLATE, description=description)


def draw_short_answer_examples(records: Sequence[Any], k: int, seed: int = 0) -> tuple[tuple[str, str], ...]:
    """``k`` seeded ``(question, first answer)`` examples for :func:`short_answer_format` from open
    questions with an answer (the draw depends only on ``seed`` and the order of ``records``).

    Raises:
        ValueError: ``k`` negative or more than the records with answers; a record that is not open-ended.

    Example:
        >>> from llm_calib.data.records import OpenQA
        >>> pool = [OpenQA(f"Q{i}?", (f"A{i}",), "toy", f"p{i}") for i in range(5)]
        >>> ex = draw_short_answer_examples(pool, 2, seed=1)
        >>> len(ex), ex == draw_short_answer_examples(pool, 2, seed=1)
        (2, True)
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k (number of examples) must be an integer >= 0, got {k!r}")
    from llm_calib.data.records import OpenQA

    bad = next((r for r in records if not isinstance(r, OpenQA)), None)
    if bad is not None:
        raise ValueError(f"short-answer examples come from open questions (OpenQA), got {type(bad).__name__}")
    answered = [r for r in records if r.answers and r.answers[0].strip()]
    if len(answered) < k:
        raise ValueError(f"k={k} short-answer examples requested but only {len(answered)} records have an answer")
    drawn = random.Random(seed).sample(answered, k)
    return _short_answer_pairs([(r.question, r.answers[0]) for r in drawn], "records")


def preset(name: str, **overrides: Any) -> PromptFormat:
    """The :class:`PromptFormat` of a :data:`PROMPT_PRESETS` name with fields overridden (e.g. ``fewshot=5``).

    Raises:
        ValueError: an unknown preset name (the message lists the valid ones).

    Example:
        >>> preset("lm_eval_mmlu", fewshot=5).choices
        'letters'
    """
    if name not in PROMPT_PRESETS:
        raise ValueError(f"unknown prompt preset {name!r}; valid presets: {', '.join(PROMPT_PRESETS)}")
    return PromptFormat(**{**PROMPT_PRESETS[name], **overrides})
