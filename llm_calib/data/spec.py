"""``load(spec)``: a string ``LOADER[:TARGET[:OPTION]]`` names a data set, its location and option.

The first ``:`` ends the loader name; for file loaders the rest is all TARGET if it is an existing
path, else the text after its last ``:`` is the OPTION. The loaders (:data:`LOADERS`), their
targets and options: the table in :doc:`/tutorials/evaluate_llm` ("Data specs").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
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
from llm_calib.data.result import LoadResult, subsample
from llm_calib.data.selfaware import load_selfaware

__all__ = ["LOADERS", "Spec", "SpecError", "absolute_spec", "load", "parse_spec"]


class SpecError(ValueError):
    """A data spec string that cannot be understood (unknown loader, bad option, ...).

    Example:
        >>> issubclass(SpecError, ValueError)
        True
    """


LOADERS: dict[str, str] = {
    "arc_easy": "ARC-Easy, AI2 jsonl",
    "arc_challenge": "ARC-Challenge, AI2 jsonl",
    "openbookqa": "OpenBookQA, AI2 jsonl",
    "commonsenseqa": "CommonsenseQA, AI2 jsonl",
    "qasc": "QASC, AI2 jsonl",
    "ai2": "any AI2-format jsonl",
    "mmlu": "MMLU csv, all four groups",
    **{f"mmlu_{g}": f"MMLU csv, {g.replace('_', ' ')} subjects only" for g in MMLU_GROUPS},
    "opentriviaqa": "OpenTriviaQA category files",
    "nq_open": "NQ-open jsonl (open QA)",
    "webquestions": "WebQuestions jsonl (open QA)",
    "selfaware": "SelfAware json (open QA)",
    "jsonl": "generic multiple-choice or open QA jsonl",
    "hf": "Hugging Face hub dataset (needs `datasets`)",
    "builtin": "built-in generated multiple choice",
    "lm_eval": "an lm-evaluation-harness task, group or tag (needs the `lm-eval` extra)",
}
"""Valid loader names of the spec grammar, with a one-line description each."""

_PATHLESS_LOADERS = ("hf", "builtin", "lm_eval")  # their target is a hub name, domains or a task

# dataset directory name and the file names tried for a split, for loaders taking a directory
_AI2_FILES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "arc_easy": ("arc_easy", "test", ("{split}.jsonl",)),
    "arc_challenge": ("arc_challenge", "test", ("{split}.jsonl",)),
    "openbookqa": ("openbookqa", "test", ("openbookqa.jsonl", "{split}.jsonl")),
    "commonsenseqa": ("commonsenseqa", "dev", ("genmc_{split}.jsonl", "{split}.jsonl")),
    "qasc": ("qasc", "dev", ("{split}.jsonl",)),
    "nq_open": ("nq_open", "dev", ("NQ-open.{split}.jsonl", "{split}.jsonl")),
    "webquestions": ("webquestions", "test", ("webq-{split}.jsonl", "{split}.jsonl")),
    "selfaware": ("selfaware", "", ("SelfAware.json",)),
}


@dataclass(frozen=True)
class Spec:
    """A parsed data spec: ``loader``, ``target`` (path, hub name or domains) and ``option``.

    Example:
        >>> parse_spec("builtin")
        Spec(loader='builtin', target='', option=None)
    """

    loader: str
    target: str
    option: str | None

    @property
    def path(self) -> Path | None:
        """The file or directory the spec reads; None for the ``builtin``, ``hf`` and ``lm_eval`` loaders.

        Example:
            >>> parse_spec("arc_easy:data:train").path, parse_spec("builtin:capitals").path
            (PosixPath('data'), None)
        """
        return None if self.loader in _PATHLESS_LOADERS else Path(self.target)


def parse_spec(spec: str) -> Spec:
    """Split a spec string into loader, target and option; ``SpecError`` lists the valid loaders.

    Example:
        >>> parse_spec("hf:allenai/ai2_arc:ARC-Challenge")
        Spec(loader='hf', target='allenai/ai2_arc', option='ARC-Challenge')
    """
    return _parse(spec, Path())


def _parse(spec: str, root: Path) -> Spec:
    """:func:`parse_spec` with a relative path looked up under ``root`` (whether it exists
    decides if a last ``:`` starts the option)."""
    if not spec or not spec.strip():
        raise SpecError("empty data spec")
    loader, _, rest = spec.strip().partition(":")
    if loader not in LOADERS:
        raise SpecError(f"unknown loader {loader!r} in spec {spec!r}; valid loaders: {', '.join(LOADERS)}")
    if loader in _PATHLESS_LOADERS:
        target, sep, option = rest.partition(":")
        return Spec(loader, target, option if sep else None)
    if not rest:
        raise SpecError(f"spec {spec!r} needs a path: '{loader}:PATH'")
    if (root / rest).exists() or ":" not in rest:
        return Spec(loader, rest, None)
    target, option = rest.rsplit(":", 1)
    return Spec(loader, target, option)


def absolute_spec(spec: str, relative_to: str | os.PathLike[str] | None = None) -> str:
    """``spec`` with a relative file or directory made absolute against ``relative_to`` (default:
    the working directory), so that a spec a file records names the same data when read from any
    directory; a spec without a path (``builtin``, ``hf``, ``lm_eval``) or with an absolute one
    comes back as given.

    Raises:
        SpecError: a malformed spec.

    Example:
        >>> absolute_spec("arc_easy:data:train", "/srv")
        'arc_easy:/srv/data:train'
        >>> absolute_spec("builtin:capitals:n=10")
        'builtin:capitals:n=10'
    """
    root = Path.cwd() if relative_to is None else Path(relative_to)
    parsed = _parse(spec, root)
    if parsed.path is None or parsed.path.is_absolute():
        return spec
    # abspath, not resolve(): the directory names as written, which loaders read domains from
    target = os.path.abspath(root / parsed.path)
    return f"{parsed.loader}:{target}" + ("" if parsed.option is None else f":{parsed.option}")


def _key_values(option: str | None, bare_key: str, allowed: set[str], spec: str) -> dict[str, str]:
    if not option:
        return {}
    out: dict[str, str] = {}
    for part in option.split(","):
        key, eq, value = part.partition("=")
        if not eq:
            key, value = bare_key, part
        key = key.strip()
        if key not in allowed:
            raise SpecError(f"unknown option {key!r} in spec {spec!r}; valid: {', '.join(sorted(allowed))}")
        out[key] = value.strip()
    return out


def _find_file(loader: str, target: Path, option: str | None, spec: str) -> Path:
    dataset_dir, default_split, patterns = _AI2_FILES[loader]
    if target.is_file():
        if option is not None:
            raise SpecError(f"spec {spec!r}: the option {option!r} only applies to a directory")
        return target
    split = option or default_split
    tried = []
    for base in (target, target / dataset_dir):
        for pattern in patterns:
            candidate = base / pattern.format(split=split)
            tried.append(str(candidate))
            if candidate.is_file():
                return candidate
    raise FileNotFoundError(f"spec {spec!r}: no {loader} file; tried {', '.join(tried)}")


def _mmlu_dir(target: Path, split: str) -> Path:
    for base in (target, target / "mmlu"):
        if (base / split).is_dir():
            return base / split
    return target


def _load_spec(s: Spec, spec: str, on_error: OnError) -> LoadResult[Any]:
    loader, option = s.loader, s.option
    if loader == "builtin":
        kv = _key_values(option, "n", {"n", "seed"}, spec)
        domains = [d.strip() for d in s.target.split(",") if d.strip()] or list(BUILTIN_DOMAINS)
        try:
            n, gen_seed = int(kv.get("n", 40)), int(kv.get("seed", 0))
        except ValueError:
            raise SpecError(f"spec {spec!r}: n and seed must be integers") from None
        return LoadResult(builtin_multiple_choice(n, gen_seed, domains), source=spec)
    if loader == "lm_eval":
        if not s.target:
            raise SpecError(f"spec {spec!r} needs a task name: 'lm_eval:TASK'")
        kv = _key_values(option, "include", set(LM_EVAL_OPTIONS), spec)
        try:
            shots = int(kv["num_fewshot"]) if "num_fewshot" in kv else None
            fs_seed = int(kv.get("fewshot_seed", 1234))
        except ValueError:
            raise SpecError(f"spec {spec!r}: num_fewshot and fewshot_seed must be integers") from None
        return load_lm_eval_task(
            s.target, include=kv.get("include"), num_fewshot=shots, fewshot_seed=fs_seed,
            on_error=on_error,
        )
    if loader == "hf":
        if not s.target:
            raise SpecError(f"spec {spec!r} needs a hub name: 'hf:NAME'")
        kv = _key_values(option, "config", {"config", "split"}, spec)
        return load_hub(s.target, config=kv.get("config"), split=kv.get("split"), on_error=on_error)
    target = Path(s.target)
    if not target.exists():
        raise FileNotFoundError(f"spec {spec!r}: {target} does not exist")
    if loader in _AI2_FILES:
        path = _find_file(loader, target, option if loader != "selfaware" else None, spec)
        if loader in ("nq_open", "webquestions"):
            return load_openqa_jsonl(path, domain=loader, on_error=on_error)
        if loader == "selfaware":
            keep = option or "all"
            if keep not in ("all", "answerable", "triviaqa"):
                raise SpecError(f"spec {spec!r}: selfaware option must be all, answerable or triviaqa")
            return load_selfaware(path, keep=keep, on_error=on_error)  # type: ignore[arg-type]
        return load_ai2(path, domain=loader, on_error=on_error)
    if loader == "ai2":
        return load_ai2(target, on_error=on_error)
    if loader == "jsonl":
        kind = option or "auto"
        if kind not in ("auto", "mc", "open"):
            raise SpecError(f"spec {spec!r}: jsonl option must be mc, open or auto")
        return load_jsonl(target, kind=kind, on_error=on_error)  # type: ignore[arg-type]
    if loader == "opentriviaqa":
        root = target / "opentriviaqa" if (target / "opentriviaqa").is_dir() else target
        cats = [c.strip() for c in option.split(",") if c.strip()] if option else None
        return load_opentriviaqa(root, categories=cats, on_error=on_error)
    # mmlu, mmlu_<group>
    parts = [p.strip() for p in (option or "").split(",") if p.strip()]
    splits = [p for p in parts if p in MMLU_SPLITS]
    subjects = [p for p in parts if p not in MMLU_SPLITS] or None
    if len(splits) > 1:
        raise SpecError(f"spec {spec!r}: give at most one MMLU split")
    path = target if target.is_file() else _mmlu_dir(target, splits[0] if splits else "test")
    groups = [loader.removeprefix("mmlu_")] if loader != "mmlu" else None
    return load_mmlu(path, groups=groups, subjects=subjects, on_error=on_error)


def load(
    spec: str, *, limit: int | None = None, seed: int = 0, on_error: OnError = "raise",
    limit_mode: str = "sample",
) -> LoadResult[Any]:
    """Load the data set a spec names, e.g. ``"arc_easy:../shared/data:dev"`` or ``"builtin"``.

    ``limit`` keeps a seeded :func:`~llm_calib.data.result.subsample` (``limit_mode="sample"``) or
    the first records (``"first"``, lm-eval's ``--limit``); ``on_error="skip"`` counts bad rows.
    Raises ``SpecError`` (malformed spec), ``DataError`` (bad row) or ``FileNotFoundError``.

    Example:
        >>> res = load("builtin:capitals,calendar:n=10", limit=5, seed=1)
        >>> len(res), res.skipped, res.source
        (5, 0, 'builtin:capitals,calendar:n=10')
    """
    if limit_mode not in ("sample", "first"):
        raise ValueError(f"limit_mode must be 'sample' or 'first', got {limit_mode!r}")
    parsed = parse_spec(spec)
    result = _load_spec(parsed, spec, on_error)
    if limit_mode == "first" and limit is not None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        result.records = list(result.records[:limit])
    else:
        result.records = subsample(result.records, limit, seed)
    result.source = spec
    return result
