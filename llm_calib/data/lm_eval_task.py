"""lm-evaluation-harness tasks as a data source (the ``lm_eval:TASK[:include=DIR,num_fewshot=N,fewshot_seed=S]``
loader; the ``lm-eval`` extra). lm-eval's own registry and ``Task.build_all_requests`` render the
prompts, few-shot examples and continuations: ``multiple_choice`` tasks give
:class:`~llm_calib.data.records.MultipleChoice` records with them verbatim, ``generate_until``
tasks :class:`~llm_calib.data.records.OpenQA` records with the ``until`` stop sequences. Details
and limits: :doc:`/tutorials/lm_eval`.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llm_calib.data.errors import DataError, ErrorLog, OnError
from llm_calib.data.records import MultipleChoice, OpenQA
from llm_calib.data.result import LoadResult

__all__ = ["LM_EVAL_EXTRA", "LM_EVAL_OPTIONS", "hub_offline", "hub_reachable", "load_lm_eval_task",
           "require_lm_eval"]

LM_EVAL_EXTRA = "pip install 'llm-calib[lm-eval]'"
"""The install command named when lm-eval is missing."""

LM_EVAL_OPTIONS = ("include", "num_fewshot", "fewshot_seed")
"""The ``key=value`` options of the ``lm_eval:TASK:OPTIONS`` spec."""

DEFAULT_FEWSHOT_SEED = 1234


def require_lm_eval() -> Any:
    """The ``lm_eval`` module, or an ImportError of one line naming the extra.

    Example:
        >>> import importlib.util
        >>> importlib.util.find_spec("lm_eval") is None or require_lm_eval().__name__ == "lm_eval"
        True
    """
    try:
        import lm_eval
    except ImportError:
        raise ImportError(f"lm-eval tasks need lm-eval 0.4.x: {LM_EVAL_EXTRA}") from None
    return lm_eval


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """lm-eval's per-task info/warning lines (default aggregations, ...) at ERROR level only."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether the Hugging Face hub (``HF_ENDPOINT``, default ``huggingface.co``) answers a TCP
    connection within ``timeout`` seconds; False at once when ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE``
    is set. One quick probe instead of ``datasets``' five retries (34 s) per file.

    Example:
        >>> import os
        >>> os.environ["HF_HUB_OFFLINE"] = "1"
        >>> hub_reachable()
        False
        >>> del os.environ["HF_HUB_OFFLINE"]
    """
    if any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in _OFFLINE_VARS):
        return False
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def hub_offline(offline: bool = True) -> Iterator[None]:
    """Within the block, ``huggingface_hub`` and ``datasets`` work offline (cached files only, no
    retries) when ``offline``; their settings and the environment are restored after. The
    libraries read ``HF_HUB_OFFLINE`` once, at import, so setting the variable alone is not enough.

    Example:
        >>> import os
        >>> with hub_offline():
        ...     os.environ["HF_HUB_OFFLINE"]
        '1'
    """
    if not offline:
        yield
        return
    import importlib

    saved_env = {v: os.environ.get(v) for v in _OFFLINE_VARS}
    patched: list[tuple[Any, str, Any]] = []
    for module, names in (("huggingface_hub.constants", ("HF_HUB_OFFLINE",)),
                          ("datasets.config", ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        for name in names:
            if hasattr(mod, name):
                patched.append((mod, name, getattr(mod, name)))
                setattr(mod, name, True)
    os.environ.update(dict.fromkeys(_OFFLINE_VARS, "1"))
    try:
        yield
    finally:
        for mod, name, value in reversed(patched):
            setattr(mod, name, value)
        for var, value in saved_env.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


_LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas", "imagefolder", "audiofolder")
"""``dataset_path`` values of lm-eval tasks that read local files (``dataset_kwargs: data_files``), not the hub."""


def _task_file(task: str, include: str | None) -> Path | None:
    """The YAML file defining the single task ``task`` (in ``include`` first, then lm-eval's own
    tasks), found by a text search of the files, without lm-eval's task index (10 s); None for a
    group, a tag or an unknown name."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("lm_eval")
    roots = [Path(include)] if include is not None else []
    if spec is not None and spec.submodule_search_locations:
        roots.append(Path(next(iter(spec.submodule_search_locations))) / "tasks")
    pattern = re.compile(rf"^task:\s*['\"]?{re.escape(task)}['\"]?\s*$", re.MULTILINE)
    for root in roots:
        for path in sorted(root.rglob("*.yaml")) if root.is_dir() else []:
            try:
                if pattern.search(path.read_text(encoding="utf-8", errors="replace")):
                    return path
            except OSError:
                continue
    return None


