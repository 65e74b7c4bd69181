"""``load(spec)``: a string ``LOADER[:TARGET[:OPTION]]`` names a data set, its location and option.

The first ``:`` ends the loader name; for file loaders the rest is all TARGET if it is an existing
path, else the text after its last ``:`` is the OPTION. A loader is a function registered by name
with :func:`register_loader` (the shipped ones, :data:`BUILTIN_LOADERS`, register themselves in
:mod:`llm_calib.data.spec_loaders`, imported the first time one of them is looked up); their targets and options: the table in
:doc:`/tutorials/evaluate_llm` ("Data specs").
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from llm_calib.data.errors import OnError
from llm_calib.data.result import LoadResult, subsample
from llm_calib.registry import LOADERS, Registry

__all__ = [
    "BUILTIN_LOADERS", "Spec", "SpecError", "SpecLoader", "absolute_spec", "load", "loader_names", "parse_spec",
    "register_loader", "spec_loader", "unregister_loader",
]


class SpecError(ValueError):
    """A data spec string that cannot be understood (unknown loader, bad option, ...).

    Example:
        >>> issubclass(SpecError, ValueError)
        True
    """


BUILTIN_LOADERS: tuple[str, ...] = tuple(LOADERS.builtins)
"""The loaders shipped with llm_calib, in the order error messages list them."""


@dataclass(frozen=True)
class Spec:
    """A parsed data spec: ``loader``, ``target`` (path, hub name or domains) and ``option``;
    ``text``: the spec as written (what error messages quote).

    Example:
        >>> parse_spec("builtin")
        Spec(loader='builtin', target='', option=None)
    """

    loader: str
    target: str
    option: str | None
    text: str = field(default="", repr=False, compare=False)

    @property
    def path(self) -> Path | None:
        """The file or directory the spec reads; None for a loader whose target is not a path
        (``builtin``, ``hf``, ``lm_eval``).

        Example:
            >>> parse_spec("arc_easy:data:train").path, parse_spec("builtin:capitals").path
            (PosixPath('data'), None)
        """
        entry = LOADERS.get(self.loader) if self.loader in LOADERS else None
        return None if entry is not None and not entry.takes_path else Path(self.target)

    def options(self, bare_key: str, allowed: set[str]) -> dict[str, str]:
        """The option as ``key=value`` pairs separated by commas; a part without ``=`` is the value
        of ``bare_key``.

        Raises:
            SpecError: a key not in ``allowed`` (lists them).

        Example:
            >>> parse_spec("hf:cais/mmlu:abstract_algebra,split=test").options("config", {"config", "split"})
            {'config': 'abstract_algebra', 'split': 'test'}
        """
        if not self.option:
            return {}
        out: dict[str, str] = {}
        for part in self.option.split(","):
            key, eq, value = part.partition("=")
            if not eq:
                key, value = bare_key, part
            key = key.strip()
            if key not in allowed:
                raise SpecError(f"unknown option {key!r} in spec {self.text!r}; valid: {', '.join(sorted(allowed))}")
            out[key] = value.strip()
        return out


@dataclass(frozen=True)
class SpecLoader:
    """A loader of the spec grammar: its ``name``, a one-line ``description``, the function
    ``load(spec, on_error)`` and whether its target is a path (``takes_path``: the path must exist,
    a relative one is made absolute by :func:`absolute_spec`, and an existing path may hold ``:``).

    Example:
        >>> spec_loader("builtin").takes_path, spec_loader("builtin").description
        (False, 'built-in generated multiple choice')
    """

    name: str
    description: str
    load: Callable[[Spec, OnError], LoadResult[Any]]
    takes_path: bool = True


L = TypeVar("L", bound=Callable[..., LoadResult[Any]])


def register_loader(name: str, description: str, *, path: bool = True) -> Callable[[L], L]:
    """Function decorator: register ``load(spec: Spec, on_error) -> LoadResult`` as the loader
    ``name`` of the spec grammar, so ``load("NAME:TARGET:OPTION")`` calls it with the parsed
    :class:`Spec`. ``path``: the target is a file or directory (checked to exist before the call).

    Raises:
        ~llm_calib.registry.InvalidNameError: ``name`` is not an identifier.
        ~llm_calib.registry.NameTakenError: another function holds it.

    Example:
        >>> from llm_calib.data.records import MultipleChoice
        >>> @register_loader("doc_one", "one question", path=False)
        ... def load_one(spec, on_error):
        ...     return LoadResult([MultipleChoice(spec.target or "2 + 2 = ?", ("3", "4"), 1, "toy", "q0")])
        >>> load("doc_one:1 + 1 = ?").records[0].question
        '1 + 1 = ?'
        >>> unregister_loader("doc_one")
    """
    LOADERS.check_name(name)

    def decorate(fn: L) -> L:
        LOADERS.register(name, SpecLoader(name, description, fn, path))
        return fn

    return decorate


unregister_loader = partial(Registry.unregister, LOADERS)
"""Remove a registered loader (:meth:`~llm_calib.registry.Registry.unregister`; a built-in one cannot be)."""

loader_names = partial(Registry.names, LOADERS)
"""The registered loaders: the built-in ones, then the others in registration order
(:meth:`~llm_calib.registry.Registry.names`)."""


def spec_loader(name: str) -> SpecLoader:
    """The loader registered as ``name``.

    Raises:
        SpecError: an unknown name (lists the registered ones).

    Example:
        >>> spec_loader("mmlu_stem").description
        'MMLU csv, stem subjects only'
    """
    if name not in LOADERS:
        raise SpecError(f"unknown loader {name!r}; valid loaders: {', '.join(loader_names())}")
    return LOADERS.get(name)


def parse_spec(spec: str) -> Spec:
    """Split a spec string into loader, target and option; ``SpecError`` lists the registered loaders.

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
        raise SpecError(f"unknown loader {loader!r} in spec {spec!r}; valid loaders: {', '.join(loader_names())}")
    if not LOADERS.get(loader).takes_path:
        target, sep, option = rest.partition(":")
        return Spec(loader, target, option if sep else None, spec)
    if not rest:
        raise SpecError(f"spec {spec!r} needs a path: '{loader}:PATH'")
    if (root / rest).exists() or ":" not in rest:
        return Spec(loader, rest, None, spec)
    target, option = rest.rsplit(":", 1)
    return Spec(loader, target, option, spec)


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
    if parsed.path is not None and not parsed.path.exists():
        raise FileNotFoundError(f"spec {spec!r}: {parsed.path} does not exist")
    result = LOADERS.get(parsed.loader).load(parsed, on_error)
    if limit_mode == "first" and limit is not None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        result.records = list(result.records[:limit])
    else:
        result.records = subsample(result.records, limit, seed)
    result.source = spec
    return result
