"""Loading a saved adapter onto its base model, and exporting a merged standalone model that
``AutoModelForCausalLM.from_pretrained`` loads alone, at the base model's inference cost.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from llm_calib.calm.lora import peft_deprecations_silenced
from llm_calib.calm.trainer import BASE_MODEL_FILE
from llm_calib.files.atomic import as_os_error, ordinary_modes, read_json, write_json_atomic

__all__ = ["ADAPTER_WEIGHTS", "EXPORT_FILE", "adapter_directory", "check_adapter_base", "check_export_target", "export_merged", "load_adapter", "merge_adapter", "merged_bytes", "merged_record",
           "saved_base", "saved_base_file"]

EXPORT_FILE = "llm_calib_export.json"
"""The record :func:`export_merged` writes next to the merged weights (the adapter merged; ``llm-calib
export`` adds the prompt, preset, scorer and normalisation it was calibrated with)."""


ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
"""The weight files peft saves an adapter in (safetensors by default)."""


def adapter_directory(path: str | os.PathLike[str]) -> Path:
    """The peft adapter directory of a saved calibration result (``adapter/``) or of an adapter,
    with its weights checked (present; a safetensors file whole, :func:`~llm_calib.files.checkpoint.safetensors_problem`).

    Raises:
        FileNotFoundError: no adapter there, or its weights are missing.
        ValueError: its weights are damaged (a copy cut short); the message names the file.

    Example:
        >>> import tempfile
        >>> adapter_directory(tempfile.mkdtemp())  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        FileNotFoundError: ...
    """
    from llm_calib.files.checkpoint import safetensors_problem

    src = Path(path)
    for candidate in (src, src / "adapter"):
        if (candidate / "adapter_config.json").is_file():
            weights = [candidate / name for name in ADAPTER_WEIGHTS if (candidate / name).is_file()]
            if not weights:
                raise FileNotFoundError(f"{candidate}: has adapter_config.json but no {ADAPTER_WEIGHTS[0]} (nor "
                                        f"{ADAPTER_WEIGHTS[1]}): the adapter's weights are missing")
            problem = safetensors_problem(weights[0]) if weights[0].suffix == ".safetensors" else None
            if problem is not None:
                raise ValueError(f"{weights[0]}: {problem}; the adapter's weights are damaged (a copy cut short?): "
                                 "copy or save the adapter again")
            return candidate
    raise FileNotFoundError(
        f"{src}: not a saved calibration result (no adapter/adapter_config.json) nor a peft adapter "
        "(no adapter_config.json)"
    )


def saved_base_file(path: str | os.PathLike[str]) -> Path | None:
    """The file where the saved result at ``path`` (or the one whose ``adapter/`` it is) records
    its base model (:data:`~llm_calib.calm.trainer.BASE_MODEL_FILE`); None for a plain peft adapter.

    Example:
        >>> import tempfile
        >>> saved_base_file(tempfile.mkdtemp()) is None
        True
    """
    src = Path(path)
    for candidate in (src, src.parent):
        if (candidate / BASE_MODEL_FILE).is_file():
            return candidate / BASE_MODEL_FILE
    return None


def saved_base(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The base model a saved result records (:func:`saved_base_file`: ``model``, ``dtype``,
    ``prompt``); empty for a plain peft adapter.

    Example:
        >>> import tempfile
        >>> saved_base(tempfile.mkdtemp())
        {}
    """
    record = saved_base_file(path)
    return dict(read_json(record)) if record is not None else {}


def merged_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What an exported merged model at ``path`` records (:data:`EXPORT_FILE`); empty for any other
    model (a hub name, an alias, a plain checkpoint).

    Example:
        >>> import tempfile
        >>> merged_record(tempfile.mkdtemp()), merged_record("smollm2-135m")
        ({}, {})
    """
    record = Path(path) / EXPORT_FILE
    return dict(read_json(record)) if record.is_file() else {}


def _same_model(a: str, b: str) -> bool:
    """Whether two model names (a local path, an alias, a hub name) name one model."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() or pb.exists():
        return pa.exists() and pb.exists() and _same_folder(pa, pb)
    return a.strip().rstrip("/").lower() == b.strip().rstrip("/").lower()