def _yaml_value(path: Path, key: str, depth: int = 0) -> str | None:
    """The top-level scalar ``key`` of an lm-eval task YAML, following its ``include:`` base files."""
    import re

    text = path.read_text(encoding="utf-8", errors="replace")
    found = re.search(rf"^{key}:\s*['\"]?([^'\"#\n]+?)['\"]?\s*(?:#.*)?$", text, re.MULTILINE)
    if found:
        return found.group(1).strip()
    base = re.search(r"^include:\s*['\"]?([^'\"#\n]+?)['\"]?\s*$", text, re.MULTILINE)
    if base and depth < 4 and (path.parent / base.group(1).strip()).is_file():
        return _yaml_value(path.parent / base.group(1).strip(), key, depth + 1)
    return None


def _offline_problem(task: str, include: str | None) -> str | None:
    """Offline, why the task ``task`` cannot load: its hub dataset is in neither local cache (the
    hub's, ``datasets``'); found in a second, before lm-eval builds its task index (10 s) and
    ``datasets`` fails. None when it may load (cached, local files) or cannot be told (a group, a tag)."""
    import huggingface_hub.constants as hub

    path = _task_file(task, include)
    dataset = _yaml_value(path, "dataset_path") if path is not None else None
    if dataset is None or dataset in _LOCAL_BUILDERS or Path(dataset).expanduser().exists():
        return None
    hub_cache = Path(hub.HF_HUB_CACHE) / f"datasets--{dataset.replace('/', '--')}"
    datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE") or Path(hub.HF_HOME) / "datasets")
    names = (dataset.replace("/", "___"), dataset.split("/")[-1])
    if hub_cache.exists() or any((datasets_cache / name).exists() for name in names):
        return None
    return (f"lm-eval cannot load the task: its dataset {dataset} ({path.name}) is not in the local cache "
            f"({hub_cache.parent}, {datasets_cache}) (offline: the Hugging Face hub is unreachable or HF_HUB_OFFLINE "
            "is set; only datasets already in the local cache load): run once online, or give the data as a local "
            "spec (e.g. arc_easy:PATH)")


def _close_names(task: str, names: Any) -> str:
    close = difflib.get_close_matches(task, sorted(str(n) for n in names), n=3, cutoff=0.75)
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


def _tasks(task: str, include: str | None) -> dict[str, Any]:
    from lm_eval.tasks import TaskManager

    if include is not None:
        if not Path(include).is_dir():
            raise FileNotFoundError(f"lm_eval:{task}: include directory {include} does not exist")
        local = TaskManager(include_path=include, include_defaults=False)
        if task in local.all_tasks:
            return _load_tasks(local, task)
    manager = TaskManager(include_path=include)
    if task not in manager.all_tasks:
        where = f" in {include} or" if include is not None else ""
        raise ValueError(f"lm_eval:{task}: no such task, group or tag{where} among lm-eval's tasks"
                         f"{_close_names(task, manager.all_tasks)}")
    return _load_tasks(manager, task)


