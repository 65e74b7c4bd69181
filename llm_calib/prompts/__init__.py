"""Prompts: how a record becomes the text before the scored continuation
(:mod:`~llm_calib.prompts.templates`: :class:`~llm_calib.prompts.templates.PromptFormat`, the
presets, few-shot rendering) and the few-shot pool loaded from the split a prompt names
(:mod:`~llm_calib.prompts.fewshot`).

This package file imports nothing.
"""

__all__: list[str] = []