_DIFFERENCES = {"shapes": "another model: its tensors' names or shapes differ",
                "weights": "same shapes but other weights: another checkpoint, or a fine-tune",
                "config": "same weights but another config.json"}
"""How :func:`check_adapter_base` says what differs between two fingerprints, first difference first."""


def check_adapter_base(adapter: str | os.PathLike[str], model: str, *, allow_other_base: bool = False,
                       cache_dir: str | os.PathLike[str] | None = None) -> None:
    """Refuse to put the saved result ``adapter`` on ``model`` (as given to the loader: a path, an
    alias or a hub name) when it records another base (:func:`saved_base`): an adapter on another
    base of the same shape loads without a word and scores nonsense. The base is matched by content
    where the result records its fingerprint (:func:`~llm_calib.models.model_fingerprint`) and
    ``model``'s files are here: a copy or a moved folder of the base is accepted, another model (or
    another checkpoint of one) refused, whatever the paths say; otherwise (an older result, an
    uncached hub name) by name or folder. A plain peft adapter (no record) passes. Meant to run
    before the model is loaded.

    Raises:
        ValueError: another base and not ``allow_other_base``; names both, the file and what
            differs. With ``allow_other_base`` that is a warning instead.

    Example:
        >>> import json, pathlib, tempfile
        >>> run = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (run / "base_model.json").write_text(json.dumps({"model": "smollm2-135m-instruct"}))
        >>> check_adapter_base(run, "smollm2-135m-instruct")
        >>> check_adapter_base(run, "smollm2-360m-instruct")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: --adapter ... was trained on smollm2-135m-instruct (.../base_model.json), not on --model smollm2-360m-instruct; ...
    """
    import warnings

    from llm_calib.models import model_fingerprint

    record = saved_base_file(adapter)
    if record is None:
        return
    saved = saved_base(adapter)  # a truncated record: ValueError naming it
    trained_on = saved.get("model")
    if not trained_on:
        return
    recorded = saved.get("fingerprint")
    current = model_fingerprint(model, cache_dir) if isinstance(recorded, dict) else None
    if current is not None and recorded.get("scheme") == current["scheme"]:
        differs = [k for k in _DIFFERENCES if recorded.get(k) != current[k]]
        if not differs:
            return  # the base itself, wherever it is now
        why = _DIFFERENCES[differs[0]] + "; "
    elif _same_model(str(trained_on), str(model)):
        return
    else:
        why = ""  # by name: the result records no fingerprint, or --model has no local files
    message = f"--adapter {adapter} was trained on {trained_on} ({record}), not on --model {model}; {why}"
    if allow_other_base:
        warnings.warn(f"{message}applied anyway, as --allow-other-base asks", UserWarning, stacklevel=2)
        return
    raise ValueError(f"{message}leave out --model to use that base, or pass --allow-other-base to apply it anyway")


_SIZE_MISMATCH = re.compile(r"size mismatch for (\S+): copying a param with shape (torch\.Size\(\[[^\]]*\]\)) "
                            r"from checkpoint, the shape in current model is (torch\.Size\(\[[^\]]*\]\))")


def _shape_error(err: RuntimeError, path: str | os.PathLike[str]) -> ValueError | None:
    """peft's 40-line ``size mismatch`` error as one line naming the first tensor, or None for another error."""
    found = _SIZE_MISMATCH.findall(str(err))
    if not found:
        return None
    name, saved, current = found[0]
    trained_on = saved_base(path).get("model") if saved_base_file(path) is not None else None
    on = f" (trained on {trained_on})" if trained_on else ""
    return ValueError(f"--adapter {path} does not fit this model{on}: {len(found)} tensor(s) differ in shape, "
                      f"e.g. {name.replace('.default', '')} is {tuple(_dims(saved))} in the adapter, "
                      f"{tuple(_dims(current))} in the model; it was trained on another base")