def _load_tasks(manager: Any, task: str) -> dict[str, Any]:
    try:
        return dict(manager.load([task])["tasks"])
    except Exception as err:  # lm-eval's own config / template / data errors
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" and isinstance(err, ConnectionError | OSError)
        hint = (" (offline: the Hugging Face hub is unreachable or HF_HUB_OFFLINE is set; only datasets already in "
                "the local cache load)") if offline else ""
        raise DataError(f"lm_eval:{task}", 0, "task",
                        f"lm-eval cannot load the task: {type(err).__name__}: {err}{hint}") from err


def _gold(target: Any, choices: list[str], where: str) -> int:
    if isinstance(target, list):
        if len(target) != 1:
            raise ValueError(f"{where}: {len(target)} gold targets; one is supported")
        target = target[0]
    if isinstance(target, str) and target not in choices:
        if target.strip().isdigit():
            target = int(target)
        else:
            raise ValueError(f"{where}: target {target!r} is not one of the choices {choices}")
    index = choices.index(target) if isinstance(target, str) else int(target)
    if not 0 <= index < len(choices):
        raise ValueError(f"{where}: gold index {index} for {len(choices)} choices")
    return index


def _meta(name: str, doc_id: int, doc: Any) -> dict[str, str]:
    meta = {"lm_eval_task": name, "doc_id": str(doc_id)}
    if isinstance(doc, dict) and isinstance(doc.get("id"), (str, int)):
        meta["doc_key"] = str(doc["id"])
    return meta


def _records(name: str, task: Any) -> Iterator[tuple[int, Any]]:
    """``(doc_id, record or exception)`` for each document of one built task."""
    kind = task.OUTPUT_TYPE
    if kind not in ("multiple_choice", "generate_until"):
        raise ValueError(f"lm_eval:{name}: output_type {kind!r} is not supported (multiple_choice, generate_until)")
    if getattr(task, "multiple_input", False):
        raise ValueError(f"lm_eval:{name}: multiple-input tasks (several contexts) are not supported")
    by_doc: dict[int, list[Any]] = {}
    for inst in task.instances:
        by_doc.setdefault(inst.doc_id, []).append(inst)
    for doc_id in sorted(by_doc):
        insts = sorted(by_doc[doc_id], key=lambda i: i.idx)
        doc = insts[0].doc
        where = f"doc_id {doc_id}"
        try:
            text = task.doc_to_text(doc)
            question = text if isinstance(text, str) and text.strip() else insts[0].args[0]
            if kind == "multiple_choice":
                choices = [str(c) for c in task.doc_to_choice(doc)]
                # acc_mutual_info adds unconditional requests after the K conditional ones
                args = [i.args for i in insts[: len(choices)]]
                record: Any = MultipleChoice(
                    question, tuple(choices), _gold(task.doc_to_target(doc), choices, where), name, f"{name}/{doc_id}",
                    _meta(name, doc_id, doc), prompt=args[0][0], continuations=tuple(a[1] for a in args))
            else:
                target = task.doc_to_target(doc)
                answers = [str(t) for t in target] if isinstance(target, list) else [str(target)]
                until = insts[0].args[1].get("until") if len(insts[0].args) > 1 else None
                if isinstance(until, str):
                    until = [until]
                record = OpenQA(question, tuple(a for a in answers if a.strip()), name, f"{name}/{doc_id}",
                                _meta(name, doc_id, doc), prompt=insts[0].args[0], until=tuple(until) if until else None)
        except (ValueError, KeyError, TypeError, IndexError) as err:
            yield doc_id, err
            continue
        yield doc_id, record


