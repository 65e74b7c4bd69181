"""Evaluation data: record types, loaders for the real data formats, a built-in generated set.

Every loader returns a :class:`LoadResult`; a bad row raises (or, with ``on_error="skip"``,
counts as) a :class:`DataError` naming file, line and field.

Example:
    >>> len(load("builtin:arithmetic:n=8"))
    8
"""

from llm_calib.data._io import repair_utf8
from llm_calib.data.ai2 import AI2_DATASETS, ai2_domain, load_ai2
from llm_calib.data.builtin import (
    BUILTIN_DOMAINS,
    BUILTIN_OPEN_DOMAINS,
    CAPITALS,
    ELEMENTS,
    builtin_multiple_choice,
    builtin_open_questions,
)
from llm_calib.data.errors import MAX_ERRORS, DataError, OnError
from llm_calib.data.hub import HUB_DATASETS, hub_row_to_record, load_hub
from llm_calib.data.jsonl import load_jsonl, mc_from_dict, openqa_from_dict
from llm_calib.data.lm_eval_task import load_lm_eval_task
from llm_calib.data.mmlu import MMLU_GROUPS, MMLU_SUBJECTS, load_mmlu, mmlu_group
from llm_calib.data.openqa import (
    load_nq_open,
    load_openqa_jsonl,
    load_webquestions,
    one_record_per_alias,
)
from llm_calib.data.opentriviaqa import OPENTRIVIAQA_CATEGORIES, load_opentriviaqa
from llm_calib.data.records import RECORD_KINDS, MultipleChoice, OpenQA
from llm_calib.data.result import LoadResult, subsample
from llm_calib.data.selfaware import filter_selfaware, load_selfaware
from llm_calib.data.spec import (
    BUILTIN_LOADERS,
    Spec,
    SpecError,
    SpecLoader,
    absolute_spec,
    load,
    loader_names,
    parse_spec,
    register_loader,
    spec_loader,
    unregister_loader,
)

__all__ = [
    "AI2_DATASETS", "BUILTIN_DOMAINS", "BUILTIN_LOADERS", "BUILTIN_OPEN_DOMAINS", "CAPITALS", "ELEMENTS",
    "HUB_DATASETS", "MAX_ERRORS", "MMLU_GROUPS", "MMLU_SUBJECTS",
    "OPENTRIVIAQA_CATEGORIES", "RECORD_KINDS", "DataError", "LoadResult", "MultipleChoice",
    "OnError", "OpenQA", "Spec", "SpecError", "SpecLoader", "absolute_spec", "ai2_domain", "builtin_multiple_choice",
    "builtin_open_questions", "filter_selfaware", "hub_row_to_record", "load", "load_ai2",
    "load_hub", "load_jsonl", "load_lm_eval_task", "load_mmlu", "load_nq_open", "load_openqa_jsonl",
    "load_opentriviaqa", "load_selfaware", "load_webquestions", "loader_names", "mc_from_dict", "mmlu_group",
    "one_record_per_alias", "openqa_from_dict", "parse_spec", "register_loader", "repair_utf8", "spec_loader",
    "subsample", "unregister_loader",
]