def _dims(size: str) -> list[int]:
    return [int(d) for d in re.findall(r"\d+", size)]


def load_adapter(base_model: Any, path: str | os.PathLike[str]) -> Any:
    """Put the adapter saved at ``path`` (:func:`adapter_directory`) on ``base_model`` (eval mode).

    Raises:
        FileNotFoundError: ``path`` holds no adapter.
        ValueError: the adapter's tensors do not fit ``base_model`` (trained on another base); one
            line naming the first tensor and both shapes.

    Example:
        >>> import tempfile
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.calm.lora import attach_lora
        >>> from llm_calib.config.calibration import LoraSettings
        >>> d = tempfile.mkdtemp()
        >>> attach_lora(tiny_random_model()[0], LoraSettings(rank=2)).save_pretrained(d)
        >>> type(load_adapter(tiny_random_model()[0], d)).__name__
        'PeftModelForCausalLM'
    """
    from peft import PeftModel

    with peft_deprecations_silenced():
        try:
            model = PeftModel.from_pretrained(base_model, str(adapter_directory(path)))
        except RuntimeError as err:
            clear = _shape_error(err, path)
            if clear is None:
                raise
            raise clear from None
    model.eval()
    return model


def merge_adapter(model: Any) -> Any:
    """Fold a peft model's adapters into plain weights (a plain model is returned as it is).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.calm.lora import attach_lora
        >>> from llm_calib.config.calibration import LoraSettings
        >>> merged = merge_adapter(attach_lora(tiny_random_model()[0], LoraSettings(rank=2)))
        >>> type(merged).__name__, any("lora_" in n for n, _ in merged.named_parameters())
        ('LlamaForCausalLM', False)
    """
    if not hasattr(model, "merge_and_unload"):
        return model
    merged = model.merge_and_unload()
    leftover = [n for n, _ in merged.named_modules() if "lora_" in n or "modules_to_save" in n]
    if leftover:  # pragma: no cover - peft guarantees this; a clear error if it ever does not
        raise RuntimeError(f"merging left adapter modules behind: {leftover[:3]}")
    merged.eval()
    return merged