def load_lm_eval_task(
    task: str, *, include: str | Path | None = None, num_fewshot: int | None = None,
    fewshot_seed: int = DEFAULT_FEWSHOT_SEED, on_error: OnError = "raise",
) -> LoadResult[Any]:
    """Records of an lm-eval task, group or tag (one kind per result), rendered by lm-eval.

    Args:
        task: an lm-eval task, group or tag name (e.g. ``"arc_easy"``, or a task of ``include``).
        include: a directory of task YAML files, searched before lm-eval's own tasks.
        num_fewshot: few-shot examples per document; None keeps the task's default (0 if unset).
        fewshot_seed: lm-eval's few-shot sampling seed.
        on_error: ``"raise"`` at the first document that cannot be converted, or ``"skip"`` it.

    Raises:
        ImportError: lm-eval is not installed (the message names the extra).
        FileNotFoundError: ``include`` is not a directory.
        ValueError: ``num_fewshot < 0``; no such task (close names suggested), an unsupported one
            (output type, multiple inputs) or mixed kinds.
        DataError: a document that cannot be converted, under ``on_error="raise"``.

    Example:
        >>> import importlib.util, tempfile, json, pathlib
        >>> if importlib.util.find_spec("lm_eval") is None:
        ...     print(2, "Question: Capital of France?\\nAnswer:", (" Paris", " Rome"))
        ... else:
        ...     d = pathlib.Path(tempfile.mkdtemp())
        ...     rows = [{"q": "Capital of France?", "c": ["Paris", "Rome"], "a": 0},
        ...             {"q": "Capital of Italy?", "c": ["Paris", "Rome"], "a": 1}]
        ...     _ = (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
        ...     _ = (d / "toy.yaml").write_text(
        ...         "task: toy\\ndataset_path: json\\n"
        ...         f"dataset_kwargs:\\n  data_files:\\n    test: {d / 'rows.jsonl'}\\n"
        ...         "output_type: multiple_choice\\ntest_split: test\\n"
        ...         'doc_to_text: "Question: {{q}}\\\\nAnswer:"\\ndoc_to_choice: "{{c}}"\\n'
        ...         "doc_to_target: a\\nmetric_list:\\n  - metric: acc\\n")
        ...     res = load_lm_eval_task("toy", include=d)
        ...     print(len(res), res.records[0].prompt, res.records[0].continuations)
        2 Question: Capital of France?
        Answer: (' Paris', ' Rome')
    """
    if num_fewshot is not None and num_fewshot < 0:
        raise ValueError(f"lm_eval:{task}: num_fewshot must be >= 0 (0 or more few-shot examples), got {num_fewshot}")
    require_lm_eval()
    include_dir = str(include) if include is not None else None
    records: list[Any] = []
    log = ErrorLog(on_error)
    kinds: set[str] = set()
    # offline, datasets retries every hub request five times (34 s); one probe, then cached files only
    offline = not hub_reachable()
    problem = _offline_problem(task, include_dir) if offline else None
    if problem is not None:  # in a second, not after lm-eval's task index (10 s) and datasets' attempts
        raise DataError(f"lm_eval:{task}", 0, "task", problem)
    with _quiet(), hub_offline(offline):
        tasks = _tasks(task, include_dir)
        for name in sorted(tasks):
            t = tasks[name]
            if num_fewshot is not None and t.get_config("num_fewshot") != 0:
                t.set_config(key="num_fewshot", value=num_fewshot)
            elif t.get_config("num_fewshot") is None:
                t.set_config(key="num_fewshot", value=0)
            t.set_fewshot_seed(seed=fewshot_seed)
            try:
                t.build_all_requests()
            except Exception as err:  # lm-eval's own template / data errors, for the whole task
                raise DataError(f"lm_eval:{name}", 0, "task",
                                f"lm-eval cannot build its requests: {type(err).__name__}: {err}") from err
            kinds.add(t.OUTPUT_TYPE)
            for doc_id, item in _records(name, t):
                if isinstance(item, Exception):
                    log.add(DataError(f"lm_eval:{name}", doc_id + 1, "doc", str(item)))
                else:
                    records.append(item)
    if len(kinds) > 1:
        raise ValueError(f"lm_eval:{task}: mixes {sorted(kinds)} tasks; load them separately")
    return LoadResult(records, skipped=log.skipped, errors=log.errors, source=f"lm_eval:{task}")
