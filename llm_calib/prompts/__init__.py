"""Prompts: how a record becomes the text before the scored continuation
(:mod:`~llm_calib.prompts.templates`: :class:`~llm_calib.prompts.templates.PromptFormat`, the
few-shot rendering) and prompt resolution, in one module (:mod:`~llm_calib.prompts.resolution`: the
multiple-choice prompt of a scorer, preset or saved result, the few-shot pool loaded from the split a
prompt names, the open-question prompt, and a run's prompt settings resolved once).

This package file imports nothing.
"""

__all__: list[str] = []
