"""The shipped loaders of the spec grammar (:data:`~llm_calib.data.spec.BUILTIN_LOADERS`), each
registered with :func:`~llm_calib.data.spec.register_loader`: they turn a parsed
:class:`~llm_calib.data.spec.Spec` into a call of the file loaders of :mod:`llm_calib.data`.
Importing :mod:`llm_calib.data` registers them.

Example:
    >>> from llm_calib.data.spec import load, parse_spec
    >>> len(load("builtin:capitals:n=3")), len(load_builtin_spec(parse_spec("builtin:capitals:n=2"), "raise"))
    (3, 2)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llm_calib.data.ai2 import load_ai2
from llm_calib.data.builtin import BUILTIN_DOMAINS, builtin_multiple_choice
from llm_calib.data.errors import OnError
from llm_calib.data.hub import load_hub
from llm_calib.data.jsonl import load_jsonl
from llm_calib.data.lm_eval_task import LM_EVAL_OPTIONS, load_lm_eval_task
from llm_calib.data.mmlu import MMLU_GROUPS, MMLU_SPLITS, load_mmlu
from llm_calib.data.openqa import load_openqa_jsonl
from llm_calib.data.opentriviaqa import load_opentriviaqa
from llm_calib.data.result import LoadResult
from llm_calib.data.selfaware import load_selfaware
from llm_calib.data.spec import Spec, SpecError, register_loader

__all__ = [
    "load_ai2_spec", "load_builtin_spec", "load_hf_spec", "load_jsonl_spec", "load_lm_eval_spec",
    "load_mmlu_spec", "load_named_file_spec", "load_opentriviaqa_spec",
]

# dataset directory name, default split and the file names tried for a split, for loaders taking a directory
_DATASET_FILES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "arc_easy": ("arc_easy", "test", ("{split}.jsonl",)),
    "arc_challenge": ("arc_challenge", "test", ("{split}.jsonl",)),
    "openbookqa": ("openbookqa", "test", ("openbookqa.jsonl", "{split}.jsonl")),
    "commonsenseqa": ("commonsenseqa", "dev", ("genmc_{split}.jsonl", "{split}.jsonl")),
    "qasc": ("qasc", "dev", ("{split}.jsonl",)),
    "nq_open": ("nq_open", "dev", ("NQ-open.{split}.jsonl", "{split}.jsonl")),
    "webquestions": ("webquestions", "test", ("webq-{split}.jsonl", "{split}.jsonl")),
    "selfaware": ("selfaware", "", ("SelfAware.json",)),
}

_DESCRIPTIONS = {
    "arc_easy": "ARC-Easy, AI2 jsonl",
    "arc_challenge": "ARC-Challenge, AI2 jsonl",
    "openbookqa": "OpenBookQA, AI2 jsonl",
    "commonsenseqa": "CommonsenseQA, AI2 jsonl",
    "qasc": "QASC, AI2 jsonl",
    "nq_open": "NQ-open jsonl (open QA)",
    "webquestions": "WebQuestions jsonl (open QA)",
    "selfaware": "SelfAware json (open QA)",
}


def _find_file(spec: Spec, option: str | None) -> Path:
    """The file of a named data set: ``spec``'s target if it is a file, else the split ``option``
    (default: the data set's) looked up in the target or its data set directory."""
    dataset_dir, default_split, patterns = _DATASET_FILES[spec.loader]
    target = Path(spec.target)
    if target.is_file():
        if option is not None:
            raise SpecError(f"spec {spec.text!r}: the option {option!r} only applies to a directory")
        return target
    split = option or default_split
    tried = []
    for base in (target, target / dataset_dir):
        for pattern in patterns:
            candidate = base / pattern.format(split=split)
            tried.append(str(candidate))
            if candidate.is_file():
                return candidate
    raise FileNotFoundError(f"spec {spec.text!r}: no {spec.loader} file; tried {', '.join(tried)}")


@register_loader("builtin", "built-in generated multiple choice", path=False)
def load_builtin_spec(spec: Spec, on_error: OnError) -> LoadResult[Any]:
    """``builtin[:DOMAINS[:n=N,seed=S]]``: :func:`~llm_calib.data.builtin.builtin_multiple_choice`
    (``on_error`` unused: generated questions have no bad rows)."""
    kv = spec.options("n", {"n", "seed"})
    domains = [d.strip() for d in spec.target.split(",") if d.strip()] or list(BUILTIN_DOMAINS)
    try:
        n, gen_seed = int(kv.get("n", 40)), int(kv.get("seed", 0))
    except ValueError:
        raise SpecError(f"spec {spec.text!r}: n and seed must be integers") from None
    return LoadResult(builtin_multiple_choice(n, gen_seed, domains), source=spec.text)


@register_loader("lm_eval", "an lm-evaluation-harness task, group or tag (needs the `lm-eval` extra)", path=False)
def load_lm_eval_spec(spec: Spec, on_error: OnError) -> LoadResult[Any]:
    """``lm_eval:TASK[:include=DIR,num_fewshot=K,fewshot_seed=S]``: :func:`~llm_calib.data.lm_eval_task.load_lm_eval_task`."""
    if not spec.target:
        raise SpecError(f"spec {spec.text!r} needs a task name: 'lm_eval:TASK'")
    kv = spec.options("include", set(LM_EVAL_OPTIONS))
    try:
        shots = int(kv["num_fewshot"]) if "num_fewshot" in kv else None
        fs_seed = int(kv.get("fewshot_seed", 1234))
    except ValueError:
        raise SpecError(f"spec {spec.text!r}: num_fewshot and fewshot_seed must be integers") from None
    return load_lm_eval_task(spec.target, include=kv.get("include"), num_fewshot=shots, fewshot_seed=fs_seed,
                             on_error=on_error)


@register_loader("hf", "Hugging Face hub dataset (needs `datasets`)", path=False)
def load_hf_spec(spec: Spec, on_error: OnError) -> LoadResult[Any]:
    """``hf:NAME[:config=C,split=S]``: :func:`~llm_calib.data.hub.load_hub`."""
    if not spec.target:
        raise SpecError(f"spec {spec.text!r} needs a hub name: 'hf:NAME'")
    kv = spec.options("config", {"config", "split"})
    return load_hub(spec.target, config=kv.get("config"), split=kv.get("split"), on_error=on_error)


def load_named_file_spec(spec: Spec, on_error: OnError) -> LoadResult[Any]:
    """``NAME:FILE`` or ``NAME:DIR[:SPLIT]`` of a named data set (ARC, OpenBookQA, CommonsenseQA,
    QASC; the open NQ-open and WebQuestions; ``selfaware:PATH[:all|answerable|triviaqa]``)."""
    loader, option = spec.loader, spec.option
    path = _find_file(spec, option if loader != "selfaware" else None)
    if loader in ("nq_open", "webquestions"):
        return load_openqa_jsonl(path, domain=loader, on_error=on_error)
    if loader == "selfaware":
        keep = option or "all"
        if keep not in ("all", "answerable", "triviaqa"):
            raise SpecError(f"spec {spec.text!r}: selfaware option must be all, answerable or triviaqa")
        return load_selfaware(path, keep=keep, on_error=on_error)  # type: ignore[arg-type]
    return load_ai2(path, domain=loader, on_error=on_error)


for _name, _description in _DESCRIPTIONS.items():
    register_loader(_name, _description)(load_named_file_spec)


@register_loader("ai2", "any AI2-format jsonl")
def load_ai2_spec(spec: Spec, on_error: OnError) -> LoadResult[Any]:
    """``ai2:PATH``: :func:`~llm_calib.data.ai2.load_ai2` (domains from the file names)."""
    return load_ai2(Path(spec.target), on_error=on_error)


@register_loader("jsonl", "generic multiple-choice or open QA jsonl")
def load_jsonl_spec(spec: Spec, on_error: OnError) -> LoadResult[Any]:
    """``jsonl:PATH[:mc|open|auto]``: :func:`~llm_calib.data.jsonl.load_jsonl`."""
    kind = spec.option or "auto"
    if kind not in ("auto", "mc", "open"):
        raise SpecError(f"spec {spec.text!r}: jsonl option must be mc, open or auto")
    return load_jsonl(Path(spec.target), kind=kind, on_error=on_error)  # type: ignore[arg-type]


@register_loader("opentriviaqa", "OpenTriviaQA category files")
def load_opentriviaqa_spec(spec: Spec, on_error: OnError) -> LoadResult[Any]:
    """``opentriviaqa:DIR[:CATEGORY,...]``: :func:`~llm_calib.data.opentriviaqa.load_opentriviaqa`."""
    target = Path(spec.target)
    root = target / "opentriviaqa" if (target / "opentriviaqa").is_dir() else target
    cats = [c.strip() for c in spec.option.split(",") if c.strip()] if spec.option else None
    return load_opentriviaqa(root, categories=cats, on_error=on_error)


def _mmlu_dir(target: Path, split: str) -> Path:
    for base in (target, target / "mmlu"):
        if (base / split).is_dir():
            return base / split
    return target


@register_loader("mmlu", "MMLU csv, all four groups")
def load_mmlu_spec(spec: Spec, on_error: OnError) -> LoadResult[Any]:
    """``mmlu:PATH[:SPLIT,SUBJECT,...]`` (and ``mmlu_<group>``, one group's subjects):
    :func:`~llm_calib.data.mmlu.load_mmlu`."""
    parts = [p.strip() for p in (spec.option or "").split(",") if p.strip()]
    splits = [p for p in parts if p in MMLU_SPLITS]
    subjects = [p for p in parts if p not in MMLU_SPLITS] or None
    if len(splits) > 1:
        raise SpecError(f"spec {spec.text!r}: give at most one MMLU split")
    target = Path(spec.target)
    path = target if target.is_file() else _mmlu_dir(target, splits[0] if splits else "test")
    groups = [spec.loader.removeprefix("mmlu_")] if spec.loader != "mmlu" else None
    return load_mmlu(path, groups=groups, subjects=subjects, on_error=on_error)


for _group in MMLU_GROUPS:
    register_loader(f"mmlu_{_group}", f"MMLU csv, {_group.replace('_', ' ')} subjects only")(load_mmlu_spec)