def _same_folder(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are one folder (symlinks resolved, or the same inode: a bind mount)."""
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:  # pragma: no cover - a race with a deletion: they are not the same then
        return False


def _identity(path: Path) -> tuple[int, int] | None:
    """``(device, inode)`` of an existing path (one folder seen through a symlink or a bind mount has one), else None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _ancestry(path: Path) -> set[tuple[int, int]]:
    """The identities of ``path`` and of every folder above it, along its written and its resolved
    chain (a folder reached through a symlink is inside the link's target)."""
    found = set()
    for start in (path.absolute(), path.resolve()):
        for p in (start, *start.parents):
            ident = _identity(p)
            if ident is not None:
                found.add(ident)
    return found


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or below it: by path (symlinks resolved) or by identity
    (a bind mount of ``folder``, a hard-linked view)."""
    ident = _identity(folder)
    return ident is not None and ident in _ancestry(path)


def _mount_points() -> list[Path] | None:
    """The mount points of this process's view (``/proc/self/mountinfo``), None where it cannot be read."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    unescape = lambda field: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)  # noqa: E731
    return [Path(unescape(line.split()[4])) for line in lines if len(line.split()) > 4]


def _holds(folder: Path, path: Path) -> bool:
    """Whether deleting ``folder`` would delete ``path``: ``path`` is inside it, or a mount point in
    ``folder``'s tree is ``path`` or a folder above it (a bind mount placed inside ``folder``; a
    symlink does not count: deletion does not follow symlinks)."""
    if _inside(path, folder):
        return True
    if not folder.is_dir():
        return False
    above = _ancestry(path)
    mounts = _mount_points()
    if mounts is not None:  # only a mount point can bring another folder into the tree
        root = folder.resolve()
        return any(m != root and m.is_relative_to(root) and _identity(m) in above for m in mounts)
    for top, dirs, _files in os.walk(folder):  # no mount table: look at every folder
        for name in list(dirs):
            if _identity(Path(top) / name) in above:
                return True
            if os.path.islink(Path(top) / name):
                dirs.remove(name)
    return False


def _run_folder(adapter: Path) -> Path | None:
    """The ``calibrate --out`` folder a saved result ``adapter`` (``RUN/<method>``) belongs to, when
    it is one (it holds the run's checkpoints, report or lock), else None."""
    from llm_calib.files.outputs import LOCK_FILE

    result = adapter.parent if adapter.name == "adapter" and (adapter.parent / "metrics.json").is_file() else adapter
    if not (result / "adapter").is_dir():
        return None
    run = result.absolute().parent
    markers = ("checkpoints", "report.md", LOCK_FILE)
    return run if any((run / m).exists() for m in markers) else None


def check_export_target(out: str | os.PathLike[str], base: str | os.PathLike[str] | None = None, *,
                        adapter: str | os.PathLike[str] | None = None, overwrite: bool = False) -> Path:
    """Refuse an export folder ``out`` that would destroy something. Always: the base model's
    folder ``base``, the ``adapter``'s, or the folder of the run that saved it, a folder that
    contains one of them, and a folder inside the base model's or the adapter's; a file. A
    non-empty folder that is not an earlier export (no :data:`EXPORT_FILE`) only with ``overwrite``,
    and never one of the run's own folders. Paths are compared resolved (symlinks, ``..``) and by
    identity (bind mounts). Meant to run before any model is loaded; :func:`export_merged` runs it again.

    Args:
        out: the folder the merged model will be written to.
        base: the base model as given to the loader (a hub name or alias, that is no local path,
            is not checked).
        adapter: the saved result or adapter being merged.
        overwrite: replace a non-empty folder of something else (never one of the above).

    Returns:
        ``out`` as a path.

    Raises:
        ValueError: as above; the message names ``out`` and what it would destroy.

    Example:
        >>> import pathlib, tempfile
        >>> base = pathlib.Path(tempfile.mkdtemp()) / "base"
        >>> base.mkdir()
        >>> _ = (base / "config.json").write_text("{}")
        >>> check_export_target(base.parent / "merged", base).name
        'merged'
        >>> check_export_target(base, base)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: export --out ...: this is the base model's folder (...); ...
        >>> check_export_target(base.parent, base, overwrite=True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: export --out ...: it holds the base model (...); ...
        >>> check_export_target(base, "smollm2-135m")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: export --out ...: a non-empty folder that llm-calib export did not write ...
    """
    target = Path(out)
    adapter_path = None if adapter is None or not Path(adapter).exists() else Path(adapter)
    protected = [("the base model", None if base is None or not Path(base).exists() else Path(base)),
                 ("the adapter", adapter_path),
                 ("the run", None if adapter_path is None else _run_folder(adapter_path))]
    for what, src in protected:
        if src is None:
            continue
        if _same_folder(target, src) or (what == "the adapter" and _same_folder(target, src / "adapter")):
            raise ValueError(f"export --out {target}: this is {what}'s folder ({src}); exporting there would "
                             "replace its weights. Choose a new folder")
        if _holds(target, src):
            raise ValueError(f"export --out {target}: it holds {what} ({src}); exporting there would delete "
                             "it. Choose a new folder")
        if what != "the run" and src.is_dir() and _inside(target, src):
            raise ValueError(f"export --out {target}: a folder inside {what}'s folder ({src}); exporting "
                             "there would change it. Choose a folder outside it")
    if target.exists() and not target.is_dir():
        raise ValueError(f"export --out {target}: exists and is not a folder; choose a folder")
    foreign = target.is_dir() and any(target.iterdir()) and not (target / EXPORT_FILE).is_file()
    run = protected[2][1]
    if foreign and run is not None and _inside(target, run):
        raise ValueError(f"export --out {target}: a folder of the run {run} that llm-calib export did not "
                         "write; --overwrite never deletes a run's folders. Choose a new folder")
    if foreign and not overwrite:
        raise ValueError(f"export --out {target}: a non-empty folder that llm-calib export did not write "
                         f"(no {EXPORT_FILE}); choose a new or empty folder, or pass --overwrite to replace it")
    return target


def merged_bytes(base: str | os.PathLike[str], dtype: str | None = None) -> int:
    """A rough lower bound of what exporting the local model ``base`` writes: its weight files'
    size, scaled from the checkpoint's dtype to ``dtype`` when both are known; 0 for a model that
    is no local folder (a hub name, an alias).

    Example:
        >>> import pathlib, tempfile
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (d / "model.safetensors").write_bytes(bytes(1000))
        >>> _ = (d / "config.json").write_text('{"torch_dtype": "bfloat16"}')
        >>> merged_bytes(d), merged_bytes(d, "float32"), merged_bytes("smollm2-135m")
        (1000, 2000, 0)
    """
    folder = Path(base).expanduser()
    if not folder.is_dir():
        return 0
    size = sum(p.stat().st_size for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    widths = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
    try:
        config = read_json(folder / "config.json")
        saved = config.get("torch_dtype") or config.get("dtype")
    except (OSError, ValueError, AttributeError):
        saved = None
    if dtype in widths and saved in widths:
        size = size * widths[dtype] // widths[saved]
    return size


def export_merged(
    base_model: Any, tokenizer: Any, adapter: str | os.PathLike[str], out: str | os.PathLike[str], *,
    overwrite: bool = False,
) -> Path:
    """Merge the adapter into ``base_model`` (in place) and save a standalone model to ``out``
    (safetensors, tokenizer, and :data:`EXPORT_FILE` naming the adapter).

    The model is written to a temporary folder beside ``out`` and renamed into place, so a failed
    export (a full disk) leaves ``out`` as it was. :func:`check_export_target` runs first, with
    ``base_model``'s ``name_or_path`` as the base: the base model's own folder is never replaced.

    Args:
        base_model: the loaded base model (changed in place).
        tokenizer: its tokenizer (saved with the merged weights).
        adapter: a saved calibration result or peft adapter (:func:`adapter_directory`).
        out: the folder to write.
        overwrite: replace a non-empty folder that is not an earlier export.

    Raises:
        ValueError: ``out`` is refused by :func:`check_export_target`.

    Example:
        >>> import tempfile
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.calm.lora import attach_lora
        >>> from llm_calib.config.calibration import LoraSettings
        >>> d, out = tempfile.mkdtemp(), tempfile.mkdtemp()
        >>> lora = attach_lora(tiny_random_model()[0], LoraSettings(rank=2), output_scale=True)
        >>> lora.save_pretrained(d)
        >>> model, tok = tiny_random_model()
        >>> [p.name for p in export_merged(model, tok, d, out).glob("*.safetensors")]
        ['model.safetensors']
    """
    src = adapter_directory(adapter)
    base_path = getattr(base_model, "name_or_path", None) or None
    target = check_export_target(out, base_path, adapter=adapter, overwrite=overwrite)
    merged = merge_adapter(load_adapter(base_model, src))
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        merged.save_pretrained(str(staging), safe_serialization=True)
        tokenizer.save_pretrained(str(staging))
        write_json_atomic(staging / EXPORT_FILE, {"adapter": str(src.resolve()), "merged": ["lora", "modules_to_save"]})
        ordinary_modes(staging)  # mkdtemp makes 0700 and safetensors writes model.safetensors 0600
        _replace_folder(staging, target)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        converted = as_os_error(err, target)  # a full disk: safetensors' error, not an OSError naming the folder
        if converted is not None:
            raise converted from err
        raise
    return target


def _replace_folder(new: Path, target: Path) -> None:
    """Put folder ``new`` at ``target`` by renames (the old ``target``, if any, moved aside first and
    removed after), so ``target`` is never a half-written folder."""
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".old"))
        os.replace(target, old / target.name)
    try:
        os.replace(new, target)
    except BaseException:
        if old is not None:
            os.replace(old / target.name, target)
        raise
    if old is not None:
        with contextlib.suppress(OSError):
            shutil.rmtree(old)
