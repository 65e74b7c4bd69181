"""Prompt formats: the reference chat format, plain prompts, listed options, validation."""

from __future__ import annotations

import pytest

from llm_calib.prompts.templates import (
    PromptFormat,
    build_prompt,
    continuation_text,
    option_letters,
    user_message,
    uses_chat_template,
)
from llm_calib.scoring.base import encode_continuation, encode_prompt


def test_reference_format_is_chat_template_with_default_system_then_prefix(tiny_tokenizer):
    text = build_prompt(tiny_tokenizer, "Capital of France?", ("Paris", "Rome"), PromptFormat())
    expected = (
        "<|im_start|>system\nYou are a tiny test model.<|im_end|>\n"
        "<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\nThe answer is:"
    )
    assert text == expected


def test_system_message_replaces_the_template_default(tiny_tokenizer):
    text = build_prompt(tiny_tokenizer, "Q?", fmt=PromptFormat(system_message="Be brief."))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ?")
    assert "tiny test model" not in text


def test_plain_prompt_without_chat_template(tiny_tokenizer, tiny_plain_tokenizer):
    fmt = PromptFormat(chat_template=False, system_message="Sys.", answer_prefix="Answer:")
    assert build_prompt(tiny_tokenizer, " Q? ", fmt=fmt) == "Sys.\n\nQ?\nAnswer:"
    # chat_template=None falls back to plain text when the tokenizer has no template
    assert not uses_chat_template(tiny_plain_tokenizer, PromptFormat())
    assert build_prompt(tiny_plain_tokenizer, "Q?") == "Q?\nThe answer is:"


def test_chat_template_required_but_missing(tiny_plain_tokenizer):
    with pytest.raises(ValueError, match="no chat template"):
        build_prompt(tiny_plain_tokenizer, "Q?", fmt=PromptFormat(chat_template=True))


def test_listed_style_letters_the_options():
    fmt = PromptFormat(style="listed")
    assert user_message("Pick.", ("x", "y", "z"), fmt) == "Pick.\nA. x\nB. y\nC. z"
    assert user_message("Pick.", ("x", "y", "z"), PromptFormat()) == "Pick."
    with pytest.raises(ValueError, match="options are required"):
        user_message("Pick.", None, fmt)


def test_invalid_format_fields_are_named():
    with pytest.raises(ValueError, match="style"):
        PromptFormat(style="letters")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chat_template"):
        PromptFormat(chat_template="yes")  # type: ignore[arg-type]


def test_option_letters_bounds():
    assert option_letters(26)[-1] == "Z"
    for bad in (0, 27):
        with pytest.raises(ValueError, match="number of options"):
            option_letters(bad)


def test_continuation_and_tokenisation(tiny_tokenizer, tiny_plain_tokenizer):
    assert continuation_text("  Paris ") == " Paris"
    chat_prompt = build_prompt(tiny_tokenizer, "Q?")
    ids = encode_prompt(tiny_tokenizer, chat_prompt, chat=True)
    start = tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(start) == 3  # system, user, assistant: no extra special token added
    assert tiny_tokenizer.decode(ids) == chat_prompt
    assert tiny_tokenizer.decode(encode_continuation(tiny_tokenizer, " Paris")) == " Paris"
    with pytest.raises(ValueError, match="no tokens"):
        encode_continuation(tiny_tokenizer, "")
