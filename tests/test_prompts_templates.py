"""Prompt templates, lm-eval presets, few-shot examples and their use by the scorers."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from _benchmarks import load_harness

from llm_calib.confidence.token import encode_open_prompts, score_open_ended
from llm_calib.config.choices import PROMPT_PRESETS
from llm_calib.data.records import MultipleChoice, OpenQA
from llm_calib.prompts.resolution import resolve_fewshot
from llm_calib.prompts.templates import (
    PromptFormat,
    build_prompt,
    draw_fewshot,
    draw_short_answer_examples,
    option_continuations,
    preset,
    record_prompt,
    short_answer_format,
    template_fields,
    with_fewshot,
)
from llm_calib.scoring import normalized, score_letter, score_option_likelihood
from llm_calib.scoring.base import encode_prompt

# the slow one-sequence-per-option reference (benchmarks/harness/naive_scoring.py, not library API)
score_option_likelihood_naive = load_harness("naive_scoring").score_option_likelihood_naive

ARC_Q = MultipleChoice(
    "Which gas do plants absorb?", ("oxygen", "carbon dioxide", "helium"), 1, "arc_easy", "a1"
)
MMLU_Q = MultipleChoice(
    "What is 2 + 2?", ("3", "4", "5", "6"), 1, "mmlu_stem", "m1", {"subject": "elementary_mathematics"}
)


def _pool(n: int, domain: str = "toy", subject: str | None = None) -> list[MultipleChoice]:
    meta = {"subject": subject} if subject else {}
    return [
        MultipleChoice(f"Example question {i}?", (f"yes{i}", f"no{i}"), i % 2, domain, f"{domain}-{i}", meta)
        for i in range(n)
    ]


def test_default_format_is_unchanged_by_the_template_machinery(tiny_tokenizer):
    for fmt in (PromptFormat(), PromptFormat(style="listed", chat_template=False)):
        assert record_prompt(tiny_tokenizer, ARC_Q, fmt) == build_prompt(
            tiny_tokenizer, ARC_Q.question, ARC_Q.options, fmt
        )
        assert option_continuations(ARC_Q, fmt) == (" oxygen", " carbon dioxide", " helium")


def test_lm_eval_presets_render_exactly_lm_eval_prompts():
    # The doc_to_text strings of lm-eval 0.4.13's arc_easy, openbookqa, commonsense_qa and mmlu.
    assert record_prompt(None, ARC_Q, preset("lm_eval_arc")) == (
        "Question: Which gas do plants absorb?\nAnswer:"
    )
    assert record_prompt(None, ARC_Q, preset("lm_eval_openbookqa")) == "Which gas do plants absorb?"
    assert record_prompt(None, ARC_Q, preset("lm_eval_commonsenseqa")) == (
        "Question: Which gas do plants absorb?\nA. oxygen\nB. carbon dioxide\nC. helium\nAnswer:"
    )
    assert record_prompt(None, MMLU_Q, preset("lm_eval_mmlu")) == (
        "The following are multiple choice questions (with answers) about elementary mathematics."
        "\n\nWhat is 2 + 2?\nA. 3\nB. 4\nC. 5\nD. 6\nAnswer:"
    )
    assert option_continuations(MMLU_Q, preset("lm_eval_mmlu")) == (" A", " B", " C", " D")
    assert option_continuations(ARC_Q, preset("lm_eval_arc")) == (" oxygen", " carbon dioxide", " helium")
    for name in ("lm_eval_qasc", "lm_eval_piqa"):
        assert record_prompt(None, ARC_Q, preset(name)).startswith("Question: ")
    # every preset is plain text except the reference format
    assert all(PresetFmt.chat_template is False for n, PresetFmt in
               ((n, preset(n)) for n in PROMPT_PRESETS) if n != "default")


def test_template_fields_and_a_missing_field_is_named():
    f = template_fields(MMLU_Q)
    assert f["options"] == "A. 3\nB. 4\nC. 5\nD. 6"
    assert f["option_b"] == "4" and f["subject"] == "elementary mathematics"
    fmt = PromptFormat(template="{passage}\n{question}", chat_template=False)
    with pytest.raises(KeyError, match=r"\{passage\}.*'a1'"):
        record_prompt(None, ARC_Q, fmt)
    with pytest.raises(ValueError, match="template"):
        PromptFormat(template="  ")
    with pytest.raises(ValueError, match="choices"):
        PromptFormat(choices="numbers")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fewshot"):
        PromptFormat(fewshot=-1)
    with pytest.raises(ValueError, match=r"unknown prompt preset 'arc'.*lm_eval_arc"):
        preset("arc")


def test_template_with_chat_template_is_the_user_turn(tiny_tokenizer):
    fmt = PromptFormat(template="Q: {question}\nA:", chat_template=True)
    text = record_prompt(tiny_tokenizer, ARC_Q, fmt)
    assert text.endswith("<|im_start|>user\nQ: Which gas do plants absorb?\nA:<|im_end|>\n<|im_start|>assistant\n")


def test_fewshot_mc_layout_matches_lm_eval():
    pool = _pool(6)
    fmt = with_fewshot(preset("lm_eval_arc", fewshot=2), pool)
    shots = draw_fewshot(fmt, ARC_Q)
    expected = "".join(
        f"Question: {ex.question}\nAnswer: {ex.options[ex.gold]}\n\n" for ex in shots
    ) + "Question: Which gas do plants absorb?\nAnswer:"
    assert record_prompt(None, ARC_Q, fmt) == expected
    # letters preset: examples answered with their letter
    fmt = with_fewshot(preset("lm_eval_commonsenseqa", fewshot=1), pool)
    ex = draw_fewshot(fmt, ARC_Q)[0]
    assert record_prompt(None, ARC_Q, fmt).startswith(
        f"Question: {ex.question}\nA. {ex.options[0]}\nB. {ex.options[1]}\nAnswer: {'AB'[ex.gold]}\n\n"
    )


def test_fewshot_draw_is_reproducible_per_question_and_never_the_question_itself():
    pool = _pool(30)
    fmt = with_fewshot(PromptFormat(fewshot=4, fewshot_seed=7), pool)
    target = pool[3]
    a = draw_fewshot(fmt, target)
    assert len(a) == 4 and len({ex.id for ex in a}) == 4
    assert target.id not in {ex.id for ex in a}
    # independent of the pool's other users and of the order questions are asked in
    assert draw_fewshot(replace(fmt), target) == a
    assert draw_fewshot(fmt, pool[5]) != a or draw_fewshot(fmt, pool[6]) != a
    # the seed matters
    assert draw_fewshot(replace(fmt, fewshot_seed=8), target) != a
    # first_n takes the pool order
    first = replace(fmt, fewshot_sampler="first_n")
    assert [ex.id for ex in draw_fewshot(first, target)] == ["toy-0", "toy-1", "toy-2", "toy-4"]


def test_fewshot_pool_excludes_the_evaluated_questions_and_checks_its_size():
    pool = _pool(5)
    evaluated = [pool[0], MultipleChoice("  example QUESTION 1? ", ("a", "b"), 0, "other", "x")]
    fmt = with_fewshot(PromptFormat(fewshot=2), pool, exclude=evaluated)
    assert [r.id for r in fmt.fewshot_pool] == ["toy-2", "toy-3", "toy-4"]  # id and text removed
    with pytest.raises(ValueError, match=r"2 examples left.*need fewshot=3"):
        with_fewshot(PromptFormat(fewshot=3), pool[:4], exclude=pool[:2])
    with pytest.raises(ValueError, match="needs examples"):
        record_prompt(None, ARC_Q, PromptFormat(fewshot=1))
    with pytest.raises(ValueError, match="needs fewshot_split"):
        resolve_fewshot(PromptFormat(fewshot=1))


def test_fewshot_match_keeps_the_subject():
    pool = _pool(4, subject="elementary_mathematics") + _pool(4, domain="o", subject="virology")
    fmt = with_fewshot(preset("lm_eval_mmlu", fewshot=3), pool)
    shots = draw_fewshot(fmt, MMLU_Q)
    assert [ex.id for ex in shots] == ["toy-0", "toy-1", "toy-2"]  # first_n, same subject only
    text = record_prompt(None, MMLU_Q, fmt)
    assert text.startswith("The following are multiple choice questions (with answers) about "
                           "elementary mathematics.\n\nExample question 0?\nA. yes0\nB. no0\nAnswer: A\n\n")
    with pytest.raises(ValueError, match="same subject"):
        draw_fewshot(replace(fmt, fewshot=5), MMLU_Q)


def test_resolve_fewshot_loads_the_split_without_evaluated_records():
    from llm_calib.data import load

    evaluated = load("builtin:capitals:n=10").records[:3]
    fmt = resolve_fewshot(PromptFormat(fewshot=2, fewshot_split="builtin:capitals:n=10"), exclude=evaluated)
    assert len(fmt.fewshot_pool) == 7
    assert not {r.id for r in fmt.fewshot_pool} & {r.id for r in evaluated}


def test_open_ended_fewshot_qa_preset(tiny_model, tiny_tokenizer):
    pool = [OpenQA(f"Who wrote book {i}?", (f"Author {i}",), "toy", f"p{i}") for i in range(4)]
    q = OpenQA("Who wrote Hamlet?", ("Shakespeare",), "toy", "q0")
    fmt = with_fewshot(preset("qa", fewshot=2), pool)
    text = record_prompt(tiny_tokenizer, q, fmt)
    shots = draw_fewshot(fmt, q)
    assert text == "".join(f"Q: {ex.question}\nA: {ex.answers[0]}\n" for ex in shots) + "Q: Who wrote Hamlet?\nA:"
    s = score_open_ended(tiny_model, tiny_tokenizer, [q], prompt=fmt, max_new_tokens=4)
    assert s.details[0]["prompt"] == text
    assert "\n" not in s.answers[0]


def test_scorers_score_the_template_and_letters(tiny_model, tiny_tokenizer):
    fmt = preset("lm_eval_mmlu")
    s = score_option_likelihood(tiny_model, tiny_tokenizer, [MMLU_Q], prompt=fmt)
    letter = score_letter(tiny_model, tiny_tokenizer, [MMLU_Q], prompt=fmt)
    # " A" .. " D" are single tokens: scoring the letters as continuations equals the letter scorer
    torch.testing.assert_close(s.logits[0], letter.logits[0].to(s.logits[0].dtype), rtol=1e-5, atol=1e-5)
    assert s.details[0]["prompt"] == record_prompt(tiny_tokenizer, MMLU_Q, fmt)
    assert s.details[0]["choices"] == ["A", "B", "C", "D"] and s.details[0]["n_chars"] == [1] * 4
    # the packed scorer agrees with the one-sequence-per-option reference under a template
    fmt = with_fewshot(preset("lm_eval_arc", fewshot=2), _pool(5))
    fast = score_option_likelihood(tiny_model, tiny_tokenizer, [ARC_Q], prompt=fmt)
    slow = score_option_likelihood_naive(tiny_model, tiny_tokenizer, [ARC_Q], prompt=fmt)
    torch.testing.assert_close(fast.logits[0], slow.logits[0], rtol=1e-4, atol=1e-4)
    # and the template changed the scores (it is really used)
    plain = score_option_likelihood(tiny_model, tiny_tokenizer, [ARC_Q])
    assert not torch.allclose(plain.logits[0], fast.logits[0])


def test_normalizations_divide_the_summed_loglik(tiny_model, tiny_tokenizer):
    q = MultipleChoice("Pick one.", ("é", "bb", "c c c"), 0, "toy", "n0")
    s = score_option_likelihood(tiny_model, tiny_tokenizer, [q])
    d = s.details[0]
    assert d["n_chars"] == [1, 2, 5] and d["n_bytes"] == [2, 2, 5]
    ll = s.logits[0]
    for mode, key in (("char", "n_chars"), ("byte", "n_bytes"), ("mean", "n_tokens")):
        direct = score_option_likelihood(tiny_model, tiny_tokenizer, [q], normalize=mode).logits[0]
        torch.testing.assert_close(direct, ll / torch.tensor(d[key], dtype=ll.dtype), rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(normalized(s, mode).logits[0], direct, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(normalized(s, "acc_norm").logits[0], normalized(s, "char").logits[0])
    assert all(math.isfinite(v) for v in d["loglik"])
    with pytest.raises(ValueError, match="normalize must be one of"):
        normalized(s, "per_word")


SHORT_EXAMPLES = (("Capital of {Italy}?", "Rome"), ("  How many\nlegs has a spider? ", " 8 "))


def test_short_answer_format_is_exactly_the_few_shot_text(tiny_tokenizer):
    """Fixed examples, blank line between blocks, plain text even with a chat-template tokenizer;
    braces in an example are literal and whitespace runs become one space."""
    fmt = short_answer_format(SHORT_EXAMPLES)
    q = OpenQA("Who wrote Hamlet?", ("Shakespeare",), "toy", "q0")
    text = ("Q: Capital of {Italy}?\nA: Rome\n\n"
            "Q: How many legs has a spider?\nA: 8\n\n"
            "Q: Who wrote Hamlet?\nA:")
    assert tiny_tokenizer.chat_template  # the tokenizer has one, the format does not use it
    assert record_prompt(tiny_tokenizer, q, fmt) == text
    other = record_prompt(tiny_tokenizer, OpenQA("Other?", ("x",), "toy", "q1"), fmt)
    assert other == text.replace("Who wrote Hamlet?", "Other?")  # the same examples before every question
    # tokenised as plain text: no chat special tokens, and BOS only where the tokenizer adds one
    ids = encode_open_prompts(tiny_tokenizer, [q], fmt)[0]
    assert ids == encode_prompt(tiny_tokenizer, text, chat=False) == tiny_tokenizer(text)["input_ids"]
    assert record_prompt(None, q, short_answer_format([])) == "Q: Who wrote Hamlet?\nA:"


@pytest.mark.parametrize(("examples", "needle"), [
    ([("q?", "")], r"examples\[0\]"),
    ([("q?", "a"), ("q2?",)], r"examples\[1\]"),
    ([("q?", "a"), ("q2?", 3)], r"examples\[1\]"),
    ("q? a", "list of \\[question, answer\\] pairs"),
])
def test_short_answer_format_rejects_bad_examples_by_index(examples, needle):
    with pytest.raises(ValueError, match=needle):
        short_answer_format(examples)


def test_draw_short_answer_examples_is_reproducible_and_skips_unanswered():
    pool = [OpenQA(f"Question {i}?", (f"answer {i}", f"alias {i}"), "toy", f"p{i}") for i in range(12)]
    pool.insert(3, OpenQA("Unanswerable?", (), "toy", "u", answerable=False))
    drawn = draw_short_answer_examples(pool, 5, seed=0)
    assert drawn == draw_short_answer_examples(pool, 5, seed=0) != draw_short_answer_examples(pool, 5, seed=1)
    assert len(set(drawn)) == 5
    assert all(q.startswith("Question ") and a == "answer " + q[9:-1] for q, a in drawn)  # question + first alias
    assert len(draw_short_answer_examples(pool, 12)) == 12 and draw_short_answer_examples(pool, 0) == ()
    with pytest.raises(ValueError, match=r"k=13 .* only 12 records have an answer"):
        draw_short_answer_examples(pool, 13)
    with pytest.raises(ValueError, match="k \\(number of examples\\) must be an integer >= 0"):
        draw_short_answer_examples(pool, -1)
    with pytest.raises(ValueError, match="OpenQA"):
        draw_short_answer_examples([ARC_Q], 1)
